"""Inter-token latency of running streams while a burst of long prompts arrives.

``--streams`` requests decode (short prompts, ``--stream-tokens`` new tokens each); once
each has produced ``--warm-tokens``, ``--burst`` prompts of ``--prompt-len`` ids arrive
at once (``--burst-tokens`` new tokens each). The gaps between the running streams'
deltas are recorded: before the burst, and during it (from its arrival until every burst
request has its first token; a gap counts when it overlaps that window). With ``mixed_prefill`` off
("separate", the default) prefill and decode steps alternate, so the streams wait for one
prefill step at a time (``core.mixed_prefill.prefill_turn``; before that rule they waited
behind every prefill step of the burst); on ("mixed"), each prefill step carries their next tokens.

One engine per loop; the two settings alternate on it, repeat by repeat (the batch core
reads ``config.mixed_prefill`` at each step), so both see the same machine state.
Random-weight Qwen2 checkpoint, written once (``--shape qwen05``: Qwen2-0.5B, or
``tiny``: a small one for CPU). Prints a table, saves JSON under bench/results/.

    python bench/burst_itl.py                                   # CPU, tiny shape
    python bench/burst_itl.py --device cuda --shape qwen05 --streams 64 --burst 64 \\
        --prompt-len 1000 --stream-tokens 768 --loops overlap,async_decode
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import machine_facts, package_source, percentile, run_benchmark  # noqa: E402
from nv256 import QWEN05, make_checkpoint  # noqa: E402

from omni_async import Engine, SamplingParams  # noqa: E402
from omni_async.backends.native.builder import build_off_this_thread  # noqa: E402

TINY = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=384, vocab_size=2048, max_position_embeddings=4096, tie_word_embeddings=True)


async def one_run(eng: Engine, args: argparse.Namespace, rep: int) -> dict[str, Any]:
    rng = random.Random(rep)
    vocab = 1000
    streams = [[rng.randrange(2, vocab) for _ in range(rng.randint(32, 128))] for _ in range(args.streams)]
    burst = [[rng.randrange(2, vocab) for _ in range(args.prompt_len)] for _ in range(args.burst)]
    await eng.flush_cache()
    gaps: list[tuple[float, float, int]] = []  # (time of the delta, gap since the one before, tokens)
    warm = asyncio.Event()
    warmed = 0
    burst_ttft: list[float] = []
    burst_t0 = 0.0

    async def stream(prompt: list[int]) -> int:
        nonlocal warmed
        sp = SamplingParams(max_new_tokens=args.stream_tokens, temperature=args.temperature, ignore_eos=True)
        last, n = None, 0
        async for d in eng.stream(input_ids=prompt, sampling=sp):
            now = time.perf_counter()
            if d.token_ids and last is not None:
                gaps.append((now, now - last, len(d.token_ids)))
            if d.token_ids:
                last = now
            before, n = n, n + len(d.token_ids)
            if before < args.warm_tokens <= n:
                warmed += 1
                if warmed == len(streams):
                    warm.set()
        return n

    async def arriving(prompt: list[int]) -> None:
        sp = SamplingParams(max_new_tokens=args.burst_tokens, temperature=args.temperature, ignore_eos=True)
        first = True
        async for d in eng.stream(input_ids=prompt, sampling=sp):
            if first and d.token_ids:
                burst_ttft.append(time.perf_counter() - burst_t0)
                first = False

    t0 = time.perf_counter()
    running = [asyncio.create_task(stream(p)) for p in streams]
    await warm.wait()
    burst_t0 = time.perf_counter()
    await asyncio.gather(*(arriving(p) for p in burst))
    burst_end = burst_t0 + max(burst_ttft)
    counts = await asyncio.gather(*running)
    wall = time.perf_counter() - t0
    assert all(c == args.stream_tokens for c in counts), counts
    before = [g for t, g, _ in gaps if t < burst_t0]
    # A gap counts as during the burst when it overlaps it: a stream stalled behind the
    # burst's prefill ends its gap after the burst's last first token.
    overlapping = [(g, n) for t, g, n in gaps if t >= burst_t0 and t - g <= burst_end]
    during = [g for g, _ in overlapping]
    per_token = [g / n for g, n in overlapping]
    after_burst = sum(1 for t, _, _ in gaps if t > burst_end)
    ms = lambda xs, q: None if not xs else 1000 * percentile(xs, q)  # noqa: E731
    return {
        "gap_p50_before_ms": ms(before, 50), "gap_p50_during_ms": ms(during, 50), "gap_p99_during_ms": ms(during, 99),
        "gap_max_during_ms": None if not during else 1000 * max(during), "token_p50_during_ms": ms(per_token, 50),
        "deltas_during": len(during), "deltas_after_burst": after_burst,
        "burst_window_s": burst_end - burst_t0, "burst_ttft_p50_s": statistics.median(burst_ttft),
        "wall_s": wall, "mixed_decode_rows": eng.stack.core.stats().get("mixed_decode_rows"),
    }


async def main_async(args: argparse.Namespace) -> dict:
    shape = QWEN05 if args.shape == "qwen05" else TINY
    folder = Path(args.checkpoint or Path(tempfile.gettempdir()) / f"burst-itl-qwen2-{args.shape}-{args.dtype}")
    path = build_off_this_thread(lambda: make_checkpoint(folder, shape, getattr(torch, args.dtype), args.device))
    result: dict[str, Any] = {"bench": "burst_itl", "args": vars(args), "shape": shape, "machine": machine_facts(),
                              "source": package_source(), "runs": {}}
    for loop in args.loops.split(","):
        eng = Engine.from_pretrained(str(path), device=args.device, dtype=args.dtype, loop=loop)
        async with eng:
            warm = [1 + i % 900 for i in range(args.prompt_len)]  # prefill kernels built before timing
            await eng.generate(input_ids=warm, sampling=SamplingParams(max_new_tokens=4, ignore_eos=True))
            for rep in range(args.repeats):
                for mixed in (False, True):
                    eng.stack.core.config.mixed_prefill = mixed
                    r = await one_run(eng, args, rep)
                    result["runs"].setdefault(f"{loop}/{'mixed' if mixed else 'separate'}", []).append(r)
                    print(f"  {loop:12s} {'mixed' if mixed else 'separate':8s} rep {rep}: gap p50 {r['gap_p50_during_ms']} "
                          f"p99 {r['gap_p99_during_ms']} ms during; burst ttft p50 {r['burst_ttft_p50_s']:.3f} s", flush=True)
    return result


def print_table(result: dict) -> None:
    def med(rows: list[dict], key: str) -> str:
        vals = [r[key] for r in rows if r[key] is not None]
        if not vals:
            return "-"
        return f"{statistics.median(vals):.1f} [{min(vals):.1f}-{max(vals):.1f}]"

    print(f"\n{'loop/setting':24s} {'gap p50 before':>20s} {'gap p50 during':>20s} {'gap p99 during':>20s} "
          f"{'gap max during':>20s} {'burst TTFT p50 s':>18s}")
    for name, rows in result["runs"].items():
        ttft = statistics.median(r["burst_ttft_p50_s"] for r in rows)
        print(f"{name:24s} {med(rows, 'gap_p50_before_ms'):>20s} {med(rows, 'gap_p50_during_ms'):>20s} "
              f"{med(rows, 'gap_p99_during_ms'):>20s} {med(rows, 'gap_max_during_ms'):>20s} {ttft:18.3f}")
    print("(ms between a running stream's deltas; median [range] over repeats)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", choices=("tiny", "qwen05"), default="tiny")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--loops", default="overlap")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--burst", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=400)
    ap.add_argument("--stream-tokens", type=int, default=160)
    ap.add_argument("--warm-tokens", type=int, default=8)
    ap.add_argument("--burst-tokens", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--malloc", default="default")
    ap.add_argument("--torch-threads", type=int, default=None)
    ap.add_argument("--out", default="burst_itl.json")
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return run_benchmark(args, main_async, print_table)


if __name__ == "__main__":
    sys.exit(main())
