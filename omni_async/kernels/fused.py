"""Fused elementwise kernels of the decoder layer in Triton (CUDA only).

Why: at small batch a decode step is bound by kernel count, not bytes. The torch
reference spends about seven kernels on a residual add + RMSNorm, a dozen on rotary and
the KV write, three on SiLU-and-multiply; each becomes one kernel here. Each kernel
reproduces the reference's rounding points (the residual sum and the normalised value
are rounded to the model dtype before the next multiply), so results stay within bf16
rounding of :class:`~omni_async.kernels.reference.ReferenceOps`.

Imported only when Triton is present (see :func:`omni_async.kernels.triton_available`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import small_m
from .attention_block import unspecialized
from .small_m import _rne
from .launch import launcher
from .reference import ReferenceOps


@triton.jit
def _add_rms_norm_kernel(
    X, DELTA, W, SUM, Y, stride_x, stride_d, stride_s, stride_y, n_cols, eps,
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        x = x + tl.load(DELTA + row * stride_d + cols, mask=mask, other=0.0)
        tl.store(SUM + row * stride_s + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    var = tl.sum(x32 * x32, axis=0) / n_cols
    normed = (x32 * tl.math.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(W + cols, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


_ADD_RMS_NORM_LAUNCH = launcher(_add_rms_norm_kernel)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, rmsnorm(x + delta) * weight)`` over ``[T, H]`` rows in one pass."""
    rows, cols = x.shape
    out = torch.empty(rows, cols, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    total = torch.empty_like(x) if delta is not None else x
    if rows:
        _ADD_RMS_NORM_LAUNCH[(rows,)](
            x, delta if delta is not None else x, weight, total, out,
            x.stride(0), delta.stride(0) if delta is not None else 0, total.stride(0), out.stride(0),
            cols, eps, HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(cols),
        )
    return total, out


@triton.jit
def _silu_mul_kernel(GU, OUT, stride_gu, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0)
    up = tl.load(GU + row * stride_gu + n_cols + cols, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    silu = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(OUT + row * stride_o + cols, out.to(OUT.dtype.element_ty), mask=mask)


_SILU_MUL_LAUNCH = launcher(_silu_mul_kernel)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``[T, 2I]`` rows laid out ``[gate | up]``."""
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    if rows:
        _SILU_MUL_LAUNCH[(rows, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block)
    return out


@triton.jit
def _round(x, dt, EMULATE: tl.constexpr):
    """``x`` (float32) rounded to the dtype ``dt`` and back (see :func:`.small_m._rne`)."""
    return _rne(x, EMULATE).to(dt).to(tl.float32)


@triton.jit
def _head_norm(x1, x2, W, i, cols, eps, D: tl.constexpr, HAS_NORM: tl.constexpr, EMULATE: tl.constexpr):
    """A Qwen3 per-head RMSNorm of rows held as two halves ``[heads, HALF]``, rounded
    where :class:`~omni_async.models.decoder.RMSNorm` rounds (the normalised value, then
    its product with the weight, each to the activation dtype); float32 halves back."""
    if HAS_NORM:
        inv = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
        w1 = tl.load(W + i, mask=cols, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(W + D // 2 + i, mask=cols, other=0.0).to(tl.float32)[None, :]
        dt = W.dtype.element_ty
        x1 = _round(w1 * _round(x1 * inv, dt, EMULATE), dt, EMULATE)
        x2 = _round(w2 * _round(x2 * inv, dt, EMULATE), dt, EMULATE)
    return x1, x2


# ``SLOTS`` is read one scalar a token; its alignment follows the caller's layout (a row of
# a stacked array in an extend or a multi-step decode): kept out of the compile key.
@triton.jit(**unspecialized(pointers=("SLOTS",)))
def _rope_store_kernel(
    Q, K, V, COS, SIN, QOUT, KC, VC, SLOTS, QW, KW, eps,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sc_t, so_t, so_h, skc_s, skc_h, svc_s, svc_h,
    NH: tl.constexpr, NKV: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
    QHEADS: tl.constexpr, KVHEADS: tl.constexpr, HAS_NORM: tl.constexpr, EMULATE: tl.constexpr,
):
    # Two programs per token, its query heads and its KV heads, each all at once: a
    # program per (token, head) left most of its threads idle on 32-element halves
    # (4.6 us per layer at batch 256 on the H200). With HAS_NORM each head is first
    # RMS-normalised (Qwen3's q_norm / k_norm): a head is one row of the tile, so its
    # norm is a sum along the row, and ~14 torch kernels a layer become none.
    t = tl.program_id(0)
    part = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    cols = i < HALF
    cos1 = tl.load(COS + t * sc_t + i, mask=cols, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(COS + t * sc_t + HALF + i, mask=cols, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(SIN + t * sc_t + i, mask=cols, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(SIN + t * sc_t + HALF + i, mask=cols, other=0.0).to(tl.float32)[None, :]
    if part == 0:
        hq = tl.arange(0, QHEADS)[:, None]
        mq = (hq < NH) & cols[None, :]
        src = Q + t * sq_t + hq * sq_h + i[None, :]
        x1 = tl.load(src, mask=mq, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mq, other=0.0).to(tl.float32)
        x1, x2 = _head_norm(x1, x2, QW, i, cols, eps, 2 * HALF, HAS_NORM, EMULATE)
        dst = QOUT + t * so_t + hq * so_h + i[None, :]
        tl.store(dst, _rne(x1 * cos1 - x2 * sin1, EMULATE).to(QOUT.dtype.element_ty), mask=mq)
        tl.store(dst + HALF, _rne(x2 * cos2 + x1 * sin2, EMULATE).to(QOUT.dtype.element_ty), mask=mq)
    else:
        slot = tl.load(SLOTS + t)
        hk = tl.arange(0, KVHEADS)[:, None]
        mk = (hk < NKV) & cols[None, :]
        # Names of their own: Triton merges a name across branches, and the shapes differ.
        ksrc = K + t * sk_t + hk * sk_h + i[None, :]
        k1 = tl.load(ksrc, mask=mk, other=0.0).to(tl.float32)
        k2 = tl.load(ksrc + HALF, mask=mk, other=0.0).to(tl.float32)
        k1, k2 = _head_norm(k1, k2, KW, i, cols, eps, 2 * HALF, HAS_NORM, EMULATE)
        kdst = KC + slot * skc_s + hk * skc_h + i[None, :]
        tl.store(kdst, _rne(k1 * cos1 - k2 * sin1, EMULATE).to(KC.dtype.element_ty), mask=mk)
        tl.store(kdst + HALF, _rne(k2 * cos2 + k1 * sin2, EMULATE).to(KC.dtype.element_ty), mask=mk)
        vsrc = V + t * sv_t + hk * sv_h + i[None, :]
        vdst = VC + slot * svc_s + hk * svc_h + i[None, :]
        tl.store(vdst, tl.load(vsrc, mask=mk), mask=mk)
        tl.store(vdst + HALF, tl.load(vsrc + HALF, mask=mk), mask=mk)


_ROPE_STORE_LAUNCH = launcher(_rope_store_kernel)


def rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Rotate ``q`` ``[T, H, D]`` into a new tensor; rotate ``k`` and write it with ``v``
    (``[T, KVH, D]``) into the caches at ``slots``: one launch for all heads. ``norms``:
    ``(q_weight, k_weight, eps)`` of a per-head RMSNorm applied to q and k first."""
    t, nh, d = q.shape
    nkv = k.shape[1]
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and cos.stride(1) == 1
    q_out = torch.empty(t, nh, d, dtype=q.dtype, device=q.device)
    qw, kw, eps = norms if norms is not None else (q, k, 0.0)
    if t:
        _ROPE_STORE_LAUNCH[(t, 2)](
            q, k, v, cos, sin, q_out, k_cache, v_cache, slots, qw, kw, eps,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            NH=nh, NKV=nkv, HALF=d // 2, BLOCK=triton.next_power_of_2(d // 2),
            QHEADS=triton.next_power_of_2(nh), KVHEADS=triton.next_power_of_2(nkv), HAS_NORM=norms is not None,
            EMULATE=small_m._INTERPRETED and q.dtype == torch.bfloat16,
        )
    return q_out


# The interpreter (TRITON_INTERPRET=1, how the CPU tests run kernels) has no libdevice;
# on the GPU libdevice's cos and sin are CUDA's cosf and sinf, which torch's cos and sin
# call: the same float32 values, so the same tables once rounded.
if small_m._INTERPRETED:
    @triton.jit
    def _cos(x):
        return tl.cos(x)

    @triton.jit
    def _sin(x):
        return tl.sin(x)
else:
    @triton.jit
    def _cos(x):
        return libdevice.cos(x)

    @triton.jit
    def _sin(x):
        return libdevice.sin(x)


@triton.jit(**unspecialized(pointers=("POS",)))  # a row of the extend's stacked inputs
def _rope_table_kernel(POS, INV, COS, SIN, stride_c, stride_s, HALF: tl.constexpr, BLOCK: tl.constexpr,
                       EMULATE: tl.constexpr):
    # One program a token: its angles (position times each inverse frequency, float32, as
    # the reference multiplies), their cosines and sines rounded to the table's dtype and
    # written to both halves of its row (the reference's cat). Seven torch kernels a step.
    t = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    cols = i < HALF
    pos = tl.load(POS + t).to(tl.float32)
    freqs = pos * tl.load(INV + i, mask=cols, other=0.0).to(tl.float32)
    c = _rne(_cos(freqs), EMULATE).to(COS.dtype.element_ty)
    s = _rne(_sin(freqs), EMULATE).to(SIN.dtype.element_ty)
    tl.store(COS + t * stride_c + i, c, mask=cols)
    tl.store(COS + t * stride_c + HALF + i, c, mask=cols)
    tl.store(SIN + t * stride_s + i, s, mask=cols)
    tl.store(SIN + t * stride_s + HALF + i, s, mask=cols)


_ROPE_TABLE_LAUNCH = launcher(_rope_table_kernel)


def rope_table(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`ReferenceOps.rope_table` in one launch: ``(cos, sin)`` ``[T, D]``."""
    t, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty(t, 2 * half, dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if t:
        _ROPE_TABLE_LAUNCH[(t,)](positions, inv_freq, cos, sin, cos.stride(0), sin.stride(0), HALF=half,
                                 BLOCK=triton.next_power_of_2(half),
                                 EMULATE=small_m._INTERPRETED and dtype == torch.bfloat16)
    return cos, sin


class FusedOps(ReferenceOps):
    """The decoder's elementwise ops through the kernels above (same interface as
    :class:`~omni_async.kernels.reference.ReferenceOps`). Rotated k is written straight to
    the cache and not returned: the CUDA attention kernels read it there. A step of few
    rows runs each GEMM fused with the op before it (:mod:`.small_m`, which decides when);
    otherwise the op's kernel here, then the module's GEMM."""

    name = "triton"

    def add_norm(self, x, delta, norm):
        return add_rms_norm(x, delta, norm.weight, norm.eps)

    def rope_table(self, positions, inv_freq, dtype):
        if positions.dim() != 1 or inv_freq.device != positions.device:
            return super().rope_table(positions, inv_freq, dtype)
        return rope_table(positions, inv_freq, dtype)

    def silu_mul(self, gate_up):
        return silu_mul(gate_up)

    def rope_store(self, q, k, v, cos, sin, kv, layer, slots, q_norm=None, k_norm=None):
        norms = None
        if q_norm is not None:
            if not (q_norm.weight.dtype == k_norm.weight.dtype == q.dtype and q_norm.eps == k_norm.eps):
                q, k = q_norm(q), k_norm(k)  # the kernel rounds to one dtype: the torch norms
            else:
                norms = (q_norm.weight, k_norm.weight, float(q_norm.eps))
        return rope_store(q, k, v, cos, sin, kv.k[layer], kv.v[layer], slots, norms), None

    def add_norm_linear(self, x, delta, norm, linear):
        weights = small_m.small_m_weights(x, linear, delta, norm.weight)
        if weights is None:
            return super().add_norm_linear(x, delta, norm, linear)
        return small_m.add_norm_linear(x, delta, norm.weight, norm.eps, *weights)

    def silu_mul_linear(self, gate_up, linear):
        weights = small_m.small_m_weights(gate_up, linear)
        if weights is None:
            return super().silu_mul_linear(gate_up, linear)
        return small_m.silu_mul_linear(gate_up, *weights)

    def linear(self, x, linear):
        weights = small_m.small_m_weights(x, linear)
        if weights is None:
            return linear(x)
        return small_m.linear(x, *weights)
