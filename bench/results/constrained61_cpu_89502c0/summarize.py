import json, glob, statistics, sys, collections, os
d = sys.argv[1]
rows = collections.defaultdict(list)
for f in sorted(g for g in glob.glob(f"{d}/*.json") if not os.path.basename(g).startswith("steps_")):
    name = os.path.basename(f)[:-5]
    cfg, rest = name.rsplit("_r", 1)[0], name.rsplit("_r", 1)[1]
    parts = cfg.split("_")
    code, be = parts[-1], parts[-2]
    conf = "_".join(parts[:-2])
    j = json.load(open(f))
    runs = j["runs"]["overlap"]
    by = {r["arm"]: r for r in runs}
    fr, al = by["free"], by["all"]
    c = al["counters"]
    rows[(conf, be, code)].append(dict(free=fr["total_tok_s"], all=al["total_tok_s"], ratio=al["total_tok_s"] / fr["total_tok_s"],
        valid=al["valid"], n=al["constrained"], acc=al["grammar_accepted"], steps=c["decode_steps"], fsteps=fr["counters"]["decode_steps"],
        refused=c["grammar_optimistic_refused"], tokens=al["tokens"], mask=al["mask_pct_of_step"] or 0, eq=al["equal_lengths"]))
def sp(xs, f="{:.0f}"):
    return f"{f.format(statistics.median(xs))} [{f.format(min(xs))}-{f.format(max(xs))}]"
print("| config | backend | code | free tok/s | all tok/s | all/free (per process) | decode steps all / free | refused guesses | valid (all arm) |")
print("|---|---|---|---|---|---|---|---|---|")
for (conf, be, code), rs in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] != "before")):
    print(f"| {conf} | {be} | {code} | {sp([r['free'] for r in rs])} | {sp([r['all'] for r in rs])} | {sp([r['ratio'] for r in rs], '{:.3f}')} | "
          f"{statistics.median(r['steps'] for r in rs):.0f} / {statistics.median(r['fsteps'] for r in rs):.0f} | {statistics.median(r['refused'] for r in rs):.0f} | "
          f"{sum(r['valid'] for r in rs)}/{sum(r['n'] for r in rs)} (grammar accepts {sum(r['acc'] for r in rs)}) |")
# paired after/before all-arm ratio by rep
print()
for conf in sorted({k[0] for k in rows}):
    for be in ("llguidance", "xgrammar"):
        b, a = rows.get((conf, be, "before")), rows.get((conf, be, "after"))
        if a and b:
            pr = [x["all"] / y["all"] for x, y in zip(a, b)]
            print(f"{conf} {be}: all-constrained tok/s after/before, paired by repeat: {sp(pr, '{:.2f}')}; all/free ratio before {sp([r['ratio'] for r in b], '{:.3f}')} after {sp([r['ratio'] for r in a], '{:.3f}')}")
