"""Launch shapes of the paged extend (prefill) attention kernel, timed on the GPU.

Two step shapes of the Qwen2-0.5B attention (14 query heads, 2 KV heads, head dim 64,
bf16, 16-token pages scattered over the cache):
- ``prefix``: 50 sequences of 160 new tokens each over a 1,024-token cached prefix (a
  prefill step of the shared-prefix workload with the prefix cache on);
- ``fresh``: 16 sequences of 512 new tokens, no prefix (a plain prefill step).

Each launch shape is checked against a float32 torch reference, then timed with CUDA
events (20 launches per sample, repeats interleaved across shapes). The fastest shape
over both cases is what ``omni_async.kernels.paged_extend.TUNING`` should hold.

    python tools/extend_kernel.py --out results.json [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # _common and the benchmarks
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's omni_async

from omni_async.kernels.paged_extend import TUNING, paged_extend_attention  # noqa: E402

SHAPES = [  # (block_m, block_n, num_warps, num_stages)
    (64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 8, 2),
    (64, 128, 4, 3), (64, 128, 8, 3), (128, 128, 8, 3), (64, 32, 4, 3), (128, 32, 8, 3), (32, 64, 4, 3),
]
HEADS, KV_HEADS, DIM, PS = 14, 2, 64, 16


def case(num_seqs: int, new: int, prefix: int, gen: torch.Generator) -> dict:
    total = prefix + new
    pages_per_seq = -(-total // PS)
    num_pages = num_seqs * pages_per_seq + 8
    perm = torch.randperm(num_pages, generator=gen)[: num_seqs * pages_per_seq].view(num_seqs, pages_per_seq)
    dev = "cuda"
    return {
        "q": torch.randn(num_seqs * new, HEADS, DIM, generator=gen).to(dev, torch.bfloat16),
        "k": torch.randn(num_pages * PS, KV_HEADS, DIM, generator=gen).to(dev, torch.bfloat16),
        "v": torch.randn(num_pages * PS, KV_HEADS, DIM, generator=gen).to(dev, torch.bfloat16),
        "tables": perm.to(dev),
        "starts": (torch.arange(num_seqs) * new).to(dev),
        "lens": torch.full((num_seqs,), new).to(dev),
        "prefix": torch.full((num_seqs,), prefix).to(dev),
        "new": new, "prefix_len": prefix, "num_seqs": num_seqs,
    }


def launch(c: dict, shape: tuple[int, int, int, int]) -> torch.Tensor:
    bm, bn, warps, stages = shape
    return paged_extend_attention(
        c["q"], c["k"], c["v"], c["tables"], c["starts"], c["lens"], c["prefix"], c["new"], PS, DIM**-0.5,
        block_m=bm, block_n=bn, num_warps=warps, num_stages=stages,
    )


def reference(c: dict, seqs: int = 3) -> torch.Tensor:
    """float32 attention of the first ``seqs`` sequences, gathered from the pages."""
    outs = []
    for i in range(seqs):
        pos = torch.arange(c["prefix_len"] + c["new"], device="cuda")
        slots = c["tables"][i][pos // PS] * PS + pos % PS
        k = c["k"][slots].float().repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
        v = c["v"][slots].float().repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
        q = c["q"][i * c["new"] : (i + 1) * c["new"]].float().transpose(0, 1)
        mask = pos[None, :] <= (c["prefix_len"] + torch.arange(c["new"], device="cuda"))[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=DIM**-0.5)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def time_ms(c: dict, shape, iters: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        launch(c, shape)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def attention_flops(c: dict) -> float:
    """Causal attention over prefix + new positions: 4 * D flops per (query, key, head)."""
    n, p = c["new"], c["prefix_len"]
    keys_per_seq = n * p + n * (n + 1) / 2
    return 4 * DIM * HEADS * keys_per_seq * c["num_seqs"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    cases = {"prefix": case(50, 160, 1024, gen), "fresh": case(16, 512, 0, gen)}
    results: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "current_tuning": TUNING,
                     "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "shapes": {}}
    ok_shapes = []
    for shape in SHAPES:
        errs = {}
        try:
            for name, c in cases.items():
                got = launch(c, shape)[: 3 * c["new"]].float()
                errs[name] = float((got - reference(c)).abs().max())
        except Exception as exc:  # a shape the compiler refuses (e.g. too much shared memory)
            results["shapes"][str(shape)] = {"error": repr(exc)[:300]}
            print(shape, "failed:", repr(exc)[:120], flush=True)
            continue
        results["shapes"][str(shape)] = {"max_abs_err": errs, "ms": {n: [] for n in cases}}
        if max(errs.values()) < 0.05:
            ok_shapes.append(shape)
        else:
            print(shape, "WRONG", errs, flush=True)
    for _ in range(args.repeats):
        for shape in ok_shapes:
            for name, c in cases.items():
                results["shapes"][str(shape)]["ms"][name].append(time_ms(c, shape))
    print(f"{'shape (bm, bn, warps, stages)':32s} {'prefix ms':>10s} {'TFLOP/s':>8s} {'fresh ms':>10s} {'TFLOP/s':>8s}")
    best, best_total = None, float("inf")
    for shape in ok_shapes:
        r = results["shapes"][str(shape)]
        med = {n: statistics.median(r["ms"][n]) for n in cases}
        r["median_ms"] = med
        r["tflops"] = {n: attention_flops(cases[n]) / (med[n] * 1e-3) / 1e12 for n in cases}
        spread = {n: (max(r["ms"][n]) - min(r["ms"][n])) / med[n] for n in cases}
        print(f"{str(shape):32s} {med['prefix']:10.3f} {r['tflops']['prefix']:8.1f} {med['fresh']:10.3f} {r['tflops']['fresh']:8.1f}"
              f"   spread {100 * max(spread.values()):.1f}%")
        total = med["prefix"] + med["fresh"]
        if total < best_total:
            best, best_total = shape, total
    results["best"] = best
    print("best:", best)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
