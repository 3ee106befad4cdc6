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

from ..kernels import triton_available
from ..runners.sampling import MIN_TEMPERATURE, row_uniforms

__all__ = ["PredictorSampling", "draw_codes", "TOP_K_CAP"]

# The candidates a draw keeps at most when every sampled row's top_k fits (the released
# checkpoints sample with top_k 50).
TOP_K_CAP = 64


@dataclass
class PredictorSampling:
    """A step's per-row predictor settings on the device, and whether any row samples."""

    temperature: torch.Tensor  # [B] float32 (0: greedy)
    top_k: torch.Tensor  # [B] int64 (0: off)
    top_p: torch.Tensor  # [B] float32 (1: off)
    seeds: torch.Tensor  # [B] int64
    sampled: bool
    # Every sampled row keeps at most this many candidates (its top_k, 0 < top_k <= the
    # cap): the draw then runs over the cap's top logits, not a sort of the vocabulary
    # (the same tokens; ~10x less work per draw). 0: the whole vocabulary.
    top_k_cap: int = 0

    @property
    def kind(self) -> str:
        """Which captured variant serves these settings."""
        return "sampled-topk" if self.sampled and self.top_k_cap else "sampled" if self.sampled else "greedy"


def draw_codes(logits: torch.Tensor, s: PredictorSampling, base: torch.Tensor, group: int) -> torch.Tensor:
    """One code per row of ``logits`` ``[B, V]`` for codebook ``group``; each row's
    uniform is indexed ``base + group``. On CUDA a sampled draw is one kernel
    (:mod:`omni_async.kernels.code_draw`), the same rule."""
    if not s.sampled:
        return logits.argmax(dim=-1)
    if logits.is_cuda and triton_available(logits.device):
        from ..kernels.code_draw import draw_codes_kernel

        return draw_codes_kernel(logits, s.temperature, s.top_k, s.top_p, s.seeds, base, group, top_k_cap=s.top_k_cap)
    logits = logits.float()
    indices = base + group
    greedy = logits.argmax(dim=-1)
    vocab = logits.shape[-1]
    x = (logits - logits.max(dim=-1, keepdim=True).values) / s.temperature.clamp_min(MIN_TEMPERATURE)[:, None]
    if s.top_k_cap:
        sorted_x, order = torch.topk(x, s.top_k_cap, dim=-1)  # descending, like the sort
    else:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
    width = sorted_x.shape[-1]
    k = torch.where((s.top_k > 0) & (s.top_k < width), s.top_k, torch.full_like(s.top_k, width))
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
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_max(width - 1)
    drawn = order.gather(1, pick).squeeze(1)
    return torch.where(s.temperature > 0, drawn, greedy)
