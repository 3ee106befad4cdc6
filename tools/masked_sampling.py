#!/usr/bin/env python
"""What sampling under a grammar's bitmask costs the device, three ways (CUDA).

Why: a step whose rows sample under masks went through the torch sampler (a dozen kernels,
a float64 scan over the vocabulary) because the sampling kernel refused a bitmask; the
fused launches masked a copy of the logits first (one kernel of its own). Now the
sampling kernel reads the packed bitmask beside the logits (``kernels/sample.py``). Timed
per call with CUDA events, medians over ``--iters`` after a warm-up, rows at temperature
0.6 with every fourth greedy, random masks admitting about half the vocabulary:

- ``torch``: ``sampling.sample`` with the kernel off (the path late-mask steps took);
- ``mask+kernel``: ``token_bitmask`` then the sampling kernel (the fused launches' way);
- ``kernel(mask)``: the sampling kernel reading the bitmask.

    python tools/masked_sampling.py                       # 256 rows, SmolLM2's 49,152 tokens
    python tools/masked_sampling.py --rows 64,256 --vocab 151936
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import machine_facts, save_json  # noqa: E402

from omni_async.runners import sampling  # noqa: E402
from omni_async.runners.sampling import SamplingBatch  # noqa: E402


def timed(fn, iters: int) -> float:
    """Median ms of ``fn`` per call."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="64,256")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="masked_sampling.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    from omni_async.kernels.sample import sample_temperature
    from omni_async.kernels.token_bitmask import token_bitmask

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    report = {"machine": machine_facts(), "vocab": args.vocab, "gpu": torch.cuda.get_device_name(), "rows": {}}
    for b in (int(r) for r in args.rows.split(",")):
        x = torch.randn(b, args.vocab, generator=g, device=dev).to(torch.bfloat16)
        mask = torch.randint(-2**31, 2**31 - 1, (b, (args.vocab + 31) // 32), dtype=torch.int32, generator=g, device=dev)
        temp = torch.full((b,), 0.6, device=dev)
        temp[::4] = 0
        seeds = torch.randint(0, 2**62, (b,), generator=g, device=dev)
        idx = torch.arange(b, device=dev)
        sampled = torch.nonzero(temp != 0).flatten()
        sb = SamplingBatch(temperature=temp, top_k=torch.zeros(b, dtype=torch.long, device=dev), top_p=torch.ones(b, device=dev),
                           min_p=torch.zeros(b, device=dev), seeds=seeds, sample_indices=idx, allowed=mask,
                           sampled_rows=sampled, num_sampled=len(sampled))

        def torch_path():
            on = sampling.SAMPLE_KERNEL
            sampling.SAMPLE_KERNEL = False
            try:
                return sampling.sample(x, sb)
            finally:
                sampling.SAMPLE_KERNEL = on

        ways = {
            "torch": torch_path,
            "mask+kernel": lambda: sample_temperature(token_bitmask(x, mask), temp, seeds, idx),
            "kernel(mask)": lambda: sample_temperature(x, temp, seeds, idx, allowed=mask),
        }
        got = {name: timed(fn, args.iters) for name, fn in ways.items()}
        same = torch.equal(ways["mask+kernel"]()[0], ways["kernel(mask)"]()[0])
        report["rows"][str(b)] = {"ms": got, "kernel_tokens_equal": same}
        print(f"{b:4d} rows x {args.vocab}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in got.items())
              + f"; tokens of the two kernel ways equal: {same}")
    print(f"saved {save_json(args.out, report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
