"""The vocoder's SnakeBeta activation in one pass (CUDA).

Why: ``x + sin(x e^alpha)^2 / (e^beta + 1e-9)`` as torch ops is five passes over the
activation (a product, a sine, a square, a scale, a sum), and the codec's late stages are
the largest tensors it makes (a frame is 1,920 samples of 96 channels at the last stage:
64 streams of 8 frames are ~94M values), so the activation's memory traffic, not its
arithmetic, sets its time. One program reads a block of a channel's samples once, computes
in float32 and writes once. Input rows are ``[B, C, T]`` with ``T`` contiguous (any batch
and channel strides: a slice along ``T`` is read in place); the output is contiguous; a
program's channel is ``row % C`` (its two parameters are loaded once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["snake_beta"]


@triton.jit
def _snake_kernel(X, ALPHA, BETA, Y, C, T, stride_b, stride_c, OUT_T, OFFSET, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    block = tl.program_id(1)
    channel = row % C
    alpha = tl.exp(tl.load(ALPHA + channel).to(tl.float32))
    inv_beta = 1.0 / (tl.exp(tl.load(BETA + channel).to(tl.float32)) + 1e-9)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    inside = offs < T
    src = (row // C).to(tl.int64) * stride_b + channel.to(tl.int64) * stride_c
    x = tl.load(X + src + offs, mask=inside, other=0.0).to(tl.float32)
    s = tl.sin(x * alpha)
    tl.store(Y + row.to(tl.int64) * OUT_T + OFFSET + offs, (x + inv_beta * s * s).to(Y.dtype.element_ty), mask=inside)


def snake_beta(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, past: torch.Tensor | None = None) -> torch.Tensor:
    """SnakeBeta of ``x`` ``[B, C, T]`` with per-channel log-parameters ``alpha``, ``beta``
    ``[C]``; a new contiguous tensor of ``x``'s dtype. ``x`` may be a slice along ``T`` (a
    transposed convolution's output with its overlap cut): read in place, not copied.
    ``past`` ``[B, C, P]``: the result is ``cat([past, snake(x)], -1)``, the activation
    written after the past in one buffer (what a causal convolution reads next), without
    the concatenation's pass over it."""
    b, c, t = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    lead = 0 if past is None else past.shape[-1]
    y = torch.empty((b, c, lead + t), dtype=x.dtype, device=x.device)
    if lead:
        y[..., :lead].copy_(past)
    if x.numel():
        block = min(1024, triton.next_power_of_2(max(t, 16)))
        _snake_kernel[(b * c, triton.cdiv(t, block))](x, alpha, beta, y, c, t, x.stride(0), x.stride(1), lead + t, lead,
                                                     BLOCK=block, num_warps=4 if block >= 512 else 2)
    return y
