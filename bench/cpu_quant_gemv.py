#!/usr/bin/env python
"""The GEMMs of one SmolLM2-135M decode token, alone: float32 ``F.linear`` against the
q4/q8 block kernels (omni_async/kernels/cpu_quant.py), at 1 and 16 rows.

Every projection of the 30 layers (qkv 576->960, o 576->576, gate_up 576->3072, down
1536->576) and the output head (576->49152) with distinct weights (so a token streams
them from memory as the model does), timed in process CPU time on one thread (less
distorted than wall time on a shared machine), median of ``--repeats``.
Results: bench/results/cpu_quant_gemv.json.

    OMP_NUM_THREADS=1 python bench/cpu_quant_gemv.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import _common as C

import torch
from torch.nn import functional as F

from omni_async.kernels import cpu_quant

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)


def weights(layers: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, k, generator=g) * 0.05 for _ in range(layers) for n, k in LAYER] + [torch.randn(*HEAD, generator=g) * 0.05]


def per_token_ms(fns: list, xs: dict[int, torch.Tensor], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        c0 = time.process_time()
        for fn, x in fns:
            fn(xs[x])
        times.append(time.process_time() - c0)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rows", type=C.parse_int_list, default=[1, 16])
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    ws = weights(args.layers)
    head_fmt = {"q4": "q8", "q8": "q8"}
    blocks = {f: [cpu_quant.quantize(w, f if i < len(ws) - 1 else head_fmt[f]) for i, w in enumerate(ws)] for f in ("q4", "q8")}
    result = {"threads": torch.get_num_threads(), "machine": C.machine_facts(), "rows": {}}
    for rows in args.rows:
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        systems = {
            "float32": [(lambda x, w=w: F.linear(x, w), w.shape[1]) for w in ws],
            **{f: [(b, b.codes.shape[1] * (2 if b.format == "q4" else 1)) for b in bs] for f, bs in blocks.items()},
        }
        for name, fns in systems.items():
            per_token_ms(fns, xs, 1)  # warm-up
        row = {name: per_token_ms(fns, xs, args.repeats) for name, fns in systems.items()}
        result["rows"][rows] = row
        print(f"rows={rows}: " + ", ".join(f"{k} {v:.1f} ms CPU" for k, v in row.items()) +
              f"; q4 {row['float32'] / row['q4']:.2f}x float32", flush=True)
    mb = {"float32": sum(w.numel() * 4 for w in ws) / 1e6, **{f: sum(b.nbytes for b in bs) / 1e6 for f, bs in blocks.items()}}
    result["weight_mb"] = mb
    print("weight MB per token: " + ", ".join(f"{k} {v:.1f}" for k, v in mb.items()))
    C.save_json("cpu_quant_gemv.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
