"""The decode GEMMs of the Qwen2-0.5B shape: cuBLAS (``F.linear``, bf16) against a plain
Triton GEMM over a small config sweep, at the batch sizes of big decode steps.

Why: the H200 profile of NV256 (2026-12-04) spent ~0.8 s of 1.93 s of kernel time in
cuBLAS's decode GEMMs (plus 18,792 ``splitKreduce_kernel`` launches), against ~0.25 s that
their weights and FLOPs bound. This says, shape by shape, whether a Triton path is worth
writing: us per call and the bandwidth achieved on the bytes the call must move (weights,
inputs, outputs). ``gate_up`` is also timed with SiLU*mul fused into the epilogue (its
cuBLAS side: the GEMM plus the project's ``silu_mul`` kernel), which also saves the
[M, 9728] intermediate's round trip.

Each variant runs as a CUDA graph of ``--layers`` calls, each on its own copy of the
weights (as a decode step walks its layers: the weights come from HBM, not L2), timed
with CUDA events over replays, repeats interleaved across variants; every variant is
checked against float32 math first. The Triton kernel is pointer-based (no TMA, no
split-K): a first answer, not the best Triton can do.

    python bench/probes/gemm_shapes.py --out bench/results/gemm_shapes_h200.json   # ~1-2 min on the H200
    python bench/probes/gemm_shapes.py --smoke       # CPU, Triton's interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
from pathlib import Path

if "--smoke" in sys.argv:  # the interpreter is chosen when Triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from _common import machine_facts, save_json  # noqa: E402
from graph_timer import graph_timer  # noqa: E402

# (name, K, N, bias, fused SiLU*mul): Qwen2-0.5B's decode GEMMs (hidden 896, 14 + 2 + 2
# heads of 64, intermediate 4864, vocabulary 151,936 with the head tied).
SHAPES = (
    ("qkv", 896, 1152, True, False),
    ("o", 896, 896, False, False),
    ("gate_up", 896, 9728, False, False),
    ("gate_up_silu", 896, 9728, False, True),
    ("down", 4864, 896, False, False),
    ("lm_head", 896, 151936, False, False),
)
SMOKE_SHAPES = (
    ("qkv", 64, 96, True, False),
    ("gate_up_silu", 64, 128, False, True),
    ("down", 128, 64, False, False),
)
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
CONFIGS = (
    (64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 128, 128, 4, 3), (64, 32, 128, 4, 4),
    (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (64, 256, 64, 8, 3), (128, 256, 64, 8, 3),
)


@triton.jit
def _gemm_kernel(
    X, W, BIAS, Y, M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``Y = X @ W.T (+ bias)``; with ``SILU_MUL``, ``W`` is ``[2N, K]`` laid out
    ``[gate; up]`` and ``Y = silu(X @ Wg.T) * (X @ Wu.T)`` (``[M, N]``). K is a multiple
    of ``BLOCK_K``. Program (m tile, n tile); fp32 accumulators."""
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(0)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < N
    x_ptrs = X + rm[:, None] * stride_xm + rk[None, :]
    w_ptrs = W + rn[:, None] * stride_wn + rk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if SILU_MUL:
        u_ptrs = w_ptrs + N * stride_wn
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=mmask[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=nmask[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        if SILU_MUL:
            u = tl.load(u_ptrs, mask=nmask[:, None], other=0.0)
            acc_u = tl.dot(x, tl.trans(u), acc_u)
            u_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_u
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def triton_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool, cfg: tuple) -> torch.Tensor:
    bm, bn, bk, warps, stages = cfg
    m, k = x.shape
    n = w.shape[0] // 2 if silu_mul else w.shape[0]
    assert k % bk == 0, (k, bk)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
    _gemm_kernel[grid](x, w, bias if bias is not None else y, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                       HAS_BIAS=bias is not None, SILU_MUL=silu_mul, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                       num_warps=warps, num_stages=stages)
    return y


def cublas_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool) -> torch.Tensor:
    y = F.linear(x, w, bias)
    if not silu_mul:
        return y
    if x.is_cuda:
        from omni_async.kernels.fused import silu_mul as fused_silu_mul

        return fused_silu_mul(y)
    g, u = y.chunk(2, dim=-1)
    return F.silu(g) * u


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool) -> torch.Tensor:
    y = x.float() @ w.float().T + (bias.float() if bias is not None else 0.0)
    if silu_mul:
        g, u = y.chunk(2, dim=-1)
        y = F.silu(g) * u
    return y


def make_timer(fn, calls: list, device: str):
    """A callable timing ``replays`` runs of the calls (a captured graph on CUDA), in ms."""
    return graph_timer(lambda: [fn(*c) for c in calls], device)[0]


def run_shape(name: str, k: int, n: int, has_bias: bool, silu: bool, m: int, args, device: str, dtype) -> dict:
    gen = torch.Generator(device=device).manual_seed(m * 7 + k)
    copies = args.head_copies if name == "lm_head" else args.layers
    ws = [torch.randn(n, k, generator=gen, device=device, dtype=dtype) * k**-0.5 for _ in range(copies)]
    bs = [torch.randn(n, generator=gen, device=device, dtype=dtype) if has_bias else None for _ in range(copies)]
    x = torch.randn(m, k, generator=gen, device=device, dtype=dtype)
    calls = [(x, w, b, silu) for w, b in zip(ws, bs)]
    out_cols = n // 2 if silu else n  # [gate; up]: the fused kernel writes half the columns
    size = torch.tensor([], dtype=dtype).element_size()
    moved = (n * k + m * k + m * out_cols + (n if has_bias else 0)) * size
    want = reference(x, ws[0], bs[0], silu)
    scale = float(want.abs().max())
    timers, row = {}, {"M": m, "K": k, "N": n, "bias": has_bias, "silu_mul": silu, "bytes_per_call": moved, "variants": {}}
    variants = [("cublas", lambda x, w, b, s: cublas_linear(x, w, b, s))]
    for cfg in args.configs:
        if k % cfg[2] == 0:
            variants.append(("triton_" + "x".join(map(str, cfg)), lambda x, w, b, s, cfg=cfg: triton_linear(x, w, b, s, cfg)))
    for vname, fn in variants:
        try:
            err = float((fn(x, ws[0], bs[0], silu).float() - want).abs().max()) / max(scale, 1e-6)
            if err > 0.05:
                row["variants"][vname] = {"error": f"relative error {err:.3g}"}
                print(name, m, vname, "WRONG", err, flush=True)
                continue
            timers[vname] = make_timer(fn, calls, device)
            row["variants"][vname] = {"rel_err": err, "ms": []}
        except Exception as exc:  # a config the compiler refuses (shared memory, registers)
            row["variants"][vname] = {"error": repr(exc)[:300]}
            print(name, m, vname, "failed:", repr(exc)[:120], flush=True)
    for _ in range(args.repeats):
        for vname, t in timers.items():
            row["variants"][vname]["ms"].append(t(args.replays))
    for vname in timers:
        r = row["variants"][vname]
        med = statistics.median(r["ms"])
        r["us_per_call"] = med * 1e3 / (args.replays * len(calls))
        r["tb_per_s"] = moved / (r["us_per_call"] * 1e-6) / 1e12
        r["spread_pct"] = 100 * (max(r["ms"]) - min(r["ms"])) / med
    del ws, bs, calls, timers
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def report(key: str, row: dict) -> None:
    timed = {n: r for n, r in row["variants"].items() if "us_per_call" in r}
    if "cublas" not in timed:
        print(key, "no cuBLAS timing")
        return
    cb = timed["cublas"]
    best = min((n for n in timed if n != "cublas"), key=lambda n: timed[n]["us_per_call"], default=None)
    line = f"{key:22s} {row['bytes_per_call'] / 1e6:8.2f} MB  cublas {cb['us_per_call']:8.2f} us {cb['tb_per_s']:5.2f} TB/s"
    if best:
        b = timed[best]
        line += (f"  best {best:26s} {b['us_per_call']:8.2f} us {b['tb_per_s']:5.2f} TB/s"
                 f"  {cb['us_per_call'] / b['us_per_call']:5.2f}x  spread {b['spread_pct']:.1f}%/{cb['spread_pct']:.1f}%")
    print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="64,128,192,256", help="rows (decode batch sizes)")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--layers", type=int, default=24, help="weight copies per graph (one per layer)")
    ap.add_argument("--head-copies", type=int, default=2, help="lm_head weight copies per graph (544 MB at 2)")
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/gemm_shapes.json)")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes: checks the script runs")
    args = ap.parse_args()
    args.configs = CONFIGS
    shapes = [s for s in SHAPES if s[0] in args.shapes.split(",")]
    device, dtype = "cuda", torch.bfloat16
    if args.smoke:
        device, dtype, shapes = "cpu", torch.float32, list(SMOKE_SHAPES)
        args.m, args.layers, args.head_copies, args.replays, args.repeats = "16", 2, 1, 1, 1
        args.configs = ((16, 32, 32, 4, 2), (16, 64, 64, 4, 2))
    results: dict = {
        "probe": "gemm_shapes", "machine": machine_facts(), "triton": triton.__version__,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (interpreter smoke test)",
        "argv": sys.argv[1:], "layers": args.layers, "replays": args.replays, "repeats": args.repeats, "rows": {},
    }
    out = Path(args.out) if args.out else Path("gemm_shapes_smoke.json" if args.smoke else "gemm_shapes.json")
    for (name, k, n, has_bias, silu), m in itertools.product(shapes, map(int, args.m.split(","))):
        key = f"{name}_M{m}"
        results["rows"][key] = row = run_shape(name, k, n, has_bias, silu, m, args, device, dtype)
        report(key, row)
        path = save_json(out, results)  # after each shape: a partial run keeps what it measured
    print("saved", path)


if __name__ == "__main__":
    main()
