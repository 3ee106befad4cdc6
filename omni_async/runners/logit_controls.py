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
    # The entries travel as (row, token, value) triples in one asynchronous copy each and
    # are scattered on the device: a blocking copy (``torch.tensor(..., device=)``,
    # ``.to(device)``) waits for every step queued on the stream, holding the launching
    # thread for the step in flight, and a dense ``[B, V]`` table is megabytes a step.
    c = LogitControls(presence=_to(device, [p.presence_penalty for p in params]),
                      frequency=_to(device, [p.frequency_penalty for p in params]))
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        entries = [(i, t, 1.0) for i, (p, ids) in enumerate(zip(params, outputs))
                   if p.presence_penalty or p.frequency_penalty for t in ids if 0 <= t < vocab]
        c.counts = _scatter(len(params), vocab, entries, device)
    if any(p.logit_bias for p in params):
        entries = [(i, t, float(b)) for i, p in enumerate(params) for t, b in p.logit_bias.items() if 0 <= t < vocab]
        c.bias = _scatter(len(params), vocab, entries, device)
    return c


def _to(device: torch.device, values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)


def _scatter(rows: int, vocab: int, entries: list[tuple[int, int, float]], device: torch.device) -> torch.Tensor:
    """A ``[rows, vocab]`` float32 table on ``device``: the sum of each entry's value at
    its (row, token)."""
    table = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
    if entries:
        idx = torch.tensor([(r, t) for r, t, _ in entries], dtype=torch.long).to(device, non_blocking=True)
        table.index_put_((idx[:, 0], idx[:, 1]), _to(device, [v for _, _, v in entries]), accumulate=True)
    return table
