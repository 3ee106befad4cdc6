#!/usr/bin/env python
"""The CPU decode stack alone (kernels/cpu_stack.py): one decode step of a SmolLM2-135M
shaped model (30 layers, hidden 576, 9 heads over 3 KV heads of 64, MLP 1536, q4 blocks;
the output head in q8 blocks timed apart) at 1 and 16 rows over a paged cache of
``--context`` tokens per row, random weights, in one process.

Why: on a shared 2-core machine whole-engine tok/s swing with the other jobs; the stack's
own call, timed many times in a row, is the figure a kernel change moves. Wall and
process CPU time per step, median and range of ``--repeats`` rounds; ``--threads``
sets torch's intra-op threads (the stack's team); the row split is set as the engine
sets it (``OMNI_ASYNC_CPU_ROW_SPLIT``: rows per thread from which a step splits by rows, 0 off). Run the same script from two
checkouts, alternating, for an A/B (each builds its own extension).
Results: bench/results/cpu_stack_kernel.json (``--out`` to rename).

    python tools/cpu_stack_kernel.py --rows 1,16 --threads 2 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # _common and the benchmarks
import _common as C  # noqa: E402

import torch

from omni_async.kernels import cpu_quant
from omni_async.kernels.cpu_kernels import load
from omni_async.kernels.cpu_stack import apply_row_split

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 30, 576, 9, 3, 64, 1536, 49152
PAGE = 16


def stack_layers(layers: int) -> list[list[torch.Tensor | None]]:
    g = torch.Generator().manual_seed(0)
    shapes = [((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), (HIDDEN, HEADS * HEAD_DIM), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    out = []
    for _ in range(layers):
        entry: list[torch.Tensor | None] = [1 + 0.1 * torch.randn(HIDDEN, generator=g), 1 + 0.1 * torch.randn(HIDDEN, generator=g)]
        for n, k in shapes:
            b = cpu_quant.quantize(torch.randn(n, k, generator=g) * 0.05, "q4")
            entry += [b.codes, b.scale, b.minimum, b.bias]
        out.append(entry)
    return out


def step_inputs(rows: int, context: int) -> dict:
    pages_per_row = (context + PAGE) // PAGE + 1
    slots = rows * pages_per_row * PAGE
    caches = [torch.randn(slots, KV_HEADS, HEAD_DIM) * 0.5 for _ in range(2 * LAYERS)]
    pages = torch.arange(rows * pages_per_row).view(rows, pages_per_row)
    lens = torch.full((rows,), context + 1, dtype=torch.long)
    slot = pages[:, context // PAGE] * PAGE + context % PAGE
    pos = torch.full((rows,), float(context))
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    freqs = torch.cat([pos[:, None] * inv[None], pos[:, None] * inv[None]], dim=-1)
    return dict(x=torch.randn(rows, HIDDEN), cos=freqs.cos(), sin=freqs.sin(), k=caches[:LAYERS], v=caches[LAYERS:], pages=pages,
                lens=lens, slots=slot)


def timed(fn, calls: int) -> tuple[float, float]:
    """(wall ms, process CPU ms) per call over ``calls`` calls."""
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn()
    return 1e3 * (time.perf_counter() - w0) / calls, 1e3 * (time.process_time() - c0) / calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=C.parse_int_list, default=[1, 16])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calls", type=int, default=20, help="calls per timed round")
    p.add_argument("--out", default="cpu_stack_kernel.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ext = load()
    stack = ext.DecodeStack(stack_layers(LAYERS), 1 + 0.1 * torch.randn(HIDDEN), 1e-5, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)
    if hasattr(stack, "set_rows_per_thread"):  # a build before the row split has none
        apply_row_split(stack)
    head = cpu_quant.quantize(torch.randn(VOCAB, HIDDEN) * 0.05, "q8")
    info = getattr(stack, "info", None)
    result = {"threads": torch.get_num_threads(), "context": args.context, "machine": C.machine_facts(),
              "stack_info": info() if callable(info) else None, "load_before": C.loadavg(), "rows": {}}
    for rows in args.rows:
        s = step_inputs(rows, args.context)
        call = lambda: stack.forward(s["x"], s["cos"], s["sin"], s["k"], s["v"], s["pages"], PAGE, s["lens"], s["slots"])  # noqa: E731
        hidden = call()
        call_head = lambda: head(hidden)  # noqa: E731
        timed(call, 3)
        rounds = {"stack": [], "head": []}
        for _ in range(args.repeats):
            rounds["stack"].append(timed(call, args.calls))
            rounds["head"].append(timed(call_head, args.calls))
        row = {}
        for name, values in rounds.items():
            walls, cpus = [v[0] for v in values], [v[1] for v in values]
            row[name] = {"wall_ms": statistics.median(walls), "wall_range": [min(walls), max(walls)],
                         "cpu_ms": statistics.median(cpus), "rounds": values}
        result["rows"][rows] = row
        st, hd = row["stack"], row["head"]
        print(f"rows={rows:>3} threads={torch.get_num_threads()}: stack {st['wall_ms']:.2f} ms wall "
              f"({st['wall_range'][0]:.2f}-{st['wall_range'][1]:.2f}), {st['cpu_ms']:.2f} ms CPU; "
              f"head {hd['wall_ms']:.2f} ms ({hd['wall_range'][0]:.2f}-{hd['wall_range'][1]:.2f}); "
              f"step {rows * 1e3 / (st['wall_ms'] + hd['wall_ms']):.0f} tok/s", flush=True)
    result["load_after"] = C.loadavg()
    print(f"load average before/after: {result['load_before']} / {result['load_after']}")
    C.save_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
