"""Linear layers over block-quantised weights, read directly by C++ CPU kernels.

Why: a batch-1 decode step on a small CPU streams every weight once per token, so its
speed is the weights' size over the memory bandwidth. SmolLM2-135M in float32 is 0.54 GB
a token; in 4-bit blocks it is 0.085 GB. The weights stay in blocks of 32 values along
the input dimension and are unpacked in registers:

- ``q4``: 4-bit unsigned codes with a float16 scale and minimum per block
  (``w = d * q + m``, llama.cpp's Q4_1 arrangement, 0.625 bytes a weight). A GGUF file
  stored in Q4_1 comes back from its float32 dequantisation block for block (the same
  codes, and the file's own float16 scale and minimum), so nothing is lost against the
  file.
- ``q8``: signed 8-bit codes with a float16 scale per block (``w = d * q``, Q8_0's).

The scales are float16 as in the file, not float32: a batch-1 step reads every byte of
them, and float32 scales made a token stream 16% more bytes than llama.cpp's (111.5 MB
against 96.4 MB for SmolLM2-135M).

Each activation row is quantised per block of 32 to int8 with its own scale (and its
exact float sum kept for the ``m`` term), then every block's dot product is an integer
multiply-add (AVX2 ``maddubs``) scaled once. Per-row, per-block scales keep a request's
result independent of what else is in the batch. Built with the system compiler like
the other CPU kernels (:mod:`.cpu_build`); a portable C++ loop serves CPUs without AVX2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


BLOCK = 32
FORMATS = ("q4", "q8")




def load() -> Any:
    """The compiled CPU kernels (:mod:`.cpu_kernels`; built on first call); ConfigError
    when they cannot be built."""
    from .cpu_kernels import load as load_all

    return load_all()


@dataclass
class BlockWeights:
    """One weight matrix ``[N, K]`` in blocks of 32 along K: ``codes`` (uint8; q4 packs
    element j and j+16 of a block into one byte's low and high nibble), per-block
    ``scale`` and, for q4, ``minimum`` (float16 ``[N, K/32]``)."""

    format: str
    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None
    bias: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        extra = 0 if self.minimum is None else self.minimum.numel() * self.minimum.element_size()
        return self.codes.numel() + self.scale.numel() * self.scale.element_size() + extra

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix these blocks stand for (tests, and the reference)."""
        n = self.codes.shape[0]
        if self.format == "q4":
            c = self.codes.view(n, -1, 16)
            q = torch.cat([c & 0x0F, c >> 4], dim=-1).to(torch.float32)
            return (q * self.scale.float()[..., None] + self.minimum.float()[..., None]).reshape(n, -1)
        q = self.codes.view(torch.int8).view(n, -1, BLOCK).to(torch.float32)
        return (q * self.scale.float()[..., None]).reshape(n, -1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).to(torch.float32).contiguous()
        out = load().linear_blocks(rows, self.codes, self.scale, self.minimum, self.bias)
        return out.view(*shape[:-1], out.shape[-1]).to(x.dtype)


def quantize(weight: torch.Tensor, format: str, bias: torch.Tensor | None = None) -> BlockWeights:
    """``weight`` ``[N, K]`` (K a multiple of 32) in blocks. q4 takes each block's min and
    max as llama.cpp's Q4_1 does (``d = (max - min) / 15``), so a Q4_1 source comes back
    with its own codes. The codes are taken against the float16 scale and minimum the
    kernels read."""
    if format not in FORMATS:
        raise ValueError(f"unknown block format {format!r}")
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"input dimension {k} is not a multiple of {BLOCK}")
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    b = None if bias is None else bias.detach().to(torch.float32).contiguous()
    if format == "q8":
        scale = (blocks.abs().amax(dim=-1) / 127.0).to(torch.float16)
        d = scale.float()
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = torch.round(blocks * inv[..., None]).clamp(-127, 127).to(torch.int8)
        return BlockWeights("q8", q.reshape(n, k).view(torch.uint8).contiguous(), scale.contiguous(), None, b)
    lo, hi = blocks.amin(dim=-1), blocks.amax(dim=-1)
    scale, lo = ((hi - lo) / 15.0).to(torch.float16), lo.to(torch.float16)
    d = scale.float()
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round((blocks - lo.float()[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return BlockWeights("q4", packed.reshape(n, k // 2).contiguous(), scale.contiguous(), lo.contiguous(), b)
