"""The code predictor's attention launches alone: the paged decode kernel at the shape a
Qwen3-TTS predictor runs it (16 query heads, 8 KV heads, head dim 128, one 16-position
page a row, every row at the same length), under each block and warp setting.

Why: in the predictor's graphed frame at 64 rows the decode kernel took 7.1 us a launch,
15% of the frame's kernel time (80 launches a frame), while each program reads at most
16 positions: its default block is 64 positions at head dim 128, so 48 of them are masked
loads and padded products. ``AttentionContext.decode_block`` lets the predictor ask for a
16-position block; this says what each setting costs, per row count.

Each variant is captured in one CUDA graph of 16 launches (lengths 1..16, a frame's
forwards for one layer) and replayed; variants interleaved over ``--repeats``, the median
quoted in microseconds a launch.

    python tools/predictor_attention.py [--rows 1,16,64] [--out $OUT/predictor_attention.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # _common
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's omni_async

from _common import machine_facts, save_json  # noqa: E402
from graph_timer import graph_timer  # noqa: E402

from omni_async.kernels import paged_decode as pd  # noqa: E402

VARIANTS = {  # name: (block_n or None for the kernel's default, warps of a 16-position block)
    "default": (None, 4),
    "block16_w4": (16, 4),
    "block16_w2": (16, 2),
    "block16_w1": (16, 1),
    "block32_w4": (32, 4),
}


def frame_launches(rows: int, block_n: int | None, heads: int, kv_heads: int, dim: int, page: int):
    """A callable running one layer's 16 decode launches of a frame (lengths 1..page)."""
    dev = torch.device("cuda")
    q = torch.randn(rows, heads, dim, device=dev, dtype=torch.bfloat16)
    k = torch.randn(rows * page, kv_heads, dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    tables = torch.arange(rows, device=dev, dtype=torch.int32)[:, None]
    lens = [torch.full((rows,), p + 1, device=dev, dtype=torch.int32) for p in range(page)]
    scale = dim ** -0.5

    def run() -> torch.Tensor:
        out = q
        for n in lens:
            out = pd.paged_decode_attention(q, k, v, tables, n, page, scale, block_n=block_n)
        return out
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    heads, kv_heads, dim, page = 16, 8, 128, 16
    rows_out = []
    for rows in [int(r) for r in args.rows.split(",")]:
        timers = {}
        reference = None
        for name, (block_n, warps) in VARIANTS.items():
            pd.DECODE_SHORT_WARPS = warps  # captured into the graph with the launch
            torch.manual_seed(0)
            timed, out = graph_timer(frame_launches(rows, block_n, heads, kv_heads, dim, page), "cuda")
            torch.cuda.synchronize()
            if reference is None:
                reference = out.float().clone()
            err = (out.float() - reference).abs().max().item()
            timers[name] = (timed, err)
        pd.DECODE_SHORT_WARPS = 4
        samples: dict[str, list[float]] = {name: [] for name in timers}
        for _ in range(args.repeats):
            for name, (timed, _) in timers.items():
                samples[name].append(timed(args.replays) / args.replays / page * 1e3)
        row = {"rows": rows}
        for name, us in samples.items():
            row[f"{name}_us"] = round(statistics.median(us), 2)
            row[f"{name}_spread"] = [round(min(us), 2), round(max(us), 2)]
            row[f"{name}_max_abs_diff"] = timers[name][1]
        rows_out.append(row)
        print(" ".join(f"{k}={v}" for k, v in row.items() if not k.endswith("spread")), flush=True)
    payload = {"tool": "predictor_attention", "machine": machine_facts(), "args": vars(args), "rows": rows_out}
    if args.out:
        print("saved", save_json(args.out, payload))


if __name__ == "__main__":
    main()
