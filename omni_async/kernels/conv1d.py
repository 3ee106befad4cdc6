"""The vocoder's convolutions as one implicit GEMM each (CUDA, Triton).

Why: the speech codec is the bound at 64 streams (bench/RESULTS.md: the talker writes frames
faster than the codec decodes them beside it), and its work is convolutions: 4.8 of its 5.0
GFLOP a frame, 73% in the residual units' kernel-7 dilated convolutions over 96 to 768
channels. A graphed call of 64 streams x 8 frames (2.5 TFLOP) took 24 ms on an H100, about
a tenth of its bfloat16 tensor-core rate; cuDNN ran at least one of them (dilation 9, 384
channels) with a generic kernel without tensor cores.

Here ``y[b, o, t] = sum_{c, j} w[o, c, j] x[b, c, t + j d]`` (no padding: the caller's
input holds the past) is a GEMM whose reduction runs over ``(c, j)`` pairs: a program
computes a tile of ``BLOCK_O`` output channels by ``BLOCK_T`` samples, loading the weight
tile as it lies (``[O, C*K]`` is contiguous, so a reduction block is a contiguous slice of
each row) and the input tile by gathering ``x[c, t + j d]`` (contiguous along ``t``, so each
of the block's rows is a coalesced load; the taps' overlapping reads hit the caches). One
pass over the input, one write of the output, bias added in float32 before the one
rounding. Whether it beats cuDNN per shape is for the GPU to say
(``tools/codec_convs.py``); the codec uses it only where :data:`omni_async.speech.codec_layers.TRITON_CONV` asks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["conv1d", "TILE"]

# (output channels, samples, reduction, warps, stages) of a program's tile: module-level
# so a probe can sweep them (``tools/codec_convs.py --tiles``; read at each call).
TILE = (64, 128, 32, 4, 3)


@triton.jit
def _conv1d_kernel(X, W, BIAS, Y, O, T_OUT, R, sxb, sxc, sxt, syb, syo, syt,
                   K: tl.constexpr, DIL: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK_O: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_o = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    o_in = o < O
    t_in = t < T_OUT
    acc = tl.zeros((BLOCK_O, BLOCK_T), dtype=tl.float32)
    x_base = X + b * sxb
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_in = r < R
        c = r // K
        j = r - c * K
        w = tl.load(W + o[:, None].to(tl.int64) * R + r[None, :], mask=o_in[:, None] & r_in[None, :], other=0.0)
        at = c[:, None].to(tl.int64) * sxc + (t[None, :] + j[:, None] * DIL).to(tl.int64) * sxt
        x = tl.load(x_base + at, mask=r_in[:, None] & t_in[None, :], other=0.0)
        acc = tl.dot(w, x, acc)
    if HAS_BIAS:
        acc += tl.load(BIAS + o, mask=o_in, other=0.0).to(tl.float32)[:, None]
    out = Y + b * syb + o[:, None].to(tl.int64) * syo + t[None, :].to(tl.int64) * syt
    tl.store(out, acc.to(Y.dtype.element_ty), mask=o_in[:, None] & t_in[None, :])


def conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, dilation: int = 1) -> torch.Tensor:
    """``F.conv1d(x, weight, bias, dilation=dilation)`` for ``x [B, C, T]`` (any strides)
    and a contiguous ``weight [O, C, K]`` (groups 1, no padding): ``[B, O, T - (K-1) d]``,
    accumulated in float32, in ``x``'s dtype."""
    b, c, t_in = x.shape
    o, c_w, k = weight.shape
    if c_w != c:
        raise ValueError(f"conv1d: input has {c} channels, the weight {c_w}")
    t_out = t_in - (k - 1) * dilation
    if t_out < 1:
        raise ValueError(f"conv1d: {t_in} samples are fewer than the kernel's reach {(k - 1) * dilation + 1}")
    weight = weight.contiguous()
    y = torch.empty(b, o, t_out, dtype=x.dtype, device=x.device)
    block_o, block_t, block_r, warps, stages = TILE
    grid = (triton.cdiv(t_out, block_t), triton.cdiv(o, block_o), b)
    _conv1d_kernel[grid](
        x, weight, bias if bias is not None else weight, y, o, t_out, c * k,
        x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2),
        K=k, DIL=dilation, HAS_BIAS=bias is not None,
        BLOCK_O=block_o, BLOCK_T=block_t, BLOCK_R=block_r, num_warps=warps, num_stages=stages,
    )
    return y
