"""Mixture-of-experts FFN on CUDA: routed tokens sorted by expert on the device, then two
grouped GEMM launches over every expert at once (Triton).

Why: the torch path (:func:`omni_async.models.moe.experts_torch`) asks the host which
experts were hit, then runs a few small GEMMs per expert: a host sync per layer and
hundreds of launches per step, which neither a CUDA graph nor multi-step decode can
hold. Here nothing leaves the device: (token, choice) pairs are sorted by expert, each
expert's pairs padded to whole blocks of ``BLOCK_M`` rows, and one program per (block,
column tile) multiplies its rows by its expert's weights. The grid depends only on the
number of pairs (``ceil(pairs / BLOCK_M) + min(experts, pairs)`` blocks, enough for any
routing), so a graph captured at one batch size replays for any routing; blocks past
the last expert's read and write nothing.

Launches per MoE layer: the sort's few torch ops, the gate/up GEMM with SiLU-and-multiply
fused (its output is the down projection's input, one row per pair), the down GEMM with
the routing weight fused, and the sum over each token's ``top_k`` rows.

Imported only when Triton is present (see :func:`omni_async.kernels.triton_available`);
the CPU tests run it through Triton's interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import launcher

# Launch settings, module-level so a benchmark can sweep them (``tools/moe_layer.py
# --tiles``; graphs capture whatever they are when they are captured): each GEMM's
# columns and reduction depth per program, its warps and its software-pipeline stages.
GATE_UP_TILE = (64, 64, 4, 3)  # (BLOCK_N, BLOCK_K, num_warps, num_stages)
DOWN_TILE = (64, 64, 4, 3)


def block_rows(pairs: int) -> int:
    """Rows per block: 16 (the smallest ``tl.dot`` tile) while a block per expert
    dominates (decode), larger tiles once experts hold many rows each (prefill)."""
    if pairs <= 2048:
        return 16
    return 32 if pairs <= 8192 else 64


@dataclass(frozen=True)
class ExpertBlocks:
    """The sorted routing of one MoE layer call, all on the device.

    ``pairs[b * block_m + r]`` is the flat (token * top_k + choice) index of row ``r`` of
    block ``b``, or ``num_pairs`` for padding; ``block_expert[b]`` is the expert of block
    ``b``, -1 for blocks past the last expert's."""

    pairs: torch.Tensor
    block_expert: torch.Tensor
    num_pairs: int
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.numel()


def sort_by_expert(ids: torch.Tensor, num_experts: int, block_m: int | None = None) -> ExpertBlocks:
    """``ids`` ``[T, top_k]``: each token's chosen experts. Sorting, counting and
    padding in torch ops that never synchronise with the host."""
    flat = ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    bm = block_m or block_rows(n)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks_per = (counts + bm - 1) // bm
    block_end = torch.cumsum(blocks_per, 0)
    block_start = block_end - blocks_per
    pair_start = torch.cumsum(counts, 0) - counts
    max_blocks = triton.cdiv(n, bm) + min(num_experts, n)
    index = torch.arange(max_blocks, device=flat.device)
    block_expert = torch.searchsorted(block_end, index, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    sorted_expert = flat[order]
    rank = torch.arange(n, device=flat.device) - pair_start[sorted_expert]
    dest = block_start[sorted_expert] * bm + rank
    pairs = torch.full((max_blocks * bm,), n, dtype=torch.int64, device=flat.device)
    pairs.scatter_(0, dest, order)
    return ExpertBlocks(pairs.to(torch.int32), block_expert, n, bm)


@triton.jit
def _expert_gemm_kernel(
    A, W, OUT, PAIRS, BLOCK_EXPERT, SCALE,
    num_pairs, n_cols, rows_per_a,
    stride_a, stride_we, stride_wn, stride_wk, stride_o,
    K_DIM: tl.constexpr, GATED: tl.constexpr, SCALED: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Program (block b, column tile): rows of block b times its expert's weight rows
    # [tile] (and, GATED, the matching up rows n_cols further on, SiLU(gate) * up).
    # K_DIM is fixed by the model's shape: a compile-time loop bound. IEEE: float32
    # operands multiplied in float32 (Triton's default would round them to TF32).
    b = tl.program_id(0)
    tile = tl.program_id(1)
    expert = tl.load(BLOCK_EXPERT + b)
    live = expert >= 0
    expert = tl.maximum(expert, 0)
    pair = tl.load(PAIRS + b * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = (pair < num_pairs) & live
    a_row = pair // rows_per_a
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    w_base = W + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_DIM, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = (ks < K_DIM) & live  # a block past the last expert's reads nothing
        a = tl.load(A + a_row[:, None].to(tl.int64) * stride_a + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wk, mask=w_mask, other=0.0)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
        if GATED:
            wu = tl.load(w_base + (cols + n_cols)[None, :] * stride_wn + ks[:, None] * stride_wk, mask=w_mask, other=0.0)
            if IEEE:
                acc_up += tl.dot(a, wu, input_precision="ieee")
            else:
                acc_up += tl.dot(a, wu)
    if GATED:
        gate = acc.to(OUT.dtype.element_ty).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(OUT.dtype.element_ty).to(tl.float32)
        acc = silu * acc_up.to(OUT.dtype.element_ty).to(tl.float32)
    if SCALED:
        scale = tl.load(SCALE + pair, mask=valid, other=0.0).to(tl.float32)
        acc = acc * scale[:, None]
    out = OUT + pair[:, None].to(tl.int64) * stride_o + cols[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


_EXPERT_GEMM_LAUNCH = launcher(_expert_gemm_kernel)


def _expert_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, blocks: ExpertBlocks, rows_per_a: int,
                 n_cols: int, scale: torch.Tensor | None, gated: bool) -> None:
    assert a.stride(1) == 1 and out.stride(1) == 1
    block_n, block_k, warps, stages = GATE_UP_TILE if gated else DOWN_TILE
    grid = (blocks.num_blocks, triton.cdiv(n_cols, block_n))
    _EXPERT_GEMM_LAUNCH[grid](
        a, w, out, blocks.pairs, blocks.block_expert, scale if scale is not None else out,
        blocks.num_pairs, n_cols, rows_per_a,
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        K_DIM=w.shape[2], GATED=gated, IEEE=a.dtype == torch.float32, SCALED=scale is not None, BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
    )


def grouped_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
    block_m: int | None = None,
) -> torch.Tensor:
    """``sum_k weights[t, k] * down[e] @ (silu(gate[e] @ x[t]) * up[e] @ x[t])`` with
    ``e = ids[t, k]``, for ``x`` ``[T, H]``, ``gate_up`` ``[E, 2I, H]`` (gate rows first),
    ``down`` ``[E, H, I]``; returns ``[T, H]`` in ``x``'s dtype."""
    t, hidden = x.shape
    top_k = ids.shape[1]
    inter = down.shape[2]
    if t == 0:
        return x.new_zeros(0, hidden)
    blocks = sort_by_expert(ids, gate_up.shape[0], block_m)
    act = torch.empty(blocks.num_pairs, inter, dtype=x.dtype, device=x.device)
    _expert_gemm(x, gate_up, act, blocks, top_k, inter, None, gated=True)
    rows = torch.empty(blocks.num_pairs, hidden, dtype=torch.float32, device=x.device)
    _expert_gemm(act, down, rows, blocks, 1, hidden, weights.reshape(-1).contiguous(), gated=False)
    return rows.view(t, top_k, hidden).sum(1).to(x.dtype)
