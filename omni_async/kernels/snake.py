"""The vocoder's elementwise work in single passes (CUDA): SnakeBeta, and a residual unit's
sum with its convolution's bias.

Why: ``x + sin(x e^alpha)^2 / (e^beta + 1e-9)`` as torch ops is five passes over the
activation (a product, a sine, a square, a scale, a sum), and the codec's late stages are
the largest tensors it makes (a frame is 1,920 samples of 96 channels at the last stage:
64 streams of 8 frames are ~94M values), so the activation's memory traffic, not its
arithmetic, sets its time. One program reads a block of a channel's samples once, computes
in float32 and writes once. Input rows are ``[B, C, T]`` with ``T`` contiguous (any batch
and channel strides: a slice along ``T`` is read in place); the output is contiguous; a
program's channel is ``row % C`` (its per-channel values are loaded once).

A convolution's bias is a pass of its own in torch (cuDNN's convolution does not add it:
a broadcast add over the whole output, ~18% of the codec's kernel time at 64 streams, H100),
so the vocoder's residual units run their convolutions without it and add it here: the
first convolution's bias before the second SnakeBeta (``bias=``), the second's in the
residual sum (:func:`residual_sum`). Each rounds where torch rounds (the biased value to
the tensor's dtype before it is used), so results stay within the fused activation's
float32-versus-torch rounding of the unfused path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["residual_sum", "snake_beta"]


@triton.jit
def _snake_kernel(X, ALPHA, BETA, BIAS, Y, C, T, stride_b, stride_c, OUT_T, OFFSET, HAS_BIAS: tl.constexpr,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0)
    block = tl.program_id(1)
    channel = row % C
    alpha = tl.exp(tl.load(ALPHA + channel).to(tl.float32))
    inv_beta = 1.0 / (tl.exp(tl.load(BETA + channel).to(tl.float32)) + 1e-9)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    inside = offs < T
    src = (row // C).to(tl.int64) * stride_b + channel.to(tl.int64) * stride_c
    x = tl.load(X + src + offs, mask=inside, other=0.0)
    if HAS_BIAS:  # the convolution's output plus its bias, rounded as torch's add rounds it
        x = (x.to(tl.float32) + tl.load(BIAS + channel).to(tl.float32)).to(X.dtype.element_ty)
    x = x.to(tl.float32)
    s = tl.sin(x * alpha)
    tl.store(Y + row.to(tl.int64) * OUT_T + OFFSET + offs, (x + inv_beta * s * s).to(Y.dtype.element_ty), mask=inside)


@triton.jit
def _residual_kernel(X, Y, BIAS, OUT, C, T, stride_b, stride_c, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < T
    at = row.to(tl.int64) * T + offs
    y = tl.load(Y + at, mask=inside, other=0.0).to(tl.float32) + tl.load(BIAS + row % C).to(tl.float32)
    y = y.to(OUT.dtype.element_ty).to(tl.float32)
    src = (row // C).to(tl.int64) * stride_b + (row % C).to(tl.int64) * stride_c
    x = tl.load(X + src + offs, mask=inside, other=0.0).to(tl.float32)
    tl.store(OUT + at, (x + y).to(OUT.dtype.element_ty), mask=inside)


def _block(t: int) -> int:
    return min(1024, triton.next_power_of_2(max(t, 16)))


def snake_beta(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, past: torch.Tensor | None = None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """SnakeBeta of ``x`` ``[B, C, T]`` with per-channel log-parameters ``alpha``, ``beta``
    ``[C]``; a new contiguous tensor of ``x``'s dtype. ``x`` may be a slice along ``T`` (a
    transposed convolution's output with its overlap cut): read in place, not copied.
    ``past`` ``[B, C, P]``: the result is ``cat([past, snake(x)], -1)``, the activation
    written after the past in one buffer (what a causal convolution reads next), without
    the concatenation's pass over it. ``bias`` ``[C]``: the activation of ``x + bias`` (a
    convolution's output whose bias was left out)."""
    b, c, t = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    lead = 0 if past is None else past.shape[-1]
    y = torch.empty((b, c, lead + t), dtype=x.dtype, device=x.device)
    if lead:
        y[..., :lead].copy_(past)
    if x.numel():
        block = _block(t)
        _snake_kernel[(b * c, triton.cdiv(t, block))](x, alpha, beta, alpha if bias is None else bias, y, c, t,
                                                     x.stride(0), x.stride(1), lead + t, lead, HAS_BIAS=bias is not None,
                                                     BLOCK=block, num_warps=4 if block >= 512 else 2)
    return y


def residual_sum(x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``x + (y + bias)`` over ``[B, C, T]`` (``bias`` ``[C]``), in one pass: a residual unit's
    input plus its last convolution's output and that convolution's bias; a contiguous
    result. ``x`` may be a slice along ``T`` (the first unit's input is a transposed
    convolution's cut output): read in place."""
    b, c, t = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    y = y.contiguous()
    out = torch.empty((b, c, t), dtype=x.dtype, device=x.device)
    if x.numel():
        block = _block(t)
        _residual_kernel[(b * c, triton.cdiv(t, block))](x, y, bias, out, c, t, x.stride(0), x.stride(1), BLOCK=block,
                                                        num_warps=4 if block >= 512 else 2)
    return out
