"""The GGUF cache's float32 tensors in a smaller form that gives back the same values.

A GGUF file's weights dequantised to float32 take 4 bytes a parameter (SmolLM2's Q4_1
file: a 540 MB entry for a 98 MB file), though each holds far fewer distinct values: a
Q4_1 block is ``scale * code + minimum`` with a float16 scale and minimum and 4-bit codes,
which is the q4 block format the CPU kernels run (``kernels.cpu_quant``). So a float32
tensor is stored as the first of these forms that gives back exactly its values, checked
when the entry is written: q4 blocks (0.625 bytes a value), q8 blocks (a Q8_0 file's
matrices: 1.0625), float16, bfloat16; else as it is. Reading turns each back into float32 (a Q4_1 matrix: its own codes, scales and
minimums, so the same values the conversion made).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from ..kernels.cpu_quant import BLOCK, quantize

# Stored names: the tensor's name, then one of these suffixes (``#`` is in no parameter name).
Q4_PARTS = ("#q4.codes", "#q4.scale", "#q4.minimum")
Q8_PARTS = ("#q8.codes", "#q8.scale")
HALF = {"#f16": torch.float16, "#bf16": torch.bfloat16}


def compact(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors to store for ``named``: each float32 tensor in its smallest exact form."""
    for name, t in named:
        yield from _compact_one(name, t)


def _compact_one(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    if t.dtype != torch.float32 or not torch.isfinite(t).all():
        return [(name, t)]
    if t.dim() == 2 and t.shape[1] % BLOCK == 0 and t.numel():
        blocks = quantize(t, "q4")
        if torch.equal(q4_values(blocks.codes, blocks.scale, blocks.minimum), t):
            return [(name + Q4_PARTS[0], blocks.codes), (name + Q4_PARTS[1], blocks.scale), (name + Q4_PARTS[2], blocks.minimum)]
        blocks = quantize(t, "q8")
        if torch.equal(q8_values(blocks.codes, blocks.scale), t):
            return [(name + Q8_PARTS[0], blocks.codes), (name + Q8_PARTS[1], blocks.scale)]
    for suffix, dtype in HALF.items():
        half = t.to(dtype)
        if torch.equal(half.to(torch.float32), t):
            return [(name + suffix, half)]
    return [(name, t)]


def q4_values(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """``scale * code + minimum`` of q4 blocks as a float32 ``[N, K]``, written in place
    into one buffer (a start reads ~100M of them for SmolLM2). The same function checks
    the blocks when they are written, so what is read back is exact by construction."""
    n, kb = scale.shape
    out = torch.empty(n, kb, BLOCK, dtype=torch.float32)
    c = codes.view(n, kb, BLOCK // 2)
    out[..., : BLOCK // 2].copy_(c & 0x0F)
    out[..., BLOCK // 2 :].copy_(c >> 4)
    out.mul_(scale.to(torch.float32).unsqueeze(-1)).add_(minimum.to(torch.float32).unsqueeze(-1))
    return out.view(n, kb * BLOCK)


def q8_values(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``scale * code`` of q8 blocks (int8 codes stored as bytes) as a float32 ``[N, K]``."""
    n, kb = scale.shape
    out = codes.view(torch.int8).view(n, kb, BLOCK).to(torch.float32)
    return out.mul_(scale.to(torch.float32).unsqueeze(-1)).view(n, kb * BLOCK)


def expand(stored: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors ``compact`` was given, from what it stored (float32 again)."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    out = []
    for name, t in stored:
        base, sep, suffix = name.partition("#")
        if not sep:
            out.append((name, t))
        elif "#" + suffix in HALF:
            out.append((base, t.to(torch.float32)))
        else:
            p = parts.setdefault(base, {})
            p["#" + suffix] = t
            if all(k in p for k in Q4_PARTS):
                out.append((base, q4_values(*(p[k] for k in Q4_PARTS))))
                del parts[base]
            elif all(k in p for k in Q8_PARTS):
                out.append((base, q8_values(*(p[k] for k in Q8_PARTS))))
                del parts[base]
    if parts:
        raise ValueError(f"incomplete blocks for {sorted(parts)}")
    return out
