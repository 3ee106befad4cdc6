"""Temperature-only sampling (and greedy rows beside it) in three Triton launches (CUDA).

Why: the torch sampler spends a dozen kernels on a row that only has a temperature: a
float32 copy of the logits, two maxima, ``nan_to_num``, the scaling, softmax, a float64
copy and a float64 scan over the whole vocabulary, a search and an argmax. On the H200
at NV256's shape (vocabulary 151,936, 64-256 rows) that was ~0.9 ms per forward, a third
of the GPU's time, against ~0.04 ms for greedy's argmax. Here three launches read each
row's logits about twice: the maximum (and the greedy token) of each part of the row, the
mass of each block of the vocabulary, then, one program per row, the block where the
row's target falls, read again and scanned. Parts split a row across programs so that a
small batch still keeps every SM reading.

What it computes is :func:`omni_async.runners.sampling.sample` for such rows: the token
whose cumulative probability under ``softmax((x - max) / T)`` first exceeds ``u`` times
the total, ``u`` from ``row_uniforms(seed, index)`` (the same hash, computed here).
Rows with ``T == 0`` take the first index of their maximum. A row with a NaN, or with
every logit at -inf, gets ``ok = False`` and token 0. Logits are clamped to the finite
float32 range first, as ``nan_to_num`` does in the torch path.

Precision: each token's weight ``exp((x - max) / T)`` is computed in float32 with the
same rounded subtraction and division as torch (IEEE division, CUDA's ``expf``), then
summed and scanned in float64; the torch path divides each weight by the float32 sum and
scans the rounded probabilities in float64. A uniform scale of all weights cancels (the
target is ``u`` times the row's own total), so the two cumulative distributions differ
only by that division's rounding, at most 2**-23 of each weight and so of any prefix of
the distribution (in practice the roundings cancel: the gap grows like the square root
of the vocabulary). A token can differ only where the target falls inside that gap at
one boundary: on random logits over Qwen2's vocabulary about one draw in 10**5 at the
flattest, fewer on peaked distributions; the tests count the draws that fall near a
boundary and compare every other one.

Capturable in a CUDA graph: fixed grid, outputs allocated by shape, no host reads.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .attention_block import unspecialized
from .launch import FastKernel

BLOCK = 4096
_FLT_MAX = tl.constexpr(3.4028234663852886e38)
_MASK32 = tl.constexpr(0xFFFFFFFF)

# The interpreter (TRITON_INTERPRET=1, how the CPU tests run kernels) has no libdevice;
# its ``tl.exp`` is numpy's, as precise. On the GPU ``tl.exp`` is the approximate ``ex2``;
# libdevice's is CUDA's ``expf``, as torch's softmax uses.
if os.environ.get("TRITON_INTERPRET") == "1":
    @triton.jit
    def _exp(x):
        return tl.exp(x)
else:
    @triton.jit
    def _exp(x):
        return libdevice.exp(x)


@triton.jit
def _mix32(h):
    """:func:`omni_async.runners.sampling._mix32` in int64, as there."""
    h = h & _MASK32
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _MASK32
    h = h ^ (h >> 15)
    h = (h * 0x5BD1E995) & _MASK32
    return h ^ (h >> 16)


@triton.jit
def _uniform(seed, index):
    """:func:`omni_async.runners.sampling.row_uniforms` for one row, in float64."""
    h = _mix32(seed & _MASK32)
    h = _mix32(h ^ ((seed >> 32) & _MASK32) ^ 0x3C6EF372)
    h = _mix32(h ^ (index & _MASK32))
    h = _mix32(h + ((index >> 32) & _MASK32))
    return (h.to(tl.float64) + 0.5) * (1.0 / 4294967296.0)


@triton.jit
def _weights(base, start, V, m, t, BLOCK: tl.constexpr):
    """One block's unnormalised probabilities ``exp((clamp(x) - m) / t)`` as float64,
    0 past the vocabulary."""
    offs = start + tl.arange(0, BLOCK)
    inside = offs < V
    x = tl.load(base + offs, mask=inside, other=0.0).to(tl.float32)
    x = tl.minimum(tl.maximum(x, -_FLT_MAX), _FLT_MAX)
    e = _exp(tl.math.div_rn(x - m, t))
    return tl.where(inside, e, 0.0).to(tl.float64)


@triton.jit(**unspecialized(ints=("V", "PER", "S", "stride_x")))
def _max_kernel(X, PMAX, PIDX, PNAN, V, PER, S, stride_x, BLOCK: tl.constexpr):
    """Pass 1, program (row, part): the maximum of its blocks (NaN aside), the first index
    holding it, and whether they hold a NaN."""
    row, part = tl.program_id(0), tl.program_id(1)
    base = X + row.to(tl.int64) * stride_x
    lanes = tl.arange(0, BLOCK)
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.full((), 0, tl.int32)
    nan = tl.full((), 0, tl.int32)
    for b in range(part * PER, part * PER + PER):
        offs = b * BLOCK + lanes
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        is_nan = x != x
        nan = tl.maximum(nan, tl.max(is_nan.to(tl.int32), 0))
        x = tl.where(is_nan, float("-inf"), x)
        bm = tl.max(x, 0)
        bi = tl.min(tl.where(x == bm, offs, V), 0)
        take = bm > best
        best_i = tl.where(take, bi, best_i)
        best = tl.where(take, bm, best)
    at = row * S + part
    tl.store(PMAX + at, best)
    tl.store(PIDX + at, best_i)
    tl.store(PNAN + at, nan)


@triton.jit
def _row_max(PMAX, PIDX, PNAN, row, S, SP: tl.constexpr):
    """The row's maximum, the first index holding it, and whether it is admissible (no
    NaN, not everything -inf), from its parts' results."""
    parts = tl.arange(0, SP)
    inside = parts < S
    pmax = tl.load(PMAX + row * S + parts, mask=inside, other=float("-inf"))
    best = tl.max(pmax, 0)
    best_i = tl.min(tl.where(inside & (pmax == best), tl.load(PIDX + row * S + parts, mask=inside, other=0), 2**31 - 1), 0)
    nan = tl.max(tl.load(PNAN + row * S + parts, mask=inside, other=0), 0)
    return best, best_i, (nan == 0) & (best > float("-inf"))


@triton.jit(**unspecialized(ints=("V", "PER", "S", "NB", "stride_x", "stride_t"), pointers=("TEMP",)))
def _mass_kernel(X, TEMP, PMAX, PIDX, PNAN, MASS, V, PER, S, NB, stride_x, stride_t,
                 BLOCK: tl.constexpr, SP: tl.constexpr):
    """Pass 2, program (row, part) of a sampled row: the mass of each of its blocks."""
    row, part = tl.program_id(0), tl.program_id(1)
    temp = tl.load(TEMP + row * stride_t)
    if temp != 0:
        base = X + row.to(tl.int64) * stride_x
        best, _, _ = _row_max(PMAX, PIDX, PNAN, row, S, SP)
        m = tl.minimum(best, _FLT_MAX)
        t = tl.maximum(temp, 1e-30)
        for b in range(part * PER, tl.minimum(part * PER + PER, NB)):
            tl.store(MASS + row * NB + b, tl.sum(_weights(base, b * BLOCK, V, m, t, BLOCK), 0))


# The per-row settings are read one scalar a row, from columns or rows of the caller's
# arrays (a multi-step decode's sample indices: a row of a ``[k, B]`` array): their
# alignment is kept out of the compile key.
@triton.jit(**unspecialized(ints=("V", "S", "NB", "stride_x", "stride_t", "stride_s", "stride_i"),
                            pointers=("TEMP", "SEEDS", "INDICES")))
def _pick_kernel(X, TEMP, SEEDS, INDICES, PMAX, PIDX, PNAN, MASS, TOKENS, OK, V, S, NB, stride_x, stride_t,
                 stride_s, stride_i, BLOCK: tl.constexpr, SP: tl.constexpr, NBP: tl.constexpr):
    """Pass 3, one program per row: the greedy token, or the block where the cumulative
    mass first exceeds the row's target and the token in it (that block read again)."""
    row = tl.program_id(0)
    best, best_i, ok = _row_max(PMAX, PIDX, PNAN, row, S, SP)
    token = best_i.to(tl.int64)
    temp = tl.load(TEMP + row * stride_t)
    if temp != 0:
        base = X + row.to(tl.int64) * stride_x
        m = tl.minimum(best, _FLT_MAX)
        t = tl.maximum(temp, 1e-30)
        blocks = tl.arange(0, NBP)
        mass = tl.load(MASS + row * NB + blocks, mask=blocks < NB, other=0.0)
        u = _uniform(tl.load(SEEDS + row * stride_s), tl.load(INDICES + row * stride_i))
        target = u * tl.sum(mass, 0)
        c = tl.minimum(tl.sum((tl.cumsum(mass, 0) <= target).to(tl.int32), 0), NB - 1)
        before = tl.sum(tl.where(blocks < c, mass, 0.0), 0)
        w = _weights(base, c * BLOCK, V, m, t, BLOCK)
        k = tl.sum((before + tl.cumsum(w, 0) <= target).to(tl.int32), 0)
        # Scan and sum round differently: a target at the very top of the block takes its
        # last token with mass (or the maximum where the block has none).
        last = tl.max(tl.where(w > 0, tl.arange(0, BLOCK), -1), 0)
        k = tl.minimum(k, last)
        token = tl.where(last >= 0, c.to(tl.int64) * BLOCK + k, best_i.to(tl.int64))
    tl.store(TOKENS + row, tl.where(ok, token, 0))
    tl.store(OK + row, ok)


def _fast(fn):
    # The interpreter has no compiled launcher to call directly: launched through Triton there.
    return FastKernel(fn) if hasattr(fn, "params") else fn


_MAX, _MASS, _PICK = _fast(_max_kernel), _fast(_mass_kernel), _fast(_pick_kernel)
launches = 0  # calls of sample_temperature (graph replays are not calls)
captured = 0  # those made while a CUDA graph was being captured


@functools.cache
def _programs_wanted(device: torch.device) -> int:
    """Programs per pass that fill the device: a few per SM."""
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def sample_temperature(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, indices: torch.Tensor,
    parts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (``[B]`` int64) and ``ok`` (``[B]`` bool) for ``logits`` (``[B, V]``, any
    float dtype, last dimension contiguous): rows with ``temperature`` 0 greedy, the
    others drawn at ``temperature`` with ``row_uniforms(seeds, indices)``; the vectors may
    be strided columns. Each row's vocabulary is split into ``parts`` (default: enough
    programs to fill the device) for the two full passes: a small batch still reads its
    logits on every SM."""
    global launches, captured
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    # The hash takes 64-bit seeds and indices, as ``row_uniforms`` does.
    seeds, indices = seeds.to(torch.long), indices.to(torch.long)
    temperature = temperature.to(torch.float32)
    device = logits.device
    launches += 1
    captured += logits.is_cuda and torch.cuda.is_current_stream_capturing()
    block = min(BLOCK, triton.next_power_of_2(vocab))
    nb = triton.cdiv(vocab, block)
    per = triton.cdiv(nb, max(1, min(nb, parts or triton.cdiv(_programs_wanted(device), rows))))
    s = triton.cdiv(nb, per)  # parts of ``per`` blocks each (the last may have fewer)
    pmax = torch.empty((rows, s), dtype=torch.float32, device=device)
    pidx = torch.empty((rows, s), dtype=torch.int32, device=device)
    pnan = torch.empty((rows, s), dtype=torch.int32, device=device)
    mass = torch.empty((rows, nb), dtype=torch.float64, device=device)
    tokens = torch.empty(rows, dtype=torch.long, device=device)
    ok = torch.empty(rows, dtype=torch.bool, device=device)
    warps = 8 if block >= 2048 else 4
    # Compile-time sizes that follow the vocabulary alone (never the batch), and the
    # integers above kept out of the compile key: one compile per kernel, dtype and
    # vocabulary, not one per batch size met mid-run (3.4 s of first-token time on the H200).
    sp = triton.next_power_of_2(nb)
    _MAX[(rows, s)](logits, pmax, pidx, pnan, vocab, per, s, logits.stride(0), BLOCK=block, num_warps=warps)
    _MASS[(rows, s)](logits, temperature, pmax, pidx, pnan, mass, vocab, per, s, nb, logits.stride(0),
                     temperature.stride(0), BLOCK=block, SP=sp, num_warps=warps)
    _PICK[(rows,)](logits, temperature, seeds, indices, pmax, pidx, pnan, mass, tokens, ok, vocab, s, nb,
                   logits.stride(0), temperature.stride(0), seeds.stride(0), indices.stride(0),
                   BLOCK=block, SP=sp, NBP=triton.next_power_of_2(nb), num_warps=warps)
    return tokens, ok
