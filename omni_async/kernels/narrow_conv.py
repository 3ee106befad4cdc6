"""A convolution with very few output channels over long rows, in one Triton pass (CUDA).

Why: the vocoder's last convolution (96 channels to one, kernel 7) runs over every output
sample (64 streams of 8 frames are ~1M samples a call), and cuDNN has no tensor-core
kernel for one output channel: its generic implicit GEMM took 5.9 ms of a 24 ms codec call
on the H100 (24.5% of the call), padded to 8 output channels no faster. The arithmetic is
a 672-term dot product per sample; the input is read once. Each program holds a block of
one row's output samples in float32 and walks the input channels in blocks, adding each
kernel tap's shifted window (read from L1/L2 after its first touch).

Input ``[B, C, T + (K-1)*dilation]`` contiguous along T (a causal convolution's past and
chunk in one buffer), weight ``[O, C, K]``, output ``[B, O, T]`` in the input's dtype, the
bias added in float32 and the sum rounded once (cuDNN rounds its float32 accumulator once
too; the order of the sum differs, so results agree within the dtype's rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["narrow_conv1d"]


@triton.jit
def _narrow_conv_kernel(X, W, BIAS, OUT, C, T, T_IN, O, DIL, HAS_BIAS: tl.constexpr, K: tl.constexpr,
                        CB: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # (batch, output channel)
    b = row // O
    o = row % O
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < T
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    x_row = X + b.to(tl.int64) * C * T_IN
    for c0 in range(0, C, CB):
        chans = c0 + tl.arange(0, CB)
        held = chans < C
        for j in tl.static_range(K):
            w = tl.load(W + (o * C + chans) * K + j, mask=held, other=0.0).to(tl.float32)
            xs = tl.load(x_row + chans[:, None].to(tl.int64) * T_IN + (offs + j * DIL)[None, :],
                         mask=held[:, None] & inside[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w[:, None] * xs, axis=0)
    if HAS_BIAS:
        acc += tl.load(BIAS + o).to(tl.float32)
    tl.store(OUT + row.to(tl.int64) * T + offs, acc.to(OUT.dtype.element_ty), mask=inside)


def narrow_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int = 1) -> torch.Tensor:
    """``F.conv1d(x, weight, bias, dilation=dilation)`` (no padding, stride 1, one group) for
    a weight of few output channels; ``x`` ``[B, C, T_in]``."""
    b, c, t_in = x.shape
    o, c_w, k = weight.shape
    if c_w != c:
        raise ValueError(f"narrow_conv1d: input has {c} channels, weight {c_w}")
    t = t_in - (k - 1) * dilation
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty((b, o, max(t, 0)), dtype=x.dtype, device=x.device)
    if t > 0 and b:
        block = min(512, triton.next_power_of_2(max(t, 16)))
        cb = min(32, triton.next_power_of_2(c))
        _narrow_conv_kernel[(b * o, triton.cdiv(t, block))](x, weight, weight if bias is None else bias, out, c, t, t_in, o,
                                                           dilation, HAS_BIAS=bias is not None, K=k, CB=cb, BLOCK=block,
                                                           num_warps=4)
    return out
