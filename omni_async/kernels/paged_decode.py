"""Paged decode attention in Triton: one query token per sequence against its KV pages.

One program per (sequence, KV head) walks the sequence's page table in blocks of
``BLOCK_N`` positions with an online softmax, for all query heads sharing that KV head
(grouped-query attention). Work is proportional to each sequence's real length, reads
come straight from the pages (no gather), and the launch shape depends only on the batch
size and head counts, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_block import attend_block, unspecialized
from .launch import FastKernel


# ``stride_tb`` is the page-table row stride: the graphs' static table width, but in an
# eager decode step the input batch's page capacity, which grows with the longest
# sequence seen. It only offsets the table row, so nothing is lost by not specialising.
@triton.jit(**unspecialized(ints=("stride_tb",)))
def _paged_decode_kernel(
    Q, K, V, O, TABLES, LENS, scale,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ob, stride_oh, stride_tb,
    R: tl.constexpr, PS: tl.constexpr, D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)
    seq_len = tl.load(LENS + b).to(tl.int32)
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    h = g * R + r
    rmask = r < R
    dmask = d < D
    q = tl.load(Q + b * stride_qb + h[:, None] * stride_qh + d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    q_pos = tl.zeros([BLOCK_R], tl.int32) + (seq_len - 1)  # every row is the newest token
    for start in range(0, seq_len, BLOCK_N):
        m, l, acc = attend_block(
            q, K, V, TABLES, b * stride_tb, start, seq_len, g * stride_kh, g * stride_vh, stride_ks, stride_vs,
            d, dmask, q_pos, m, l, acc, scale, PS, BLOCK_N, IEEE, True,
        )
    out = acc / l[:, None]
    tl.store(O + b * stride_ob + h[:, None] * stride_oh + d[None, :], out.to(O.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


# KV positions per inner step of the decode kernel (a module setting so a benchmark can
# compare block sizes; graphs capture whatever it is when they are captured). 128 measured
# faster than 64 on the H200 (bench/fused_latency.py, 2026-12-01): a Qwen2-0.5B-shaped
# batch-1 step 1.08 -> 1.02 ms at 256 positions, 2.10 -> 1.66 ms at 2048.
DECODE_BLOCK_N = 128


_PAGED_DECODE_LAUNCH = FastKernel(_paged_decode_kernel)


def _pow2(x: int, floor: int = 16) -> int:
    p = floor
    while p < x:
        p *= 2
    return p


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    page_size: int,
    scale: float,
) -> torch.Tensor:
    """``q``: ``[B, H, D]``; caches ``[slots, KVH, D]``; tables ``[B, P]``; lens ``[B]``."""
    bsz, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    q = q.contiguous()
    out = torch.empty_like(q)
    _PAGED_DECODE_LAUNCH[(bsz, kv_heads)](
        q, k_cache, v_cache, out, block_tables, kv_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0),
        R=heads // kv_heads, PS=page_size, D=dim,
        BLOCK_R=_pow2(heads // kv_heads), BLOCK_N=DECODE_BLOCK_N, BLOCK_D=_pow2(dim), IEEE=q.dtype == torch.float32,
    )
    return out
