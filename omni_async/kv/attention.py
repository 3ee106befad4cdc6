"""Attention over paged KV, written plainly in torch: the correct reference for CPU.

Decode rows are batched (pages gathered into a padded ``[B, L]`` view and masked);
prefill/extend sequences are handled one by one with a causal mask offset by the
tokens already in the cache (chunked prefill and resumed requests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionContext:
    """Where each new token goes and what each sequence attends to, for one step.

    ``slot_mapping[t]`` is the KV slot of new token ``t``. For decode steps,
    ``kv_slots`` is ``[B, L]`` (padded) and ``kv_lens`` ``[B]``. For extend steps,
    ``seq_slices`` lists ``(q_start, q_len, prefix_len)`` per sequence and
    ``seq_kv_slots`` the slots of its whole context (prefix + new tokens).
    ``logits_rows`` picks the hidden rows whose next-token logits are wanted.
    """

    is_decode: bool
    slot_mapping: torch.Tensor
    logits_rows: torch.Tensor
    kv_slots: torch.Tensor | None = None
    kv_lens: torch.Tensor | None = None
    # Decode under CUDA graphs: page tables ``[B, P]`` on the device; ``kv_slots`` is
    # then derived on the device for a fixed span of ``P * page_size`` positions.
    block_tables: torch.Tensor | None = None
    page_size: int = 0
    use_kernel: bool = False  # attention through the Triton paged kernels (CUDA)
    # Positions per block of the decode kernel (0: its own choice). A caller whose tables
    # never grow sets it to their span (the code predictor: one 16-position page), so the
    # kernel reads no masked positions; others leave it, so no variant arises that the
    # warm-up did not compile.
    decode_block: int = 0
    cpu_kernel: bool = False  # CPU decode through the C++ kernel reading pages in place
    cpu_prefill: bool = False  # CPU extend through one C++ call per layer (cpu_fused_ops)
    cpu_prefill_tables: tuple[torch.Tensor, torch.Tensor] | None = None  # built by its first layer
    # Extend steps through the kernel: per-sequence starts, lengths, prefixes on the device.
    q_starts: torch.Tensor | None = None
    q_lens: torch.Tensor | None = None
    prefix_lens: torch.Tensor | None = None
    max_q_len: int = 0
    seq_slices: list[tuple[int, int, int]] | None = None
    seq_kv_slots: list[torch.Tensor] | None = None


# Grouped-query attention without materialising repeated K/V (torch >= 2.5). Read from the
# version, not probed with a call: a torch op at import would give the importing thread an
# OpenMP team, which slows every CPU step (see builder.build_off_this_thread).
_HAS_GQA = torch.torch_version.TorchVersion(torch.__version__) >= "2.5"
_GQA = {"enable_gqa": True} if _HAS_GQA else {}


def slots_from_tables(block_tables: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[B, P]`` page tables to ``[B, P * page_size]`` KV slots, on the device."""
    offsets = torch.arange(page_size, device=block_tables.device, dtype=block_tables.dtype)
    return (block_tables[:, :, None] * page_size + offsets).flatten(1)


def _expand_kv(x: torch.Tensor, n_rep: int, head_dim_axis: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=head_dim_axis)


def pages_from_slots(kv_slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[B, L]`` KV slots back to ``[B, ceil(L / page_size)]`` page tables: the first slot
    of each page is ``page * page_size``."""
    return kv_slots[:, ::page_size] // page_size


def decode_over_pages(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,
    page_size: int,
    kv_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention on CPU, gathering whole pages rather than single slots: one
    index entry per page instead of per token (the per-slot gather was ~10% of a SmolLM2
    decode step at 64 sequences). Positions past each sequence's length are masked."""
    b, p = pages.shape
    kvh, d = k_cache.shape[1], k_cache.shape[2]
    flat = pages.reshape(-1)
    k = k_cache.view(-1, page_size * kvh * d).index_select(0, flat).view(b, p * page_size, kvh, d)
    v = v_cache.view(-1, page_size * kvh * d).index_select(0, flat).view(b, p * page_size, kvh, d)
    return _decode_sdpa(q, k, v, kv_lens, scale, q.shape[1] // kvh)


def _decode_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lens: torch.Tensor, scale: float, n_rep: int
) -> torch.Tensor:
    """One query per sequence over ``[B, L, KVH, D]`` keys/values, masked past ``kv_lens``.

    ``k`` and ``v`` are the caller's own gathered copies: the slots past each length are
    zeroed in them in place. Those slots hold whatever the page's last owner left (a failed
    request's NaN); a mask alone does not keep them out, since NaN plus the mask's -inf,
    or NaN times a zero weight, is still NaN."""
    past = torch.arange(k.shape[1], device=q.device)[None, :] >= kv_lens[:, None]  # [B, L]
    k.masked_fill_(past[:, :, None, None], 0)
    v.masked_fill_(past[:, :, None, None], 0)
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        return _decode_matmul(q, k, v, past, scale)
    if not _HAS_GQA:
        k, v = _expand_kv(k, n_rep, 2), _expand_kv(v, n_rep, 2)
    mask = (~past)[:, None, None, :]  # [B,1,1,L]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, H, 1, D]
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        **_GQA,
    )
    return out.squeeze(2)


def _decode_matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention as two batched matmuls, softmax in float32; ``past`` ``[B, L]``
    marks the slots past each sequence's length (zeroed by the caller).

    On CPU in bfloat16 this is ~3x faster than torch's fused SDPA kernel (which took ~60%
    of a bfloat16 SmolLM2 decode step at 64 sequences). Keys and values are first made
    ``[B, KVH, L, D]`` contiguous (a copy that keeps ``D`` innermost); the keys then enter
    the matmul as a transposed view, which BLAS reads in place. Handing it a ``[B, KVH, D,
    L]`` permuted view instead made it copy element by element (~4x slower)."""
    b, h, d = q.shape
    kvh = k.shape[2]
    keys = k.transpose(1, 2).contiguous()  # [B, KVH, L, D]
    values = v.transpose(1, 2).contiguous()
    scores = torch.matmul(q.view(b, kvh, h // kvh, d), keys.transpose(-1, -2)).float() * scale
    scores.masked_fill_(past[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, values).reshape(b, h, d)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """SDPA, in float32 for half-precision inputs on CPU, where torch's fused kernel is
    several times slower in bfloat16 than in float32."""
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, **kw)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ctx: AttentionContext,
    scale: float,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q``: ``[T, H, D]`` for the new tokens (their K/V already written). Returns ``[T, H, D]``."""
    num_heads = q.shape[1]
    n_rep = num_heads // k_cache.shape[1]
    if ctx.is_decode:
        if ctx.use_kernel and ctx.block_tables is not None:
            from ..kernels.paged_decode import paged_decode_attention

            return paged_decode_attention(q, k_cache, v_cache, ctx.block_tables, ctx.kv_lens, ctx.page_size, scale,
                                          block_n=ctx.decode_block or None)
        if ctx.block_tables is not None and ctx.page_size and q.device.type == "cpu":
            if ctx.cpu_kernel:
                from ..kernels.cpu_paged import paged_decode

                return paged_decode(q, k_cache, v_cache, ctx.block_tables, ctx.page_size, ctx.kv_lens, scale)
            return decode_over_pages(q, k_cache, v_cache, ctx.block_tables, ctx.page_size, ctx.kv_lens, scale)
        if ctx.kv_slots is None and ctx.block_tables is not None:
            ctx.kv_slots = slots_from_tables(ctx.block_tables, ctx.page_size)  # once per forward
        assert ctx.kv_slots is not None and ctx.kv_lens is not None
        k = k_cache[ctx.kv_slots]  # [B, L, KVH, D]
        v = v_cache[ctx.kv_slots]
        return _decode_sdpa(q, k, v, ctx.kv_lens, scale, n_rep)
    if ctx.use_kernel and ctx.block_tables is not None:
        from ..kernels.paged_extend import paged_extend_attention

        return paged_extend_attention(
            q, k_cache, v_cache, ctx.block_tables, ctx.q_starts, ctx.q_lens, ctx.prefix_lens,
            ctx.max_q_len, ctx.page_size, scale,
        )
    assert ctx.seq_slices is not None and ctx.seq_kv_slots is not None
    if ctx.cpu_prefill and k_cache.is_contiguous() and v_cache.is_contiguous() and q.dtype == k_cache.dtype:
        from ..kernels.cpu_fused import extend_attention, extend_tables

        if ctx.cpu_prefill_tables is None:
            ctx.cpu_prefill_tables = extend_tables(ctx.seq_slices, ctx.seq_kv_slots)
        return extend_attention(q, k_cache, v_cache, ctx.cpu_prefill_tables, scale)
    out = torch.empty_like(q)
    for (q_start, q_len, prefix_len), slots in zip(ctx.seq_slices, ctx.seq_kv_slots):
        if prefix_len == 0 and k_new is not None and v_new is not None and _HAS_GQA:
            # A fresh sequence attends only to its own new tokens: no gather from pages.
            o = _sdpa(
                q[q_start : q_start + q_len].transpose(0, 1),
                k_new[q_start : q_start + q_len].transpose(0, 1),
                v_new[q_start : q_start + q_len].transpose(0, 1),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            out[q_start : q_start + q_len] = o.transpose(0, 1)
            continue
        k = _expand_kv(k_cache[slots], n_rep, 1).transpose(0, 1)  # [H, L, D]
        v = _expand_kv(v_cache[slots], n_rep, 1).transpose(0, 1)
        kv_len = slots.shape[0]
        q_pos = prefix_len + torch.arange(q_len, device=q.device)
        mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
        qs = q[q_start : q_start + q_len].transpose(0, 1)  # [H, q_len, D]
        o = _sdpa(qs, k, v, attn_mask=mask, scale=scale)
        out[q_start : q_start + q_len] = o.transpose(0, 1)
    return out
