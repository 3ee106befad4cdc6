"""Masks between the forwards of one decode step: constrained rows several tokens a step.

Why: a masked row's next mask depends on the token it just sampled, which the host must
see, so a constrained row took one token a step while a free row took the plan's k (8 on
CUDA) in one fused launch; an all-constrained batch ran ~8x the steps of a free one, each
with its host cost (issue 61; bench/RESULTS.md, "the host's cost of a constrained step").
When the batch core gives masked rows several forwards
(:func:`omni_async.core.multi_step.between_steps`), the runner runs the step forward by
forward and, for each forward after the first, enqueues the forward (its input, the
token sampled before, is already on the device) before reading that token on the host:
:meth:`StepMasks.next_mask` then waits for it, advances the rows' matchers by it, has
their next masks computed into one bitmask (xgrammar's here, in one call; llguidance's on
the mask worker as one ticket, :func:`.grammar.prefetch_all`) and sends it to the device,
and the runner enqueues the forward's sampling under it. On a GPU the device runs each forward while the host computes its
masks.

A row whose grammar ends (completes or fails) at a token keeps every bit for its later
forwards: their tokens are dropped when the step is processed, as a free row's past its
stop are. The matcher accepts the row's tokens but its last during the step; the batch
records how many (``ScheduledBatch.taken_ahead``) and which rows ended
(``ended_ahead``), so processing judges those together and accepts only the rest
(``core.step_results.take_between``), queueing the next step's masks as usual. The masks are those a one-forward step would use
at the same positions, so the tokens are too (greedy, and sampled: a draw is keyed by its
generation index).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from . import xgrammar_backend
from .batch_mask import GrammarMasks, compute_rows, fill_rows, grammar_rows


class StepMasks:
    """One step's masks between its forwards: its masked rows running more than one
    forward, the host copy of the latest forward's tokens, and the batch's record of the
    tokens the matchers took (see the module)."""

    def __init__(self, batch: Any, vocab: int, device: torch.device, masks: GrammarMasks) -> None:
        steps = batch.row_steps
        # (matcher, row, the row's last forward, its first token's generation index)
        self.rows = [(m, i, steps[i] - 1, batch.sample_indices[i]) for m, i in grammar_rows(batch) if steps[i] > 1]
        # xgrammar's rows are masked here, in one call straight into the bitmask: the launching
        # thread waits for them at once, so the mask worker would add a ticket, a wake-up and a
        # copy of every row. llguidance's go to the worker, which finds their forced runs.
        self.inline: bool | None = None  # (decided at the first forward after the step's first: no wait before it)
        self.batch, self.device, self.masks = batch, device, masks
        self.words = (vocab + 31) // 32
        batch.taken_ahead, batch.ended_ahead = [0] * batch.size, set()
        self._host: Any = None
        self._event: Any = None
        # One bitmask for the step's forwards, every bit set but in the rows last written:
        # filling 256 rows of a 49k vocabulary anew took ~0.2 ms a forward. Rewritten only
        # once the forward before sampled under it (its copy to the device is done by then:
        # :meth:`next_mask` waits for that forward's tokens first).
        self._bitmask: torch.Tensor | None = None
        self._written: list[int] = []

    def send(self, tokens: torch.Tensor) -> None:
        """Start copying a forward's ``[B]`` tokens to the host (enqueued after its
        sampling: on a GPU a pinned copy and an event, nothing waits here)."""
        if self.device.type == "cpu":
            self._host, self._event = tokens, None
            return
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        self._host = host
        self._event = torch.cuda.Event()
        self._event.record()

    def next_mask(self, j: int) -> torch.Tensor:
        """The bitmask forward ``j`` (>= 1) samples under, from forward ``j - 1``'s tokens
        (:meth:`send`), which this waits for: call it once forward ``j`` is enqueued."""
        t0 = time.perf_counter()
        if self._event is not None:
            self._event.synchronize()
        tokens = self._host.tolist()
        batch = self.batch
        reqs, epochs, taken, ended = batch.reqs, batch.epochs, batch.taken_ahead, batch.ended_ahead
        later: list[Any] = []
        live: list[tuple[Any, int]] = []
        if self.inline is None:
            self.inline = xgrammar_backend.all_xgrammar([m.handle for m, *_ in self.rows])
        for m, i, last, index in self.rows:
            if j > last or i in ended:
                continue
            r = reqs[i]
            if r.finish_reason is not None or r.epoch != epochs[i]:
                continue  # ended or retracted meanwhile: its tokens are not processed
            taken[i] += 1
            if m.accept(tokens[i], prefetch=False, later=None if self.inline else later, index=index + j - 1):
                ended.add(i)
            else:
                live.append((m, i))
        if later:
            from .grammar import prefetch_all  # (grammar imports the worker; this module stays light)

            prefetch_all(later)
        on_device = self.device.type != "cpu"
        bitmask = self._bitmask
        if bitmask is None:
            bitmask = self._bitmask = torch.full((batch.size, self.words), -1, dtype=torch.int32, pin_memory=on_device)
        rows = [i for _, i in live]
        if self._written:
            gone = set(self._written).difference(rows)
            if gone:
                bitmask[sorted(gone)] = -1  # rows that no longer sample under a mask: every bit
        self._written = rows
        if self.inline and live:  # xgrammar's rows, each just advanced: none has its mask ahead, all computed here
            compute_rows([(m.handle, i) for m, i in live], bitmask)  # (fill_rows' end, without its per-row look)
            inline = len(live)
        else:
            inline = fill_rows(live, bitmask)
        self.masks.count_between(len(live), inline, time.perf_counter() - t0)
        return bitmask.to(self.device, non_blocking=True) if on_device else bitmask
