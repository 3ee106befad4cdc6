"""Paged decode attention in Triton: one query token per sequence against its KV pages.

Split-KV ("flash decoding"): one program per (sequence, KV head, split) walks its segment
of the sequence's page table in blocks of ``BLOCK_N`` positions with an online softmax,
for all query heads sharing that KV head (grouped-query attention). With more than one
split, each program writes its unnormalised partial (running max, sum, weighted values)
and a small second kernel merges a row's partials by log-sum-exp.

Why split: with one program per (sequence, KV head) a small batch cannot fill the GPU
(batch 1 of a 2-KV-head model is 2 programs on a 132-SM H200), and at batch 64 each SM
holds one program walking up to thousands of positions alone. The split count depends
only on the batch size and head counts (never on the lengths), so a CUDA graph captured
for a batch bucket stays valid while its contexts grow: a segment is the length divided
by the split count, rounded up to whole blocks, and a split whose segment starts past
the end has nothing to read and writes a neutral partial. A row whose length fits in one
segment is finished by its first split directly and the merge skips it.

Work is proportional to each sequence's real length, reads come straight from the pages
(no gather), and the launch shape depends only on the batch size and head counts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_block import unspecialized
from .launch import FastKernel

_LOG2E = 1.4426950408889634

# Launch settings, module-level so a benchmark can sweep them (graphs capture whatever
# they are when they are captured). DECODE_BLOCK_N: KV positions per inner step; 128
# measured faster than 64 on the H200 (bench/fused_latency.py, 2026-12-01). The split
# count is DECODE_SPLITS when set, else chosen by :func:`decode_splits`.
DECODE_BLOCK_N = 128
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 3
DECODE_SPLITS: int | None = None
# The automatic split count aims for this many programs per SM and never exceeds
# DECODE_MAX_SPLITS; DECODE_MIN_SPLIT_LEN is the shortest segment worth a program of its
# own (0: one block).
# Measured on the H200 (7166a36:bench/probes/paged_decode_speed.py, bench/results/
# paged_decode_speed_h200.json, 0.5B heads): 4 splits at 64 rows (33 -> 19 us a call on
# mixed lengths), one at 180 and 256 rows (two were 5-20% slower there on uniform lengths).
DECODE_PROGRAMS_PER_SM = 4
DECODE_MAX_SPLITS = 32
# The most K (or V) elements one program holds per block: the block shrinks below
# DECODE_BLOCK_N for wide heads. ptxas for sm_90a, 4 warps: head dim 128 at 128 positions
# spills ~1 KB per thread; at 64 (8,192 elements, as head dim 64 at 128) it does not.
DECODE_MAX_TILE = 8192
DECODE_MIN_SPLIT_LEN = 0
# Whether the whole-block loop loads the next block's K/V before using this block's
# (a software pipeline by hand; costs registers for a second K/V tile).
DECODE_PREFETCH = False
# Warps of a launch whose block is 16 positions (the code predictor's page).
DECODE_SHORT_WARPS = 4


@triton.jit
def _segment(seq_len, splits, BLOCK_N: tl.constexpr, MIN_SEG: tl.constexpr):
    """Positions per split for a sequence of ``seq_len``: the length over the split count,
    rounded up to whole blocks (so only the last block of a sequence is ever partial),
    and at least ``MIN_SEG``. Both kernels call this, so they agree on which rows were
    finished in one segment."""
    seg = tl.cdiv(tl.cdiv(seq_len, splits), BLOCK_N) * BLOCK_N
    return tl.maximum(seg, MIN_SEG)


@triton.jit
def _load_kv(
    K, V, TABLES, table_base, start, limit, k_head, v_head, stride_ks, stride_vs, d, dmask,
    PS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
    WIDE: tl.constexpr,
):
    """The K and V rows of positions ``[start, start + BLOCK_N)``, read through the page
    table; with ``MASKED``, positions at or past ``limit`` read as zeros (and nothing)."""
    n = start + tl.arange(0, BLOCK_N)
    if MASKED:
        nmask = n < limit
        page = tl.load(TABLES + table_base + n // PS, mask=nmask, other=0)
        kv_mask = nmask[:, None] & dmask[None, :]
    else:
        page = tl.load(TABLES + table_base + n // PS)
        kv_mask = dmask[None, :]
    slot = page.to(tl.int32) * PS + n % PS
    if WIDE:  # a cache of 2**31 elements or more: offsets need 64 bits
        slot = slot.to(tl.int64)
    k_ptrs = K + (slot * stride_ks + k_head)[:, None] + d[None, :]
    v_ptrs = V + (slot * stride_vs + v_head)[:, None] + d[None, :]
    if MASKED or D < BLOCK_D:
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    else:  # a whole block of a power-of-two head size: no predicates on the main loads
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    return k, v


@triton.jit
def _fold(
    q, k, v, start, seq_len, m_i, l_i, acc, qk_scale,
    BLOCK_N: tl.constexpr, IEEE: tl.constexpr, MASKED: tl.constexpr,
):
    """Positions ``[start, start + BLOCK_N)`` (keys ``k``, values ``v``) folded into the
    running softmax, in base 2 (``qk_scale`` is the softmax scale times log2(e)); with
    ``MASKED``, only those below ``seq_len``. Decode's own step rather than
    :func:`attention_block.attend_block`: the one query is the newest token, so it sees
    every position below the length and needs no causal mask."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if MASKED:
        n = start + tl.arange(0, BLOCK_N)
        s = tl.where((n < seq_len)[None, :], s * qk_scale, float("-inf"))
    else:
        s = s * qk_scale
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


# ``stride_tb`` is the page-table row stride: the graphs' static table width, but in an
# eager decode step the input batch's page capacity, which grows with the longest
# sequence seen. It only offsets the table row, so nothing is lost by not specialising;
# ``splits`` is only ever divided by. ``LENS`` is read one scalar a row, and is a row of a
# stacked array in a multi-step decode (its alignment following the batch size).
@triton.jit(**unspecialized(ints=("stride_tb", "splits"), pointers=("LENS",)))
def _paged_decode_kernel(
    Q, K, V, O, PART, STATS, TABLES, LENS, qk_scale, splits,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ob, stride_oh, stride_tb,
    R: tl.constexpr, PS: tl.constexpr, D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    SPLIT: tl.constexpr, MIN_SEG: tl.constexpr, PREFETCH: tl.constexpr, WIDE: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(LENS + b).to(tl.int32)
    if SPLIT:
        seg = _segment(seq_len, splits, BLOCK_N, MIN_SEG)
        start = sp * seg
        end = tl.minimum(start + seg, seq_len)
    else:
        seg = seq_len
        start = 0
        end = seq_len
    full_end = start + (tl.maximum(end - start, 0) // BLOCK_N) * BLOCK_N
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    h = g * R + r
    rmask = r < R
    dmask = d < D
    io_mask = rmask[:, None] & dmask[None, :]
    q = tl.load(Q + b * stride_qb + h[:, None] * stride_qh + d[None, :], mask=io_mask, other=0.0)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    base = b * stride_tb
    k_head = g * stride_kh
    v_head = g * stride_vh
    if PREFETCH:
        # The next block's K/V are loaded before this block's are used, so their reads
        # are in flight during this block's math (Triton does not pipeline these
        # page-table-indirect loads itself). The loads past the whole blocks read nothing.
        k, v = _load_kv(K, V, TABLES, base, start, full_end, k_head, v_head, stride_ks, stride_vs, d, dmask,
                        PS, D, BLOCK_N, BLOCK_D, True, WIDE)
        for blk in range(start, full_end, BLOCK_N):
            k_next, v_next = _load_kv(K, V, TABLES, base, blk + BLOCK_N, full_end, k_head, v_head, stride_ks, stride_vs,
                                      d, dmask, PS, D, BLOCK_N, BLOCK_D, True, WIDE)
            m, l, acc = _fold(q, k, v, blk, seq_len, m, l, acc, qk_scale, BLOCK_N, IEEE, False)
            k, v = k_next, v_next
    else:
        for blk in range(start, full_end, BLOCK_N):
            k, v = _load_kv(K, V, TABLES, base, blk, seq_len, k_head, v_head, stride_ks, stride_vs, d, dmask,
                            PS, D, BLOCK_N, BLOCK_D, False, WIDE)
            m, l, acc = _fold(q, k, v, blk, seq_len, m, l, acc, qk_scale, BLOCK_N, IEEE, False)
    for blk in range(full_end, end, BLOCK_N):  # the sequence's last block, when partial
        k, v = _load_kv(K, V, TABLES, base, blk, seq_len, k_head, v_head, stride_ks, stride_vs, d, dmask,
                        PS, D, BLOCK_N, BLOCK_D, True, WIDE)
        m, l, acc = _fold(q, k, v, blk, seq_len, m, l, acc, qk_scale, BLOCK_N, IEEE, True)
    o_ptrs = O + b * stride_ob + h[:, None] * stride_oh + d[None, :]
    if SPLIT:
        if seq_len <= seg:  # one segment holds the row: split 0 finishes it, the others had nothing
            if sp == 0:
                tl.store(o_ptrs, (acc / l[:, None]).to(O.dtype.element_ty), mask=io_mask)
        else:
            # Partials: PART [B, splits, H, D], STATS [2, B, splits, H] (max, sum), float32.
            heads = R * tl.num_programs(1)
            row = (b * splits + sp) * heads + h
            tl.store(PART + row[:, None] * D + d[None, :], acc, mask=io_mask)
            tl.store(STATS + row, m, mask=rmask)
            tl.store(STATS + tl.num_programs(0) * splits * heads + row, l, mask=rmask)
    else:
        tl.store(o_ptrs, (acc / l[:, None]).to(O.dtype.element_ty), mask=io_mask)


@triton.jit(**unspecialized(ints=("splits",), pointers=("LENS",)))
def _combine_kernel(
    O, PART, STATS, LENS, splits, stride_ob, stride_oh,
    D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SEG: tl.constexpr,
):
    """One program per (sequence, query head): the row's split partials merged by
    log-sum-exp. Rows finished in one segment were written by the decode kernel."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(LENS + b).to(tl.int32)
    if seq_len > _segment(seq_len, splits, BLOCK_N, MIN_SEG):
        heads = tl.num_programs(1)
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        smask = s < splits
        dmask = d < D
        row = (b * splits + s) * heads + h
        m = tl.load(STATS + row, mask=smask, other=float("-inf"))
        l = tl.load(STATS + tl.num_programs(0) * splits * heads + row, mask=smask, other=0.0)
        w = tl.exp2(m - tl.max(m, 0))  # a split with nothing to read has m = -inf: weight 0
        acc = tl.load(PART + row[:, None] * D + d[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
        tl.store(O + b * stride_ob + h * stride_oh + d, out.to(O.dtype.element_ty), mask=dmask)


def _launcher(fn):
    """Triton's interpreter (TRITON_INTERPRET=1, how the CPU tests run these) has no
    compiled launcher to call directly: it is launched through Triton there."""
    return FastKernel(fn) if hasattr(fn, "params") else fn


_PAGED_DECODE_LAUNCH = _launcher(_paged_decode_kernel)
_COMBINE_LAUNCH = _launcher(_combine_kernel)
_SM_COUNT: dict[int, int] = {}


def _pow2(x: int, floor: int = 16) -> int:
    p = floor
    while p < x:
        p *= 2
    return p


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _SM_COUNT.get(index)
    if count is None:
        count = _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def decode_splits(batch: int, kv_heads: int, sm_count: int) -> int:
    """The split count for a launch: ``DECODE_SPLITS`` when set; else enough splits that
    the grid holds at most about ``DECODE_PROGRAMS_PER_SM`` programs per SM (rounded
    down: one split once the batch alone holds more than half of that), at most
    ``DECODE_MAX_SPLITS``. It depends on the batch size and
    head count only, never on the lengths, so a captured graph stays right as its
    contexts grow."""
    if DECODE_SPLITS is not None:
        return max(1, DECODE_SPLITS)
    programs = batch * kv_heads
    want = DECODE_PROGRAMS_PER_SM * sm_count
    if programs >= want:
        return 1
    return max(1, min(DECODE_MAX_SPLITS, want // programs))


def launch_splits(batch: int, kv_heads: int, sm_count: int, span: int, block_n: int) -> int:
    """:func:`decode_splits`, or one split where the page tables' ``span`` (positions)
    fits one block of ``block_n``: a code predictor attends to one 16-position page, where
    32 splits at batch 1 were 31 empty programs a head and a merge kernel in each of its 80
    layer forwards a frame. Wider tables keep :func:`decode_splits`' count, so no kernel
    variant arises that the warm-up does not compile, and the count never follows the
    lengths."""
    return 1 if span <= block_n else decode_splits(batch, kv_heads, sm_count)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    page_size: int,
    scale: float,
    *,
    splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """``q``: ``[B, H, D]``; caches ``[slots, KVH, D]``; tables ``[B, P]``; lens ``[B]``
    (each at least 1). ``splits`` overrides :func:`launch_splits` (tests, benchmarks);
    ``block_n`` the positions per block (a power of two, at least 16; see
    :attr:`omni_async.kv.attention.AttentionContext.decode_block`)."""
    bsz, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    q = q.contiguous()
    out = torch.empty_like(q)
    block_n = block_n or max(16, min(DECODE_BLOCK_N, DECODE_MAX_TILE // _pow2(dim)))
    if splits is None:
        splits = launch_splits(bsz, kv_heads, _sm_count(q.device), block_tables.shape[1] * page_size, block_n)
    min_seg = -(-DECODE_MIN_SPLIT_LEN // block_n) * block_n
    if splits > 1:
        # Scratch comes from the caching allocator: inside a graph capture, the graph's
        # own pool, so each captured graph holds static partials of its bucket's shape.
        part = torch.empty((bsz, splits, heads, dim), dtype=torch.float32, device=q.device)
        stats = torch.empty((2, bsz, splits, heads), dtype=torch.float32, device=q.device)
    else:
        part = stats = out  # not read or written by the single-split kernel
    _PAGED_DECODE_LAUNCH[(bsz, kv_heads, splits)](
        q, k_cache, v_cache, out, part, stats, block_tables, kv_lens, scale * _LOG2E, splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0),
        R=heads // kv_heads, PS=page_size, D=dim,
        BLOCK_R=_pow2(heads // kv_heads), BLOCK_N=block_n, BLOCK_D=_pow2(dim), IEEE=q.dtype == torch.float32,
        SPLIT=splits > 1, MIN_SEG=min_seg, PREFETCH=DECODE_PREFETCH,
        WIDE=max(k_cache.numel(), v_cache.numel()) >= 2**31, num_warps=DECODE_NUM_WARPS if block_n > 16 else DECODE_SHORT_WARPS,
        num_stages=DECODE_NUM_STAGES,
    )
    if splits > 1:
        _COMBINE_LAUNCH[(bsz, heads)](
            out, part, stats, kv_lens, splits, out.stride(0), out.stride(1),
            D=dim, BLOCK_S=_pow2(splits, 2), BLOCK_D=_pow2(dim), BLOCK_N=block_n, MIN_SEG=min_seg,
        )
    return out
