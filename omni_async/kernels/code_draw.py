"""A code predictor's draw, one Triton launch per codebook (CUDA).

Why: the predictor draws 15 codes a frame, one after another, each from a small
vocabulary (2,048) with temperature, top-k and top-p. In torch that draw is ~30 small
kernels (scale, top-k or sort, gathers, two softmaxes, two scans, a search), 450 a frame,
more than the predictor's layers once those are fused. Here one program per row holds
its whole row: it orders the row once (value descending, index ascending on ties: keys
that pack the value's order-preserving bits above the index; the whole row, or only its
``top_k_cap`` largest when every row's top-k is within the cap; 16-bit logits by 32-bit
keys, float32 ones by 64-bit keys), keeps the top-k, drops the
tail past top-p as transformers does (a token goes once the probability before it
reaches top-p; the first always stays), and takes the kept token where the row's uniform
falls in the cumulative distribution.

It computes :func:`omni_async.speech.sampling.draw_codes`' rule with the same uniform
(``row_uniforms(seed, index)``), in float32 weights and a float64 scan rather than the
torch path's float64 scan of float32 softmax probabilities: a draw can differ only where
the uniform lands within a rounding of a boundary of the distribution. Greedy rows
(temperature 0) take the first index of the maximum. Capturable in a CUDA graph: fixed
grid, outputs allocated by shape, no host reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_block import unspecialized
from .launch import FastKernel
from .sample import _exp, _uniform

# The widest vocabulary one program holds (the released predictors have 2,048 codes).
MAX_VOCAB = 8192
# 16-bit logits (the predictor's head in bf16) ordered by 32-bit keys (their own order-
# preserving bits above the index) instead of 64-bit ones (a float32 value's): the same
# order, half the data through the top-k network. Off: 64-bit keys (for timing).
SHORT_KEYS = True


@triton.jit
def _order_key(z, offs, BLOCK: tl.constexpr):
    """int64 keys whose descending order is (z descending, index ascending)."""
    bits = z.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (key.to(tl.int64) << 32) | (BLOCK - 1 - offs).to(tl.int64)


@triton.jit
def _short_key(x, offs, BLOCK: tl.constexpr):
    """int32 keys whose descending order is (x descending, index ascending), for 16-bit x:
    dividing by a positive temperature keeps x's order, so these order the scaled row too."""
    bits = x.to(tl.int16, bitcast=True).to(tl.int32)
    key = bits ^ ((bits >> 15) & 0x7FFF)
    return (key << 16) | (BLOCK - 1 - offs)


@triton.jit
def _unkey(s, BLOCK: tl.constexpr):
    hi = (s >> 32).to(tl.int32)
    z = (hi ^ ((hi >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    return z, (BLOCK - 1) - (s & 0xFFFFFFFF).to(tl.int32)


@triton.jit(**unspecialized(ints=("V", "GROUP", "stride_x", "stride_o")))
def _draw_kernel(X, TEMP, TOPK, TOPP, SEEDS, BASE, OUT, V, GROUP, stride_x, stride_o, BLOCK: tl.constexpr,
                 KEEP: tl.constexpr, SHORT: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    inside = offs < V
    start = X + row.to(tl.int64) * stride_x
    raw = tl.load(start + offs, mask=inside, other=float("-inf"))
    x = raw.to(tl.float32)
    m = tl.max(x, 0)
    token = tl.min(tl.where(x == m, offs, BLOCK), 0).to(tl.int64)
    temp = tl.load(TEMP + row)
    if temp > 0:
        t = tl.maximum(temp, 1e-30)
        pos = tl.arange(0, KEEP)  # (new names: a runtime branch may not change a variable's shape)
        held = pos < V
        if SHORT:  # 32-bit keys of the raw 16-bit logits; the kept ones' scaled values read back
            keys = _short_key(raw, offs, BLOCK)
            ordered = tl.topk(keys, KEEP) if KEEP < BLOCK else tl.sort(keys, 0, descending=True)
            sidx = (BLOCK - 1) - (ordered & 0xFFFF)
            xs = tl.load(start + sidx, mask=held & (sidx < V), other=float("-inf")).to(tl.float32)
            sz = tl.math.div_rn(xs - m, t)
        else:
            keys = _order_key(tl.math.div_rn(x - m, t), offs, BLOCK)
            # every row's top_k fits KEEP: the KEEP largest, not a sort of the row
            ordered = tl.topk(keys, KEEP) if KEEP < BLOCK else tl.sort(keys, 0, descending=True)
            sz, sidx = _unkey(ordered, BLOCK)
        k = tl.load(TOPK + row)
        k = tl.where((k > 0) & (k < V) & (k < KEEP), k, tl.where(V < KEEP, V, KEEP))
        kth = tl.max(tl.where(pos == k - 1, sz, float("-inf")), 0)
        e = tl.where((sz >= kth) & held, _exp(sz), 0.0)
        p = e / tl.sum(e, 0)
        top_p = tl.load(TOPP + row)
        top_p = tl.where(top_p < 1.0, top_p, 2.0)  # off: above any mass before a token
        drop = ((tl.cumsum(p, 0) - p) >= top_p) & (pos > 0)
        w = tl.where(drop, 0.0, e).to(tl.float64)
        u = _uniform(tl.load(SEEDS + row), tl.load(BASE + row) + GROUP)
        target = u * tl.sum(w, 0)
        last = tl.max(tl.where(w > 0, pos, 0), 0)
        pick = tl.minimum(tl.sum((tl.cumsum(w, 0) <= target).to(tl.int32), 0), last)
        token = tl.sum(tl.where(pos == pick, sidx, 0), 0).to(tl.int64)
    tl.store(OUT + row * stride_o, token)


_DRAW = FastKernel(_draw_kernel) if hasattr(_draw_kernel, "params") else _draw_kernel


def draw_codes_kernel(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      seeds: torch.Tensor, base: torch.Tensor, group: int, out: torch.Tensor | None = None,
                      top_k_cap: int = 0) -> torch.Tensor:
    """One code per row of ``logits`` ``[B, V]`` (any float dtype, rows contiguous),
    written to ``out`` (``[B]`` int64, may be a strided column); the row's uniform is
    ``row_uniforms(seeds, base + group)``. Settings are ``[B]`` contiguous vectors:
    temperature float32, top_k int64, top_p float32, seeds and base int64.
    ``top_k_cap``: every sampled row's top_k is within it (a power of two below the
    vocabulary, or 0): the draw keeps that many largest logits (``tl.topk``: 34 against 46 us a
    draw of 2,048 codes on an H100) and runs over them; 0 sorts the whole row."""
    rows, vocab = logits.shape
    if vocab > MAX_VOCAB:
        raise ValueError(f"draw_codes_kernel holds a row of at most {MAX_VOCAB} codes, got {vocab}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if out is None:
        out = torch.empty(rows, dtype=torch.long, device=logits.device)
    block = triton.next_power_of_2(vocab)
    keep = top_k_cap if 0 < top_k_cap < block else block
    if keep & (keep - 1):
        raise ValueError(f"draw_codes_kernel: top_k_cap must be a power of two, got {top_k_cap}")
    if rows:
        short = SHORT_KEYS and logits.element_size() == 2
        _DRAW[(rows,)](logits, temperature, top_k, top_p, seeds, base, out, vocab, group, logits.stride(0), out.stride(0),
                       BLOCK=block, KEEP=keep, SHORT=short, num_warps=8 if block >= 2048 else 4)
    return out
