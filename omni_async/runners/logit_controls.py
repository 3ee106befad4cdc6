"""The per-row logit edits that are not filters: OpenAI's penalties, logit bias, grammar masks.

Kept out of :mod:`omni_async.runners.sampling`'s main pass so that every sampler (eager, a graph)
applies them through the same two functions, on the device, for the whole batch:

- :func:`apply_logit_controls`: OpenAI's ``presence_penalty`` and ``frequency_penalty``
  over the tokens the row generated (``logit -= presence * (count > 0) + frequency * count``),
  then ``logit_bias`` added. They follow the repetition penalty, as in vLLM.
- :func:`apply_token_bitmask`: a grammar's allowed tokens, one bit per token (32 per int32
  word, least significant bit first, the layout grammar libraries fill); a row without a
  grammar has every bit set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..config import SamplingParams
from ..kernels import triton_available


@dataclass
class LogitControls:
    """Penalty coefficients ``[B]``, generated-token counts ``[B, V]`` (None when no row
    has a penalty) and dense biases ``[B, V]`` (None when no row has a bias)."""

    presence: torch.Tensor
    frequency: torch.Tensor
    counts: torch.Tensor | None = None
    bias: torch.Tensor | None = None


def apply_logit_controls(x: torch.Tensor, c: LogitControls) -> torch.Tensor:
    """``x`` with the penalties and biases applied (out of place)."""
    if c.counts is not None:
        counts = c.counts.to(x.dtype)
        x = x - c.presence[:, None] * (counts > 0).to(x.dtype) - c.frequency[:, None] * counts
    if c.bias is not None:
        x = x + c.bias
    return x


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(x: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``x`` with every token whose bit is clear in its row of ``bitmask`` (``[B, W]``
    int32) set to -inf (out of place). On CUDA one Triton kernel
    (:mod:`omni_async.kernels.token_bitmask`); elsewhere the same in torch ops."""
    if x.is_cuda and x.dim() == 2 and triton_available(x.device):
        from ..kernels.token_bitmask import token_bitmask

        return token_bitmask(x, bitmask)
    shifts = _SHIFTS.get(x.device)
    if shifts is None:
        shifts = _SHIFTS[x.device] = torch.arange(32, dtype=torch.int32, device=x.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, : x.shape[-1]].to(torch.bool)
    return x.masked_fill(~allowed, float("-inf"))


def controls_from_rows(params: Sequence[SamplingParams], outputs: Sequence[Sequence[int]], vocab: int,
                       device: torch.device) -> LogitControls | None:
    """``LogitControls`` from per-row Python values; None when no row has any."""
    if not any(p.has_logit_controls for p in params):
        return None
    # Built on the host, then one asynchronous copy each: a blocking copy to the device
    # (``torch.tensor(..., device=)``, ``.to(device)``) waits for every step queued on the
    # stream, holding the launching thread for the step in flight.
    c = LogitControls(
        presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32).to(device, non_blocking=True),
        frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32).to(device, non_blocking=True),
    )
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        counts = torch.zeros(len(params), vocab, dtype=torch.float32)
        for i, (p, ids) in enumerate(zip(params, outputs)):
            if (p.presence_penalty or p.frequency_penalty) and len(ids):
                t = torch.tensor([t for t in ids if 0 <= t < vocab], dtype=torch.long)
                counts[i].index_add_(0, t, torch.ones(len(t)))
        c.counts = counts.to(device, non_blocking=True)
    if any(p.logit_bias for p in params):
        bias = torch.zeros(len(params), vocab, dtype=torch.float32)
        for i, p in enumerate(params):
            for t, b in p.logit_bias.items():
                if t < vocab:
                    bias[i, t] = b
        c.bias = bias.to(device, non_blocking=True)
    return c
