"""Time to first token of a short prompt: eager prefill against the decode graphs' rows.

A prefill step of at most ``runners.prefill_rows.PREFILL_ROWS_MAX`` rows replays a decode
graph (its positions as decode rows) instead of an eager forward, whose host cost is a
launch per kernel of every layer. This measures what that buys a user: the time from
submission to the first streamed token of a short prompt (16 and 48 tokens), alone on an
idle engine and beside 64 streams decoding, with the rows path on (the default) and off
(``PREFILL_ROWS_MAX = 0`` for the run), arms interleaved over ``--repeats``, each warmed
up. Defaults otherwise (bf16, overlap loop, Qwen2-0.5B shape with random weights as
``bench/nv256.py``, or ``--shape``).

    python bench/short_prefill.py --device cuda [--shape qwen05] [--repeats 3] [--samples 20]

``--smoke`` runs a tiny random Qwen2 on the CPU (checks the script: the rows path is
CUDA's only, so both arms are eager there).
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import machine_facts, run_async, save_json  # noqa: E402
from nv256 import SHAPES, SMOKE_SHAPE, make_checkpoint  # noqa: E402

from omni_async import Engine, SamplingParams  # noqa: E402
from omni_async.backends.native.builder import build_off_this_thread  # noqa: E402
from omni_async.runners import prefill_rows  # noqa: E402

ROWS_MAX = prefill_rows.PREFILL_ROWS_MAX


async def first_token_s(engine: Engine, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    async for _ in engine.stream(input_ids=prompt, sampling=SamplingParams(max_new_tokens=2, temperature=0.6, seed=1)):
        return time.perf_counter() - t0
    raise RuntimeError("no token")


async def level(engine: Engine, arm: str, length: int, samples: int, background: int, rng: random.Random) -> list[float]:
    prefill_rows.PREFILL_ROWS_MAX = ROWS_MAX if arm == "rows" else 0
    busy = [asyncio.ensure_future(engine.generate(input_ids=[rng.randrange(1000) for _ in range(64)],
                                                  sampling=SamplingParams(max_new_tokens=100000, ignore_eos=True)))
            for _ in range(background)]
    try:
        if background:
            await asyncio.sleep(1.0)  # the streams are decoding
        out = []
        for _ in range(samples):
            out.append(await first_token_s(engine, [rng.randrange(1000) for _ in range(length)]))
        return out
    finally:
        for fut in busy:
            fut.cancel()
        await asyncio.gather(*busy, return_exceptions=True)
        prefill_rows.PREFILL_ROWS_MAX = ROWS_MAX


async def main_async(args: argparse.Namespace) -> dict:
    family, shape = SHAPES[args.shape]
    shape, device, dtype = (SMOKE_SHAPE, "cpu", torch.float32) if args.smoke else (shape, args.device, torch.bfloat16)
    folder = Path(tempfile.gettempdir()) / ("sp-smoke" if args.smoke else f"nv-{args.shape}-bf16")
    path = build_off_this_thread(lambda: make_checkpoint(folder, shape, dtype, device, family))
    engine = Engine.from_pretrained(str(path), device=device)
    results: dict = {"machine": machine_facts(), "args": vars(args), "rows_max": ROWS_MAX, "levels": []}
    rng = random.Random(0)
    async with engine:
        for arm in ("rows", "eager"):  # warm-up of both arms
            await level(engine, arm, 16, 3, 0, rng)
        for background in (0, 64):
            for length in (16, 48):
                per_arm: dict[str, list[float]] = {"rows": [], "eager": []}
                for rep in range(args.repeats):
                    for arm in (("rows", "eager") if rep % 2 == 0 else ("eager", "rows")):
                        per_arm[arm].extend(await level(engine, arm, length, args.samples, background, rng))
                row = {"background_streams": background, "prompt_tokens": length}
                for arm, xs in per_arm.items():
                    xs = sorted(xs)
                    row[arm] = {"ttft_ms_p50": round(1000 * statistics.median(xs), 2),
                                "ttft_ms_p90": round(1000 * xs[int(0.9 * (len(xs) - 1))], 2), "n": len(xs)}
                results["levels"].append(row)
                print(f"| {background} | {length} | {row['rows']['ttft_ms_p50']} | {row['rows']['ttft_ms_p90']} | "
                      f"{row['eager']['ttft_ms_p50']} | {row['eager']['ttft_ms_p90']} |", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="qwen05", choices=sorted(SHAPES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--samples", type=int, default=20, help="first tokens per arm, level and repeat")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.repeats, args.samples = 1, 2
    print("| background streams | prompt | rows TTFT p50 ms | rows p90 | eager TTFT p50 ms | eager p90 |")
    print("|---|---|---|---|---|---|")
    res = run_async(main_async(args))
    print("saved", save_json(args.out or f"short_prefill_{args.shape}_{'smoke' if args.smoke else args.device}.json", res))


if __name__ == "__main__":
    main()
