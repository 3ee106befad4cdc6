"""The Qwen3-TTS codec's front end: the split RVQ's dequantisation, codes to vectors.

Per frame, with no past: codebook 0 (semantic) and codebooks 1.. (acoustic) are each looked
up, summed and projected on their own, and the two added. Module and parameter names follow
the checkpoint's ``decoder.quantizer.*`` tensors. (Qwen3-Omni's Code2Wav has no quantizer:
it averages one embedding table's rows instead.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .codec_config import CodecConfig


class Codebook(nn.Module):
    """``_codebook``: a vector is ``embedding_sum / clamp(cluster_usage, 1e-5)`` (the running sums
    of the codebook's training), divided after the lookup so only the looked-up rows are."""

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        usage = F.embedding(codes, self.cluster_usage[:, None]).clamp(min=1e-5)
        return F.embedding(codes, self.embedding_sum) / usage


class _VectorQuantizer(nn.Module):
    """``vq.layers.i``: holds one codebook (the projection in and out is the group's)."""

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self._codebook = Codebook(size, dim)


class _QuantizerCodebooks(nn.Module):
    def __init__(self, count: int, size: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_VectorQuantizer(size, dim) for _ in range(count)])


class QuantizerGroup(nn.Module):
    """``rvq_first`` / ``rvq_rest``: the group's codebook vectors summed, then a 1x1 conv out
    (codebook_dim / 2 -> codebook_dim, no bias)."""

    def __init__(self, count: int, config: CodecConfig) -> None:
        super().__init__()
        half = config.codebook_dim // 2
        self.vq = _QuantizerCodebooks(count, config.codebook_size, half)
        self.output_proj = nn.Conv1d(half, config.codebook_dim, 1, bias=False)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes [B, T, count]`` -> ``[B, codebook_dim, T]``."""
        total = None
        for i, layer in enumerate(self.vq.layers):
            vectors = layer._codebook(codes[..., i])
            total = vectors if total is None else total + vectors
        return self.output_proj(total.transpose(1, 2))


class Quantizer(nn.Module):
    """The split RVQ's decode: codebook 0 (semantic) and codebooks 1.. (acoustic) each summed and
    projected on their own, the two added. Per frame: no past."""

    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        self.rvq_first = QuantizerGroup(1, config)
        self.rvq_rest = QuantizerGroup(config.num_quantizers - 1, config)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return self.rvq_first(codes[..., :1]) + self.rvq_rest(codes[..., 1:])
