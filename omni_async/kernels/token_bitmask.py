"""A grammar's token bitmask applied to a step's logits in one Triton kernel (CUDA).

Why: in torch the bitmask takes five kernels (shift, and, reshape-copy, cast, masked
fill), the middle ones over a ``[B, W, 32]`` int32 expansion of the mask: at 256 rows and
a 49k vocabulary, 50 MB written and read again each step. Here each program reads a
block of one row's logits and the words covering it, and writes the row's masked logits
out of place (the raw logits stay for raw logprobs): one launch, the logits read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import FastKernel

BLOCK = 2048


@triton.jit
def _token_bitmask_kernel(X, MASK, OUT, V, stride_x, stride_m, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < V
    words = tl.load(MASK + row * stride_m + offs // 32, mask=inside, other=0)
    bit = (words >> (offs % 32)) & 1
    x = tl.load(X + row * stride_x + offs, mask=inside, other=0.0)
    tl.store(OUT + row * stride_o + offs, tl.where(bit != 0, x, float("-inf")), mask=inside)


# Triton's interpreter (TRITON_INTERPRET=1, how the CPU tests run it) has no compiled
# launcher to call directly: it is launched through Triton there.
_KERNEL = FastKernel(_token_bitmask_kernel) if hasattr(_token_bitmask_kernel, "params") else _token_bitmask_kernel


def token_bitmask(x: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``x`` (``[B, V]``) with every token whose bit is clear in its row of ``bitmask``
    (``[B, ceil(V/32)]`` int32) set to -inf, as a new tensor."""
    rows, vocab = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if bitmask.stride(1) != 1:
        bitmask = bitmask.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _KERNEL[(rows, triton.cdiv(vocab, BLOCK))](x, bitmask, out, vocab, x.stride(0), bitmask.stride(0), out.stride(0),
                                              BLOCK=BLOCK)
    return out
