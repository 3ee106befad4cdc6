"""Merged q/k/v and gate/up GEMMs against separate ones on CPU (SmolLM2-135M shapes).

One "layer" is the q, k, v projections and the SiLU-gated MLP input (gate, up): three plus
two ``F.linear`` calls, or one plus one on the concatenated weights followed by splits.
Both run in the same process, 7 repeats interleaved (order alternating), 200 calls each;
prints and saves median / min / max microseconds per layer.

    python bench/probes/cpu_merged_gemm.py [--out bench/results/cpu_merged_gemm.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HIDDEN, Q_ROWS, KV_ROWS, INTER = 576, 576, 192, 1536


def layer_fns(bs: int, dtype: torch.dtype):
    x = torch.randn(bs, HIDDEN, dtype=dtype)
    wq, wk, wv = (torch.randn(n, HIDDEN, dtype=dtype) for n in (Q_ROWS, KV_ROWS, KV_ROWS))
    wg, wu = torch.randn(INTER, HIDDEN, dtype=dtype), torch.randn(INTER, HIDDEN, dtype=dtype)
    wqkv, wgu = torch.cat([wq, wk, wv]), torch.cat([wg, wu])

    def separate():
        F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)
        return F.silu(F.linear(x, wg)) * F.linear(x, wu)

    def merged():
        F.linear(x, wqkv).split([Q_ROWS, KV_ROWS, KV_ROWS], -1)
        gate, up = F.linear(x, wgu).chunk(2, -1)
        return F.silu(gate) * up

    return {"separate": separate, "merged": merged}


def measure(bs: int, dtype: torch.dtype, repeats: int = 7, calls: int = 200) -> dict:
    fns = layer_fns(bs, dtype)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(repeats):
        order = list(fns) if rep % 2 else list(reversed(fns))
        for name in order:
            t0 = time.perf_counter()
            for _ in range(calls):
                fns[name]()
            times[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {name: {"median_us": statistics.median(ts), "min_us": min(ts), "max_us": max(ts)} for name, ts in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/cpu_merged_gemm.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    results = {"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": {}}
    for dtype in (torch.float32, torch.bfloat16):
        for bs in (1, 64):
            row = measure(bs, dtype)
            results["rows"][f"{str(dtype).replace('torch.', '')}/bs{bs}"] = row
            print(dtype, bs, {k: tuple(round(v[m], 1) for m in ("median_us", "min_us", "max_us")) for k, v in row.items()}, flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
