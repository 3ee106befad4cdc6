"""Per-slot state of OpenAI's penalties and logit bias, beside ``InputBatch``'s tables.

Penalty coefficients live in a small ``[S, 2]`` table (host mirror and device copy). The
generated-token counts (``[S, V]`` float32, for both penalties) and the dense biases
(``[S, V]`` float32) exist on the device only once some request needs them, so engines
whose requests never use these controls pay nothing. Counts are rebuilt from the
request's output at each join (a retraction starts a new slot) and grow on the device as
tokens are sampled, before the host has seen them, like the repetition penalty's mask.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .logit_controls import LogitControls

PRESENCE, FREQUENCY = range(2)


class SlotControls:
    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.device = device
        self.coef = np.zeros((0, 2), dtype=np.float32)
        self.active = np.zeros(0, dtype=bool)  # a slot whose request has any of these controls
        self.coef_dev = torch.zeros((0, 2), dtype=torch.float32, device=device)
        self.counts: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self._reset_pending()

    def _reset_pending(self) -> None:
        self._dirty: list[int] = []
        self._resets: list[int] = []
        self._counts: tuple[list[int], list[int]] = ([], [])
        self._biases: tuple[list[int], list[int], list[float]] = ([], [], [])

    def grow(self, slots: int) -> None:
        old = self.coef.shape[0]
        if slots <= old:
            return
        self.coef = np.concatenate([self.coef, np.zeros((slots - old, 2), dtype=np.float32)])
        self.active = np.concatenate([self.active, np.zeros(slots - old, dtype=bool)])
        self.coef_dev = _grown(self.coef_dev, slots)
        self.counts = None if self.counts is None else _grown(self.counts, slots)
        self.bias = None if self.bias is None else _grown(self.bias, slots)

    def join(self, slot: int, sampling: Any, output_ids: list[int]) -> None:
        """A request takes ``slot``: its coefficients, counts and biases (pushed at flush)."""
        penalised = bool(sampling.presence_penalty or sampling.frequency_penalty)
        self.coef[slot] = (sampling.presence_penalty, sampling.frequency_penalty)
        was_active, self.active[slot] = self.active[slot], sampling.has_logit_controls
        if was_active or self.active[slot]:
            self._dirty.append(slot)
            self._resets.append(slot)
        if penalised and self.counts is None:
            self.counts = torch.zeros(len(self.coef), self.vocab, dtype=torch.float32, device=self.device)
        if sampling.logit_bias and self.bias is None:
            self.bias = torch.zeros(len(self.coef), self.vocab, dtype=torch.float32, device=self.device)
        if penalised:
            ids = [t for t in output_ids if 0 <= t < self.vocab]
            self._counts[0].extend([slot] * len(ids))
            self._counts[1].extend(ids)
        for token, value in sampling.logit_bias.items():
            if token < self.vocab:
                self._biases[0].append(slot)
                self._biases[1].append(token)
                self._biases[2].append(value)

    def flush(self) -> None:
        dev = self.device
        if self._resets:
            resets = torch.tensor(self._resets, dtype=torch.long).to(dev, non_blocking=True)
            for table in (self.counts, self.bias):
                if table is not None:
                    table.index_fill_(0, resets, 0.0)
        rows, cols = self._counts
        if rows and self.counts is not None:
            rc = torch.tensor([rows, cols], dtype=torch.long).to(dev, non_blocking=True)
            self.counts.index_put_((rc[0], rc[1]), torch.ones(len(rows), device=dev), accumulate=True)
        rows, cols, vals = self._biases
        if rows and self.bias is not None:
            rc = torch.tensor([rows, cols], dtype=torch.long).to(dev, non_blocking=True)
            self.bias[rc[0], rc[1]] = torch.tensor(vals, dtype=torch.float32).to(dev, non_blocking=True)
        if self._dirty:
            idx = torch.tensor(self._dirty, dtype=torch.long).to(dev, non_blocking=True)
            self.coef_dev.index_copy_(0, idx, torch.from_numpy(self.coef[self._dirty]).to(dev, non_blocking=True))
        self._reset_pending()

    def publish(self, slots_dev: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count each slot's newly sampled token."""
        if self.counts is not None:
            self.counts.index_put_((slots_dev, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)

    def any_active(self, slots: np.ndarray) -> bool:
        return bool(self.active[slots].any())

    def gather(self, slots: np.ndarray, slots_dev: torch.Tensor) -> LogitControls | None:
        """The step's rows' controls on the device; None when none of them has any."""
        if not self.any_active(slots):
            return None
        coef = self.coef_dev.index_select(0, slots_dev)
        c = LogitControls(presence=coef[:, PRESENCE], frequency=coef[:, FREQUENCY])
        if self.counts is not None and self.coef[slots].any():
            c.counts = self.counts.index_select(0, slots_dev)
        if self.bias is not None:
            c.bias = self.bias.index_select(0, slots_dev)
        return c


def _grown(t: torch.Tensor, rows: int) -> torch.Tensor:
    out = torch.zeros((rows,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    return out
