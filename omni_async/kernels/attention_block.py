"""The inner step shared by the paged attention kernels: one block of KV positions read
through a page table, folded into a running (online) softmax."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_block(
    q, K, V, TABLES, table_base, start, kv_end, k_head, v_head, stride_ks, stride_vs,
    d, dmask, q_pos, m_i, l_i, acc, scale,
    PS: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, MASKED: tl.constexpr,
):
    """Rows of ``q`` attend to positions ``[start, start + BLOCK_N)`` below ``kv_end`` and
    at most their own position ``q_pos``. Returns the updated ``(m_i, l_i, acc)``.
    ``MASKED=False`` is for a block every row sees whole (all positions below ``kv_end``
    and below every row's own): no bounds or causal masks."""
    n = start + tl.arange(0, BLOCK_N)
    nmask = n < kv_end
    if MASKED:
        page = tl.load(TABLES + table_base + n // PS, mask=nmask, other=0)
    else:
        page = tl.load(TABLES + table_base + n // PS)
    slot = page * PS + n % PS
    kv_mask = nmask[:, None] & dmask[None, :]
    k = tl.load(K + slot[:, None] * stride_ks + k_head + d[None, :], mask=kv_mask, other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if MASKED:
        allowed = (n[None, :] <= q_pos[:, None]) & nmask[None, :]
        s = tl.where(allowed, s * scale, float("-inf"))
    else:
        s = s * scale
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + slot[:, None] * stride_vs + v_head + d[None, :], mask=kv_mask, other=0.0)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc
