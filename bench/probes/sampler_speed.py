"""The sampler's device time per forward: the torch path against the Triton kernel (CUDA).

Temperature-only rows (NV256's sampling: T = 0.6, no filters) at Qwen2's vocabulary
(151,936) for batches of 1, 64 and 256, float32 and bf16 logits (bf16: what a decode
graph hands the sampler). Each path is timed two ways with CUDA events, warmed first:
replayed from a CUDA graph (the device time, as inside the fused multi-step decode) and
called eagerly back to back (what an eager step pays, host launches included). Paths:

- ``torch_before``: the torch sampler as it was (argmax for every row, two maxima, the
  fallback argmax), kept here as the baseline;
- ``torch``: today's torch path (:func:`omni_async.runners.sampling.sample` with the kernel
  switched off: one maximum, no argmax for rows that draw);
- ``kernel``: :func:`omni_async.kernels.sample.sample_temperature`;
- ``argmax``: greedy's argmax, the floor.

Repeats are interleaved (every path once per round) and the table shows the median and
the spread. Tokens of ``torch`` and ``kernel`` are compared on every shape.

    python bench/probes/sampler_speed.py --device cuda --out bench/results/sampler_speed_h200.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _common
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's omni_async
from _common import machine_facts, save_json  # noqa: E402

from omni_async.kernels.sample import sample_temperature  # noqa: E402
from omni_async.runners import sampling  # noqa: E402
from omni_async.runners.sampling import SamplingBatch, greedy, row_uniforms, sample  # noqa: E402


def torch_before(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """The torch sampler's operations for a batch of temperature-only rows before the
    kernel and the trims (the baseline the H200 profile measured)."""
    x = logits.to(torch.float32)
    best, tokens = x.max(dim=-1)
    ok = best > float("-inf")
    xs = torch.where(ok[:, None], x, 0.0)
    temp = sb.temperature.clamp_min(sampling.MIN_TEMPERATURE)[:, None]
    xs = torch.nan_to_num(xs, nan=float("-inf"), posinf=torch.finfo(xs.dtype).max)
    xs = (xs - xs.max(dim=-1, keepdim=True).values) / temp
    u = row_uniforms(sb.seeds, sb.sample_indices)
    cdf = xs.softmax(-1).to(torch.float64).cumsum(-1)
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    drawn = torch.where(drawn < xs.shape[-1], drawn, xs.argmax(-1))
    return torch.where(ok, drawn, torch.zeros_like(drawn))


def torch_now(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    sampling.SAMPLE_KERNEL = False
    try:
        return sample(logits, sb).tokens
    finally:
        sampling.SAMPLE_KERNEL = True


def paths(sb: SamplingBatch) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    return {
        "torch_before": lambda x: torch_before(x, sb),
        "torch": lambda x: torch_now(x, sb),
        "kernel": lambda x: sample_temperature(x, sb.temperature, sb.seeds, sb.sample_indices)[0],
        "argmax": lambda x: greedy(x)[0],
    }


def graph_us(fn: Callable[[], object], iters: int) -> float:
    """Device time per call, replayed from a CUDA graph of ``iters`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def eager_us(fn: Callable[[], object], iters: int) -> float:
    """Wall time per call, back to back (host launches included), between CUDA events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def batch(b: int, temperature: float, device: str, gen: torch.Generator) -> SamplingBatch:
    return SamplingBatch(
        temperature=torch.full((b,), temperature, device=device), top_k=torch.zeros(b, dtype=torch.long, device=device),
        top_p=torch.ones(b, device=device), min_p=torch.zeros(b, device=device),
        seeds=torch.randint(0, 2**62, (b,), generator=gen, device=device),
        sample_indices=torch.randint(0, 2**20, (b,), generator=gen, device=device), num_sampled=b)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default="sampler_speed.json")
    args = ap.parse_args()
    assert args.device == "cuda" and torch.cuda.is_available(), "a CUDA device is needed"
    gen = torch.Generator(device=args.device).manual_seed(0)
    results: list[dict] = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for b in map(int, args.batches.split(",")):
            # Logits of a language model's spread: a few likely tokens over a long tail.
            logits = (torch.randn(b, args.vocab, generator=gen, device=args.device) * 4).to(dtype)
            sb = batch(b, args.temperature, args.device, gen)
            fns = paths(sb)
            want, got = fns["torch"](logits), fns["kernel"](logits)
            differ = int((want != got).sum())
            times: dict[str, dict[str, list[float]]] = {name: {"graph": [], "eager": []} for name in fns}
            for _ in range(args.repeats):  # interleaved: every path once per round
                for name, fn in fns.items():
                    times[name]["graph"].append(graph_us(lambda: fn(logits), args.iters))
                    times[name]["eager"].append(eager_us(lambda: fn(logits), args.iters))
            results.append({"dtype": dtype_name, "batch": b, "vocab": args.vocab, "tokens_differ": differ,
                            "us": times})
            print_row(results[-1])
    save_json(args.out, {"bench": "sampler_speed", "gpu": torch.cuda.get_device_name(0), "args": vars(args),
                         "machine": machine_facts(), "results": results})
    print(f"saved {args.out}")


def print_row(r: dict) -> None:
    if not getattr(print_row, "headed", False):
        print(f"{'dtype':9} {'B':>4}  {'path':13} {'graph us (median, min-max)':>30} {'eager us (median, min-max)':>30}")
        print_row.headed = True  # type: ignore[attr-defined]
    for name, t in r["us"].items():
        cells = [f"{statistics.median(v):8.1f} ({min(v):7.1f}-{max(v):7.1f})" for v in (t["graph"], t["eager"])]
        print(f"{r['dtype']:9} {r['batch']:>4}  {name:13} {cells[0]:>30} {cells[1]:>30}")
    print(f"{'':15}tokens differing between torch and kernel: {r['tokens_differ']} of {r['batch']}")


if __name__ == "__main__":
    main()
