#!/usr/bin/env python
"""Print the Markdown tables of bench/RESULTS.md from the JSON files under bench/results/.

    python bench/summarize.py                  # throughput.json, loop_lag.json, idle_cpu.json
    python bench/summarize.py --throughput results/throughput_torch-threads-1.json

Only reads files; runs nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def _f(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _load(path: str | None, default: str) -> dict[str, Any] | None:
    p = Path(path) if path else RESULTS / default
    if not p.is_absolute() and not p.exists():
        p = RESULTS / p.name
    if not p.is_file():
        print(f"(no {p})\n")
        return None
    return json.loads(p.read_text())


def machine_line(d: dict[str, Any]) -> str:
    m = d["machine"]
    commit = m.get("omni_async_snapshot_commit") or m.get("git_commit")
    return (
        f"{m['cpu_count']} CPUs ({m.get('cpu_model')}), {m['platform']}, Python {m['python']}, torch {m['torch']} "
        f"({m['torch_num_threads']} intra-op threads), uvloop {m.get('uvloop')}, omni_async @ {str(commit)[:10]}, "
        f"malloc {m.get('malloc', {}).get('mode', '?')}, {m['date_utc']}"
    )


def throughput(d: dict[str, Any]) -> None:
    cfg = d["config"]
    print(f"Throughput: {machine_line(d)}")
    print(
        f"tiny model, greedy, ignore_eos, max_new_tokens={cfg['max_new_tokens']}, prompts {cfg['prompt_len'][0]}-"
        f"{cfg['prompt_len'][1]} tokens, median of {cfg['repeats']} interleaved repeats ({cfg.get('engines', 'shared')} engines)\n"
    )
    print("| C | loop | tok/s (min-max) | x normal | TTFT p50 / p99 ms | ITL p50 / p99 ms | wall s | CPU ms/tok | decode steps |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in d["summary"]:
        lo, hi = r["tokens_per_s_spread"]
        print(
            f"| {r['concurrency']} | {r['loop']} | {r['tokens_per_s']:.0f} ({lo:.0f}-{hi:.0f}) | "
            f"{_f(r.get('tokens_per_s_vs_normal'), '.2f')} | {r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} | "
            f"{r['itl_p50_ms']:.2f} / {r['itl_p99_ms']:.2f} | {r['wall_s']:.2f} | {r['cpu_ms_per_token']:.2f} | "
            f"{r['decode_steps']:.0f} |"
        )
    print()


def _gc2(r: dict[str, Any]) -> str:
    g = r.get("gc_collections")
    return str(g[2]) if g else "-"


def loop_lag(d: dict[str, Any]) -> None:
    cfg = d["config"]
    print(f"Loop lag: {machine_line(d)}")
    print(
        f"ticker sleeps 1 ms; saturated = {cfg['concurrency']} clients x {cfg['max_new_tokens']} new tokens for "
        f"{cfg['saturated_duration_s']:.0f} s; lag = interval - 1 ms; gc.freeze: {cfg.get('gc_freeze', False)}\n"
    )
    print("| model | loop | phase | p50 ms | p99 ms | p99.9 ms | max ms | full GCs | tok/s | p99 x normal |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    b = d["no_engine"]
    print(
        f"| - | - | no engine | {b['lag_p50_ms']:.3f} | {b['lag_p99_ms']:.3f} | {b['lag_p999_ms']:.3f} | "
        f"{b['lag_max_ms']:.2f} | {_gc2(b)} | - | - |"
    )
    for r in d["rows"]:
        print(
            f"| {r['model']} | {r['loop']} | {r['phase']} | {r['lag_p50_ms']:.3f} | {r['lag_p99_ms']:.3f} | "
            f"{r['lag_p999_ms']:.3f} | {r['lag_max_ms']:.2f} | {_gc2(r)} | {_f(r.get('tokens_per_s'), '.0f')} | "
            f"{_f(r.get('lag_p99_vs_normal'), '.2f')} |"
        )
    print()


def idle_cpu(d: dict[str, Any]) -> None:
    cfg = d["config"]
    print(f"Idle CPU and wake-up: {machine_line(d)}")
    print(
        f"idle {cfg['idle_s']:.0f} s; wake-up = submit -> first delta, {cfg['requests']} sequential requests, "
        f"prompt {cfg['prompt_len']} tokens, max_new_tokens=1, {cfg['gap_ms']:.0f} ms apart\n"
    )
    print("| engine | idle CPU (% of a core) | context switches/s | wake-up p50 / p99 / max ms | step ms | overhead p50 / p99 ms | worker steps per request |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    b = d["no_engine"]["idle"]
    f = d["no_engine"]["executor_roundtrip"]
    print(
        f"| none | {b['cpu_pct_of_one_core']:.3f} | {b['switches_per_s']:.1f} | "
        f"{f['p50_us'] / 1000:.3f} / {f['p99_us'] / 1000:.3f} / {f['max_us'] / 1000:.3f} (bare thread-pool round trip) | - | - | - |"
    )
    for r in d["rows"]:
        i, w = r["idle"], r["wakeup"]
        print(
            f"| {r['loop']} | {i['cpu_pct_of_one_core']:.3f} | {i['switches_per_s']:.1f} | "
            f"{w['first_delta_p50_ms']:.2f} / {w['first_delta_p99_ms']:.2f} / {w['first_delta_max_ms']:.2f} | "
            f"{w['step_p50_ms']:.2f} | {w['overhead_p50_ms']:.2f} / {w['overhead_p99_ms']:.2f} | {w['steps_per_request']:.2f} |"
        )
    print()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--throughput", default=None)
    p.add_argument("--loop-lag", default=None)
    p.add_argument("--idle-cpu", default=None)
    args = p.parse_args(argv)
    for fn, path, default in (
        (throughput, args.throughput, "throughput.json"),
        (loop_lag, args.loop_lag, "loop_lag.json"),
        (idle_cpu, args.idle_cpu, "idle_cpu.json"),
    ):
        d = _load(path, default)
        if d is not None:
            fn(d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
