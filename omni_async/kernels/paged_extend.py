"""Paged extend (prefill) attention in Triton: the new tokens of many sequences at once,
each attending causally to its cached prefix and to itself, read straight from the pages.

One program per (sequence, block of new tokens, query head). The new tokens' K/V are
already written to the pages, so a fresh prompt and a continued one (chunked prefill, a
resumed retraction) take the same path, and one launch per layer serves the whole batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_block import attend_block, unspecialized
from .launch import launcher


# Kept out of the compile key, since they change between prefill steps: ``stride_tb``
# (the input batch's page capacity) and the per-sequence scalars, rows of one stacked
# host array whose 16-byte alignment depends on the batch size's parity. Each is read
# as a scalar or only offsets a row, so specialising them buys nothing.
@triton.jit(**unspecialized(ints=("stride_tb",), pointers=("Q_START", "Q_LEN", "PREFIX")))
def _paged_extend_kernel(
    Q, K, V, O, TABLES, Q_START, Q_LEN, PREFIX, scale,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_tb,
    R: tl.constexpr, PS: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):
    seq = tl.program_id(0)
    mblock = tl.program_id(1)
    h = tl.program_id(2)
    g = h // R
    q_len = tl.load(Q_LEN + seq).to(tl.int32)
    if mblock * BLOCK_M >= q_len:
        return
    q_start = tl.load(Q_START + seq).to(tl.int32)
    prefix = tl.load(PREFIX + seq).to(tl.int32)
    m_offs = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = m_offs < q_len
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(Q + (q_start + m_offs)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0)
    q_pos = prefix + m_offs
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = prefix + tl.minimum((mblock + 1) * BLOCK_M, q_len)
    # Blocks at or below this block's first query position are seen whole by every row
    # (a cached prefix, mostly): no masks there; the rest is masked.
    full_end = ((prefix + mblock * BLOCK_M + 1) // BLOCK_N) * BLOCK_N
    for start in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = attend_block(
            q, K, V, TABLES, seq * stride_tb, start, kv_end, g * stride_kh, g * stride_vh, stride_ks, stride_vs,
            d, dmask, q_pos, m_i, l_i, acc, scale, PS, BLOCK_N, IEEE, False,
        )
    for start in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = attend_block(
            q, K, V, TABLES, seq * stride_tb, start, kv_end, g * stride_kh, g * stride_vh, stride_ks, stride_vs,
            d, dmask, q_pos, m_i, l_i, acc, scale, PS, BLOCK_N, IEEE, True,
        )
    out = acc / l_i[:, None]
    tl.store(O + (q_start + m_offs)[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(O.dtype.element_ty),
             mask=mmask[:, None] & dmask[None, :])


# Launch shape of the extend kernel.
TUNING = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}


_PAGED_EXTEND_LAUNCH = launcher(_paged_extend_kernel)  # the kernel itself under the interpreter


def _pow2(x: int, floor: int = 16) -> int:
    p = floor
    while p < x:
        p *= 2
    return p


def paged_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    max_q_len: int,
    page_size: int,
    scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """``q``: ``[T, H, D]`` (all sequences' new tokens); caches ``[slots, KVH, D]``. The
    block sizes and launch shape default to ``TUNING`` (chosen by ``tools/extend_kernel.py``)."""
    _t, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    q = q.contiguous()
    out = torch.empty_like(q)
    block_m = block_m or TUNING["block_m"]
    block_n = block_n or TUNING["block_n"]
    launch = {"num_warps": num_warps or TUNING["num_warps"], "num_stages": num_stages or TUNING["num_stages"]}
    grid = (q_lens.shape[0], triton.cdiv(max_q_len, block_m), heads)
    _PAGED_EXTEND_LAUNCH[grid](
        q, k_cache, v_cache, out, block_tables, q_starts, q_lens, prefix_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0),
        R=heads // kv_heads, PS=page_size, D=dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_pow2(dim), IEEE=q.dtype == torch.float32, **launch,
    )
    return out
