"""The Qwen3-Omni talker's runner: the speech runner's frame step with each request's own
text row per frame.

A Qwen3-TTS talker adds ``T(tts_pad)`` to every frame's input (its text is all in the
prompt); the Qwen3-Omni talker adds the thinker's reply, one projected token per frame,
then ``T(tts_eos)``, then ``T(tts_pad)`` (:mod:`.omni_talker`). Those "trailing" rows
travel with the request (its metadata under :data:`TRAILING_KEY`, ``[n, H]``) and are
copied, at each prefill forward of the request, to a per-slot store on the device: rows,
how many, and the position of the request's first frame input (its prompt length). A
decode step then picks row ``position - start`` of each slot, ``T(tts_pad)`` past the
count: a gather and a select on the device, no host read, whatever the loop or the
forwards per step.

A request streamed the thinker's reply as it is written (``talker_request(...,
streamed=True)``) holds no rows at submission: its rows arrive as stream chunks into its
``conditioning`` (:mod:`omni_async.core.conditioning`, start = its prompt length), whose
rule keeps each frame from running before its row is there (or the rows are closed); the
runner copies the rows that arrived since it last looked into the slot's store before
each frame, on its own thread (the chunks are only appended to on the loop's, and a row
is read only once the core has seen it arrive).

On CUDA the frames are graphed as Qwen3-TTS's are (:mod:`.graphs`): the rows' text rows
are gathered from the store before the replay and copied into the graph's input, so the
store may grow between steps.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .omni_talker import OmniTalker
from .runner import SpeechRunner

__all__ = ["OmniTalkerRunner", "TRAILING_KEY"]

# The request metadata key holding its trailing text rows (a tensor ``[n, H]``).
TRAILING_KEY = "omni_trailing_text"


class TextRowStore:
    """Per slot: up to ``capacity`` text rows, their count, and the position they start at."""

    def __init__(self, hidden: int, dtype: torch.dtype, device: torch.device, *, slots: int = 64, capacity: int = 64) -> None:
        self.rows = torch.zeros((slots, capacity, hidden), dtype=dtype, device=device)
        self.count = torch.zeros(slots, dtype=torch.long, device=device)
        self.start = torch.zeros(slots, dtype=torch.long, device=device)

    def reserve(self, slots: int) -> None:
        """Room for slots ``0 .. slots - 1`` (a slot never put reads ``T(tts_pad)``)."""
        self._fit(slots, 1)

    def put(self, slot: int, start: int, rows: torch.Tensor) -> None:
        """Slot ``slot``'s rows from position ``start`` on (its earlier rows replaced)."""
        self._fit(slot + 1, rows.shape[0])
        n = rows.shape[0]
        self.rows[slot, :n] = rows.to(self.rows.device, self.rows.dtype)
        self.count[slot:slot + 1].fill_(n)  # fills: an element assigned a host number may copy it blocking
        self.start[slot:slot + 1].fill_(start)

    def extend(self, slot: int, offset: int, rows: torch.Tensor) -> None:
        """Slot ``slot``'s rows ``offset ..`` (rows arriving while the request speaks)."""
        n = rows.shape[0]
        self._fit(slot + 1, offset + n)
        self.rows[slot, offset:offset + n] = rows.to(self.rows.device, self.rows.dtype)
        self.count[slot:slot + 1].fill_(offset + n)

    def at(self, slots: torch.Tensor, positions: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """Each row's text row for the frame whose input goes to ``positions`` ``[B]``."""
        k = positions - self.start.index_select(0, slots)
        inside = (k >= 0) & (k < self.count.index_select(0, slots))
        picked = self.rows[slots, k.clamp(0, self.rows.shape[1] - 1)]
        return torch.where(inside[:, None], picked, pad.to(picked.dtype))

    def _fit(self, slots: int, rows: int) -> None:
        have_slots, have_rows, hidden = self.rows.shape
        if slots <= have_slots and rows <= have_rows:
            return
        grown = torch.zeros((max(slots, have_slots * (2 if slots > have_slots else 1)), max(rows, have_rows), hidden),
                            dtype=self.rows.dtype, device=self.rows.device)
        grown[:have_slots, :have_rows] = self.rows
        count = torch.zeros(grown.shape[0], dtype=torch.long, device=grown.device)
        start = torch.zeros_like(count)
        count[:have_slots], start[:have_slots] = self.count, self.start
        self.rows, self.count, self.start = grown, count, start


class OmniTalkerRunner(SpeechRunner):
    frame_text_rows = True

    def __init__(self, talker: OmniTalker, kv: Any, device: torch.device, **options: Any) -> None:
        super().__init__(talker, kv, device, **options)
        self.talker = talker
        self.text = TextRowStore(talker.config.talker.hidden_size, talker.dtype, device)
        # A streamed request's rows copied to its slot so far (from its latest prefill).
        self._copied: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()

    def forward(self, forward_batch: Any) -> Any:
        """A prefill (or chunk): each request's trailing rows to its slot, then the
        speech runner's prefill."""
        batch, slots = forward_batch.batch, forward_batch.rows.slots
        none = self.text.rows.new_zeros((0, self.text.rows.shape[2]))
        for i, req in enumerate(batch.reqs):
            payload = getattr(req.data, "payload", None)
            rows = (getattr(payload, "metadata", None) or {}).get(TRAILING_KEY)
            # Without rows, every frame adds T(tts_pad) (and a reused slot forgets its last request's).
            self.text.put(int(slots[i]), len(req.prompt_ids), none if rows is None else rows)
            if req.conditioning is not None:  # streamed: its rows so far, again after a retraction
                self._copied[req] = 0
        self._copy_arrived(batch.reqs, slots)
        return super().forward(forward_batch)

    def frame_text(self, fb: Any) -> torch.Tensor:
        self.text.reserve(int(self.inputs.table.shape[0]))  # every slot the input batch holds (a warm-up's too)
        self._copy_arrived(fb.batch.reqs, fb.rows.slots)
        return self.text.at(fb.rows.slots_dev, fb.positions, self.talker.tts_pad)

    def _copy_arrived(self, reqs: Any, slots: Any) -> None:
        """Streamed requests' rows that arrived since they were last copied, to their slots.
        On CUDA the rows were made on the loop thread's (default) stream before they were
        sent, and every launch waits for that stream (``runners/base.py``), so the copy
        reads them whole; they stay referenced by the request until it ends."""
        for i, req in enumerate(reqs):
            cond = req.conditioning
            if cond is None:
                continue
            copied, arrived = self._copied.get(req, 0), cond.available
            for offset, rows in cond.pieces(cond.start + copied, arrived - copied):
                self.text.extend(int(slots[i]), copied + offset, rows)
            self._copied[req] = arrived
