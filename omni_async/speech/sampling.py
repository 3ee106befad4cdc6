"""The code predictor's draws: one function for the eager step and the captured one, so
a graphed frame gives the codes of an eager frame.

Per row: greedy where its temperature is 0, else temperature, top-k, top-p (transformers'
rule) and an inverse-CDF draw with the row's counter-based uniform (the shared sampler's
hash of its seed and an index: here the talker position times 16 plus the codebook), so
a row's codes do not depend on the batch it runs in. Fixed shapes and no host reads: the
caller says, from host values, whether any row samples at all (``sampled``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runners.sampling import MIN_TEMPERATURE, row_uniforms

__all__ = ["PredictorSampling", "draw_codes"]


@dataclass
class PredictorSampling:
    """A step's per-row predictor settings on the device, and whether any row samples."""

    temperature: torch.Tensor  # [B] float32 (0: greedy)
    top_k: torch.Tensor  # [B] int64 (0: off)
    top_p: torch.Tensor  # [B] float32 (1: off)
    seeds: torch.Tensor  # [B] int64
    sampled: bool


def draw_codes(logits: torch.Tensor, s: PredictorSampling, indices: torch.Tensor) -> torch.Tensor:
    """One code per row of ``logits`` ``[B, V]`` (float32)."""
    greedy = logits.argmax(dim=-1)
    if not s.sampled:
        return greedy
    vocab = logits.shape[-1]
    x = (logits - logits.max(dim=-1, keepdim=True).values) / s.temperature.clamp_min(MIN_TEMPERATURE)[:, None]
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    k = torch.where((s.top_k > 0) & (s.top_k < vocab), s.top_k, torch.full_like(s.top_k, vocab))
    kth = sorted_x.gather(1, (k - 1)[:, None])
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    probs = sorted_x.softmax(-1)
    before = probs.cumsum(-1) - probs
    top_p = s.top_p[:, None]
    drop = (before >= top_p) & (top_p < 1)
    drop[:, 0] = False
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    u = row_uniforms(s.seeds, indices)
    cdf = sorted_x.softmax(-1).to(torch.float64).cumsum(-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_max(vocab - 1)
    drawn = order.gather(1, pick).squeeze(1)
    return torch.where(s.temperature > 0, drawn, greedy)
