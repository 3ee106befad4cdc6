#!/usr/bin/env python
"""Throughput and streaming latency of the three loops, side by side.

For each concurrency C (default 1, 4, 16, 64) and each loop ("normal", "overlap",
"async_decode"), C closed-loop clients each stream requests back to back through
``engine.submit`` + ``async for delta in handle``. A request is a random byte-token
prompt (seeded, 32-128 tokens), greedy, ``ignore_eos=True``, ``max_new_tokens`` 64.

Measured per run: output tokens/s over the run's wall time, TTFT (submit -> first
stream delta) p50/p99, inter-token latency (gap between consecutive deltas of one
request) p50/p99, end-to-end request latency p50, total wall, process CPU time, and
the scheduler's step counts. Every config is repeated N times (default 3); the loops
run interleaved within each repeat (order rotated per repeat), each run on a fresh engine
(``--engines shared`` keeps one engine per loop instead), and the table shows the median
over repeats. The "x normal" column is the median over repeats of the paired ratio
tok/s(loop) / tok/s(normal).

Runs under uvloop. Results: bench/results/throughput.json (or --out).

    python bench/throughput.py                       # defaults, ~1-2 min on 2 cores
    python bench/throughput.py --concurrency 1,8 --max-new-tokens 128 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import resource
import sys
import time
from typing import Any

import _common as C

from omni_async import Engine, SamplingParams


# ----------------------------------------------------------------- one run


async def run_once(
    engine: Engine,
    prompts: list[list[int]],
    concurrency: int,
    per_client: int,
    max_new_tokens: int,
) -> dict[str, Any]:
    """``concurrency`` clients, each streaming ``per_client`` requests back to back."""
    sched = engine.scheduler
    stats0 = (sched.stats.steps, sched.stats.prefill_steps, sched.stats.decode_steps, sched.stats.tokens_out)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    ttft: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    tokens_per_req: list[int] = []
    multi_token_deltas = 0
    finish_reasons: dict[str, int] = {}

    async def client(cid: int) -> None:
        nonlocal multi_token_deltas
        for k in range(per_client):
            ids = prompts[(cid * per_client + k) % len(prompts)]
            t_submit = time.perf_counter()
            handle = await engine.submit(input_ids=ids, sampling=sampling)
            last = None
            n = 0
            reason = None
            async for delta in handle:
                now = time.perf_counter()
                if last is None:
                    ttft.append(now - t_submit)
                else:
                    itl.append(now - last)
                last = now
                n += len(delta.token_ids)
                if len(delta.token_ids) > 1:
                    multi_token_deltas += 1
                if delta.finished:
                    reason = delta.finish_reason
            e2e.append(time.perf_counter() - t_submit)
            tokens_per_req.append(n)
            finish_reasons[str(reason)] = finish_reasons.get(str(reason), 0) + 1

    host = C.HostLoad()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    load = host.stop()
    st = sched.stats
    steps, prefill_steps, decode_steps, tokens_out = (
        st.steps - stats0[0],
        st.prefill_steps - stats0[1],
        st.decode_steps - stats0[2],
        st.tokens_out - stats0[3],
    )
    total_tokens = sum(tokens_per_req)
    return {
        "requests": len(tokens_per_req),
        "output_tokens": total_tokens,
        "wall_s": wall,
        "tokens_per_s": total_tokens / wall if wall > 0 else None,
        "ttft_p50_ms": C.ms(C.percentile(ttft, 50)),
        "ttft_p99_ms": C.ms(C.percentile(ttft, 99)),
        "itl_p50_ms": C.ms(C.percentile(itl, 50)),
        "itl_p99_ms": C.ms(C.percentile(itl, 99)),
        "itl_max_ms": C.ms(max(itl) if itl else None),
        "e2e_p50_ms": C.ms(C.percentile(e2e, 50)),
        "cpu_s": cpu,
        "cpu_util_cores": cpu / wall if wall > 0 else None,
        "cpu_ms_per_token": 1000 * cpu / total_tokens if total_tokens else None,
        "sys_cpu_share": (ru1.ru_stime - ru0.ru_stime) / cpu if cpu > 0 else None,
        "minor_faults_per_token": (ru1.ru_minflt - ru0.ru_minflt) / total_tokens if total_tokens else None,
        "steps": steps,
        "prefill_steps": prefill_steps,
        "decode_steps": decode_steps,
        "mean_decode_batch": (tokens_out - _prefill_tokens_estimate(tokens_per_req)) / decode_steps
        if decode_steps
        else None,
        "multi_token_deltas": multi_token_deltas,
        "finish_reasons": finish_reasons,
        "short_requests": sum(1 for n in tokens_per_req if n != max_new_tokens),
        "others_cores": load["others_cores"],
        "steal_cores": load["steal_cores"],
    }


def _prefill_tokens_estimate(tokens_per_req: list[int]) -> int:
    # Each request's first token comes from its (last) prefill step; the rest from decode steps.
    return sum(1 for n in tokens_per_req if n > 0)


# ----------------------------------------------------------------- driver


METRICS = (
    "tokens_per_s",
    "wall_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "itl_max_ms",
    "e2e_p50_ms",
    "cpu_s",
    "cpu_util_cores",
    "cpu_ms_per_token",
    "sys_cpu_share",
    "minor_faults_per_token",
    "others_cores",
    "steal_cores",
    "mean_decode_batch",
    "decode_steps",
    "prefill_steps",
)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    loops = C.parse_loops(args.loops)
    concurrencies = C.parse_int_list(args.concurrency)
    facts = C.machine_facts()
    facts["event_loop"] = C.event_loop_name()
    facts["malloc"] = args.malloc_info

    model_desc: dict[str, Any]
    model = args.model
    if model == "llama-random":
        model, model_desc = C.write_random_llama(seed=args.seed)
    elif model == "tiny":
        model_desc = dict(C.TINY_DESC)
    else:
        model_desc = {"kind": "folder", "path": model}

    max_c = max(concurrencies)
    plans = {c: max(args.requests_per_client, -(-args.min_requests // c)) for c in concurrencies}
    n_prompts = max(c * plans[c] for c in concurrencies)
    prompts = C.make_prompts(n_prompts, args.seed, args.prompt_min, args.prompt_max)

    def build(name: str) -> Engine:
        return Engine.from_pretrained(
            model, device="cpu", loop=name, seed=args.seed, max_running_requests=max(64, max_c)
        )

    resolve_counts: dict[str, dict[str, int]] = {name: {"hit": 0, "miss": 0} for name in loops}

    def add_counts(name: str, engine: Engine) -> None:
        # The runner no longer counts event hits/misses at collect (one collect path);
        # the field stays in the JSON for comparison with older results.
        return None

    # One-off process warm-up: the first forwards of a fresh torch process are slow.
    async with build(loops[0]) as e:
        for c in sorted({1, max_c}):
            await run_once(e, prompts, c, 1, min(8, args.max_new_tokens))

    shared: dict[str, Engine] = {}
    if args.engines == "shared":
        for name in loops:
            shared[name] = build(name)
            await shared[name].start()
            for c in sorted({1, max_c}):
                await run_once(shared[name], prompts, c, 1, min(8, args.max_new_tokens))

    async def measured_run(name: str, c: int) -> dict[str, Any]:
        if args.engines == "shared":
            return await run_once(shared[name], prompts, c, plans[c], args.max_new_tokens)
        # A fresh engine (model weights + KV cache) per run, warmed with a short burst at
        # the same concurrency, then closed: no loop keeps a memory layout of its own.
        engine = build(name)
        async with engine:
            await run_once(engine, prompts, c, 1, min(8, args.max_new_tokens))
            res = await run_once(engine, prompts, c, plans[c], args.max_new_tokens)
        add_counts(name, engine)
        del engine
        gc.collect()
        return res

    try:
        runs: dict[tuple[int, str], list[dict[str, Any]]] = {(c, l): [] for c in concurrencies for l in loops}
        t_all = time.perf_counter()
        for r in range(args.repeats):
            for c in concurrencies:
                order = loops[r % len(loops) :] + loops[: r % len(loops)]
                for name in order:
                    attempts = 0
                    while True:
                        attempts += 1
                        res = await measured_run(name, c)
                        busy = res["others_cores"] is not None and res["others_cores"] > args.busy_threshold
                        if not busy or attempts > args.busy_retries:
                            break
                        print(
                            f"    (other processes used {res['others_cores']:.2f} cores: waiting for a quiet "
                            f"moment and re-running, attempt {attempts + 1})",
                            flush=True,
                        )
                        await C.wait_quiet(args.quiet_wait, args.busy_threshold)
                    res["repeat"] = r
                    res["attempts"] = attempts
                    res["disturbed"] = busy
                    runs[(c, name)].append(res)
                    print(
                        f"  repeat {r} c={c:<3} {name:<12} {res['tokens_per_s']:8.1f} tok/s  "
                        f"ttft p50 {res['ttft_p50_ms']:7.1f} ms  itl p50 {res['itl_p50_ms']:6.2f} ms  "
                        f"wall {res['wall_s']:.2f} s",
                        flush=True,
                    )
                    if res["short_requests"]:
                        print(f"    WARNING: {res['short_requests']} request(s) ended short: {res['finish_reasons']}")
        measured_s = time.perf_counter() - t_all
        for name, e in shared.items():
            add_counts(name, e)
    finally:
        # Engine.start() enters an anyio task group in the calling task, so engines
        # started together must be closed in the reverse order (LIFO), from this task.
        for e in reversed(list(shared.values())):
            await e.aclose()

    summary = []
    for c in concurrencies:
        for name in loops:
            rs = runs[(c, name)]
            row: dict[str, Any] = {"concurrency": c, "loop": name, "requests_per_run": rs[0]["requests"]}
            for m in METRICS:
                row[m] = C.median_or_none(x[m] for x in rs)
            if "normal" in loops:
                base = runs[(c, "normal")]
                ratios = [
                    x["tokens_per_s"] / b["tokens_per_s"]
                    for x, b in zip(rs, base)
                    if x["tokens_per_s"] and b["tokens_per_s"]
                ]
                row["tokens_per_s_vs_normal"] = C.median_or_none(ratios)
                itl_ratios = [x["itl_p50_ms"] / b["itl_p50_ms"] for x, b in zip(rs, base) if x["itl_p50_ms"] and b["itl_p50_ms"]]
                row["itl_p50_vs_normal"] = C.median_or_none(itl_ratios)
            row["tokens_per_s_spread"] = [min(x["tokens_per_s"] for x in rs), max(x["tokens_per_s"] for x in rs)]
            row["others_cores_max"] = max((x["others_cores"] or 0.0) for x in rs)
            row["disturbed_runs"] = sum(1 for x in rs if x["disturbed"])
            summary.append(row)

    return {
        "benchmark": "throughput",
        "machine": facts,
        "model": model_desc,
        "config": {
            "loops": loops,
            "concurrency": concurrencies,
            "requests_per_run": {str(c): c * plans[c] for c in concurrencies},
            "max_new_tokens": args.max_new_tokens,
            "prompt_len": [args.prompt_min, args.prompt_max],
            "repeats": args.repeats,
            "seed": args.seed,
            "sampling": "greedy, ignore_eos=True",
            "engines": args.engines,
            "order": "loops interleaved within each repeat, rotated per repeat"
            + ("; a fresh engine per run" if args.engines == "fresh" else "; one engine per loop, started up front"),
            "aggregate": "median over repeats; ratios are medians of per-repeat paired ratios",
            "busy_threshold_cores": args.busy_threshold,
            "busy_retries": args.busy_retries,
        },
        "loadavg_at_end": C.loadavg(),
        "measured_wall_s": measured_s,
        "async_resolve_counts": resolve_counts,
        "summary": summary,
        "runs": {f"c={c}/{name}": rs for (c, name), rs in runs.items()},
    }


def print_table(result: dict[str, Any]) -> None:
    m = result["machine"]
    print()
    print(
        f"model={result['model']['kind']}  max_new_tokens={result['config']['max_new_tokens']}  "
        f"repeats={result['config']['repeats']} (median)  cpus={m['cpu_count']}  torch={m['torch']} "
        f"threads={m['torch_num_threads']}  loop={m['event_loop']}"
    )
    hdr = (
        f"{'conc':>4} {'loop':<12} {'reqs':>4} {'tok/s':>8} {'x normal':>8} {'tok/s range':^15} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'ITL p99':>8} {'wall s':>7} {'CPU ms/tok':>10} {'dec bs':>6} {'bg':>5}"
    )
    print(hdr)
    print("-" * len(hdr))
    for row in result["summary"]:
        print(
            f"{row['concurrency']:>4} {row['loop']:<12} {row['requests_per_run']:>4} "
            f"{C.fmt(row['tokens_per_s'], '.1f'):>8} {C.fmt(row.get('tokens_per_s_vs_normal'), '.3f'):>8} "
            f"{row['tokens_per_s_spread'][0]:>7.0f}-{row['tokens_per_s_spread'][1]:<7.0f}"
            f"{C.fmt(row['ttft_p50_ms'], '.1f'):>9} {C.fmt(row['ttft_p99_ms'], '.1f'):>9} "
            f"{C.fmt(row['itl_p50_ms'], '.2f'):>8} {C.fmt(row['itl_p99_ms'], '.2f'):>8} "
            f"{C.fmt(row['wall_s'], '.2f'):>7} {C.fmt(row['cpu_ms_per_token'], '.3f'):>10} "
            f"{C.fmt(row['mean_decode_batch'], '.1f'):>6} {row['others_cores_max']:>5.2f}"
        )
    print(
        "(TTFT/ITL in ms; 'x normal' = median paired tok/s ratio vs the normal loop; 'tok/s range' = min-max over "
        "repeats; 'dec bs' = mean decode batch; 'bg' = max cores used by other processes during a counted run)"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="'tiny', 'llama-random' (512x8 random Llama), or a folder")
    p.add_argument("--loops", default=",".join(C.LOOPS), help="comma-separated loops to compare")
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated concurrencies")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompt-min", type=int, default=32)
    p.add_argument("--prompt-max", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests-per-client", type=int, default=2, help="requests each client sends back to back")
    p.add_argument("--min-requests", type=int, default=8, help="at least this many requests per run (low C)")
    p.add_argument(
        "--malloc", choices=("steady", "default"), default="steady",
        help="steady: pin glibc malloc's mmap/trim thresholds (repeatable runs, see _common.steady_malloc); "
        "default: leave the allocator as it is",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--busy-threshold", type=float, default=0.3,
        help="a run during which other processes used more cores than this is re-run",
    )
    p.add_argument("--busy-retries", type=int, default=1, help="re-runs allowed per disturbed run (0: never)")
    p.add_argument("--quiet-wait", type=float, default=5.0, help="max seconds to wait for a quiet host before a re-run")
    p.add_argument(
        "--engines", choices=("fresh", "shared"), default="fresh",
        help="fresh: a new engine per run (default); shared: one engine per loop for the whole run. With "
        "'shared' the engines' memory layouts differ for the whole run and can bias one loop (see RESULTS.md)",
    )
    p.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--out", default="throughput.json", help="file name under bench/results/, or a path")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return C.run_benchmark(parse_args(argv), main_async, print_table)


if __name__ == "__main__":
    sys.exit(main())
