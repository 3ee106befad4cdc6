"""The inner step shared by the paged attention kernels: one block of KV positions read
through a page table, folded into a running (online) softmax."""

from __future__ import annotations

import inspect

import triton
import triton.language as tl


def unspecialized(ints: tuple[str, ...] = (), pointers: tuple[str, ...] = ()) -> dict:
    """``triton.jit`` options that keep these arguments out of the compile key.

    Why: Triton compiles a kernel once per specialisation of its arguments (an integer
    equal to 1, an integer or a pointer divisible by 16), at the launch that first meets
    it. An argument whose value moves between steps (a page-table stride that follows
    the input batch's page capacity, a row of a stacked host array whose alignment
    follows the batch's parity) can then compile a new variant mid-run: a stall of
    hundreds of ms on the launching thread. The options exist in this Triton or not
    (``do_not_specialize_on_alignment`` came in Triton 3.x); what exists is used."""
    params = inspect.signature(triton.jit).parameters
    opts: dict = {"do_not_specialize": list(ints)} if ints else {}
    if "do_not_specialize_on_alignment" in params and (ints or pointers):
        opts["do_not_specialize_on_alignment"] = [*ints, *pointers]
    return opts


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
