"""The table of bench/RESULTS.md's section (branch multimask) from this folder's bench_*.json."""
import json, statistics as st
from pathlib import Path

HERE = Path(__file__).parent
def load(name, code, rep):
    d = json.load(open(HERE / f'bench_{name}_{code}_r{rep}.json'))
    return {r['arm']: r for r in d['runs']['overlap']}
def span(xs, fmt='{:.3f}'):
    return f"{fmt.format(st.median(xs))} [{fmt.format(min(xs))}-{fmt.format(max(xs))}]"
for name in ['ll_opt_off', 'xg_opt_off', 'll_opt_on', 'xg_opt_on']:
    try:
        runs = {c: [load(name, c, r) for r in range(3)] for c in ('main', 'multimask')}
    except FileNotFoundError:
        continue
    row = [name]
    for c in ('main', 'multimask'):
        rs = runs[c]
        free = [r['free']['total_tok_s'] for r in rs]; al = [r['all']['total_tok_s'] for r in rs]
        ratio = [a / f for a, f in zip(al, free)]
        dec = [r['all']['counters']['decode_steps'] for r in rs]
        tps = [r['all'].get('masked_tokens_per_step') for r in rs]
        valid = sum(r['all']['valid'] for r in rs); n = sum(r['all']['constrained'] for r in rs)
        row.append(f"{c}: free {span(free,'{:.0f}')} all {span(al,'{:.0f}')} all/free {span(ratio)} decode steps {span(dec,'{:.0f}')} tok/step {tps} valid {valid}/{n}")
    pair = [b['all']['total_tok_s'] / a['all']['total_tok_s'] for a, b in zip(runs['main'], runs['multimask'])]
    row.append(f"all after/before paired {span(pair)}")
    print('\n  '.join(row))
