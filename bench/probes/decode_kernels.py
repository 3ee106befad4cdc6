"""Where a replayed decode graph's GPU time goes, kernel by kernel (H200).

The Qwen2-0.5B shape (bf16, random weights, fused kernels) at batch 256 / 64 / 1 and a
384-token context: the replay's wall time (100 back to back, one sync) and, from
torch.profiler's CUDA activity over 20 replays, each kernel's time and count per replay.

    python bench/probes/decode_kernels.py --out $OUT/decode_kernels.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _common and the benchmarks
import fused_latency as fl  # noqa: E402


def kernels_per_replay(fn, replays: int = 20) -> dict[str, list[float]]:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = totals.setdefault(e.name[:110], [0.0, 0.0])
            t[0] += e.time_range.elapsed_us() / replays
            t[1] += 1 / replays
    return totals


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="decode_kernels.json")
    ap.add_argument("--batches", default="256,64,1")
    ap.add_argument("--context", type=int, default=384)
    args = ap.parse_args()
    path = fl.make_checkpoint(Path("/tmp/qwen05-bf16"))
    stack = fl.build(path, True, chunked_prefill_size=0, max_prefill_tokens=8192)
    out: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "context": args.context}
    for bs in map(int, args.batches.split(",")):
        fn = fl.replay_fn(stack, bs, args.context)
        ms = fl.graph_ms(fn)
        totals = kernels_per_replay(fn)
        rows = sorted(totals.items(), key=lambda kv: -kv[1][0])
        total_us = sum(t for t, _ in totals.values())
        print(f"bs {bs} ctx {args.context}: replay {ms:.3f} ms, kernel sum {total_us / 1000:.3f} ms, "
              f"kernels {sum(c for _, c in totals.values()):.0f}", flush=True)
        for name, (t, c) in rows[:16]:
            print(f"   {t:8.1f} us  x{c:5.1f}  {name}")
        out[f"{bs}_{args.context}"] = {"replay_ms": ms, "kernel_sum_us": total_us, "top": [(k, t, c) for k, (t, c) in rows[:25]]}
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
