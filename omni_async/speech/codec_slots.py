"""Every codec stream's carried state as rows of preallocated tensors, by slot.

Why rows and not a ``CodecState`` per stream: stacking per-stream pasts with ``torch.cat``
and slicing them back is a few kernels per stateful layer per call, Python per stream per
layer, and its tensors change address every call, so no CUDA graph can hold it. Here each
stateful layer's past is one tensor ``[capacity + scratch_rows, *past_shape]`` and the next
frame's index one ``[capacity + scratch_rows]`` tensor; a call for the streams at ``slots
[B]`` gathers their rows (``index_select``), runs the decoder's forward and scatters the
new pasts and positions back (``index_copy_``): fixed shapes, fixed addresses, no host reads, the same
function eager and inside a captured graph.

The last rows are scratch rows (``scratch_rows``, one by default): a graphed call pads its
batch up to a bucket with one, so padding rows read and write only a scratch row, never a
stream's; callers that may run at the same time (the codec stage's two lanes) pad with
rows of their own (``scratch_row``). A stream takes a slot at ``open`` (its rows zeroed: a
new stream's past reads as the one-shot decode's zero padding) and gives it back at
``close``; ``open`` is ``reserve`` (which slot: host bookkeeping only, never growing) and
``reset`` (the zeroing: device work only), for a caller that decides on one thread and
writes the device on another. When every slot is taken ``open`` doubles the store; the
tensors are new ones, so graphs captured over the old ones are stale (``generation``
tells a holder of graphs), and a grow must never run while a call on the store is in
flight or being captured.
"""

from __future__ import annotations

import heapq

import torch

from ..errors import InvalidRequestError
from .codec_base import StreamDecoder

__all__ = ["CodecSlots"]


class CodecSlots:
    """The pasts of up to ``capacity`` streams (growing by doubling) for ``decoder``."""

    def __init__(self, decoder: StreamDecoder, capacity: int = 8, *, scratch_rows: int = 1) -> None:
        if capacity < 1 or scratch_rows < 1:
            raise ValueError("CodecSlots: capacity and scratch_rows must be at least 1")
        self.decoder = decoder
        self.device = decoder.device
        self.samples_per_frame = decoder.samples_per_frame
        self.capacity = capacity
        self.scratch_rows = scratch_rows
        #: Bumped at every grow: graphs captured over the store's tensors are stale after one.
        self.generation = 0
        with torch.inference_mode():
            self.pasts = decoder.empty_past(capacity + scratch_rows)
            self.positions = torch.zeros(capacity + scratch_rows, dtype=torch.long, device=self.device)
        self._free = list(range(capacity))
        self._taken: set[int] = set()

    # ------------------------------------------------------------ slots

    @property
    def scratch(self) -> int:
        """The padding rows' slot (the first scratch row; it moves when the store grows)."""
        return self.capacity

    def scratch_row(self, index: int) -> int:
        """Scratch row ``index`` (0: ``scratch``), for a caller padding beside another."""
        if not 0 <= index < self.scratch_rows:
            raise ValueError(f"CodecSlots: scratch row {index} of {self.scratch_rows}")
        return self.capacity + index

    def in_use(self) -> int:
        return len(self._taken)

    def bytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.pasts) + self.positions.element_size()

    def open(self) -> int:
        """A slot for a new stream (the lowest free one), its rows zeroed; grows when full.
        Never while a call on the store is in flight."""
        slot = self.reserve()
        if slot is None:
            self._grow()
            slot = self.reserve()
            assert slot is not None
        self.reset(slot)
        return slot

    def reserve(self) -> int | None:
        """The lowest free slot, now taken, or None when every slot is (this never grows the
        store). Host bookkeeping only: its rows are stale until ``reset``."""
        if not self._free:
            return None
        slot = heapq.heappop(self._free)
        self._taken.add(slot)
        return slot

    def reset(self, slot: int) -> None:
        """Zero a taken slot's rows (device work only, on the current stream): the past of
        a stream that has decoded nothing yet."""
        with torch.inference_mode():
            for store in self.pasts:
                store[slot].zero_()
            self.positions[slot:slot + 1].fill_(0)

    def close(self, slot: int) -> None:
        """Give ``slot`` back (its rows are zeroed when it is next opened)."""
        if slot not in self._taken:
            raise InvalidRequestError(f"codec slot {slot} is not open")
        self._taken.remove(slot)
        heapq.heappush(self._free, slot)

    def _grow(self) -> None:
        old, cap = self.capacity, self.capacity * 2
        with torch.inference_mode():
            pasts = self.decoder.empty_past(cap + self.scratch_rows)
            for new, store in zip(pasts, self.pasts):
                new[:old].copy_(store[:old])
            positions = torch.zeros(cap + self.scratch_rows, dtype=torch.long, device=self.device)
            positions[:old].copy_(self.positions[:old])
        self.pasts, self.positions, self.capacity = pasts, positions, cap
        for slot in range(old, cap):
            heapq.heappush(self._free, slot)
        self.generation += 1

    def rows(self, slot: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Copies of one slot's pasts (one per stateful layer) and next-frame index: to look
        at a stream's state, never used by a call."""
        return [store[slot].clone() for store in self.pasts], self.positions[slot].clone()

    # ------------------------------------------------------------ calls

    def step(self, codes: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``codes [B, F, 16]`` of the streams at ``slots [B]`` (a long tensor on the device;
        distinct but for the scratch slot) -> float32 PCM ``[B, F * samples_per_frame]``;
        their rows advance past the chunk. A stream's first call gives its decoder's
        ``leading_samples`` first (zeros, not audio: its reader drops them). Device work
        only: graph-safe."""
        past = [store.index_select(0, slots) for store in self.pasts]
        position = self.positions.index_select(0, slots)
        pcm, after = self.decoder(codes, past, position)
        for store, new in zip(self.pasts, after):
            store.index_copy_(0, slots, new)
        self.positions.index_copy_(0, slots, position + codes.shape[1])
        return pcm

    def run(self, codes: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """The eager call: ``codes [B, F, 16]`` (any integer dtype) for the open ``slots``."""
        self.check(codes, slots)
        if not slots:
            return torch.zeros((0, codes.shape[1] * self.samples_per_frame), device=self.device)
        with torch.inference_mode():
            index = host_slots(slots, self.device).to(self.device, non_blocking=True)
            return self.step(codes.to(self.device, torch.long), index)

    def check(self, codes: torch.Tensor, slots: list[int]) -> None:
        """A call's arguments, on the host: a chunk per open slot, each slot once."""
        n = self.decoder.num_quantizers
        if not isinstance(codes, torch.Tensor) or codes.dim() != 3 or codes.shape[-1] != n:
            got = tuple(codes.shape) if isinstance(codes, torch.Tensor) else type(codes).__name__
            raise InvalidRequestError(f"codec slots: codes must be [B, F, {n}], got {got}")
        if codes.dtype.is_floating_point or codes.dtype == torch.bool or codes.dtype.is_complex:
            raise InvalidRequestError(f"codec slots: codes must be integers, got {codes.dtype}")
        if codes.shape[0] != len(slots):
            raise InvalidRequestError(f"codec slots: {codes.shape[0]} chunks for {len(slots)} slots")
        if len(set(slots)) != len(slots):
            raise InvalidRequestError("codec slots: a slot appears twice in one call")
        closed = [s for s in slots if s not in self._taken]
        if closed:
            raise InvalidRequestError(f"codec slots: slot {closed[0]} is not open")


def host_slots(slots: list[int], device: torch.device) -> torch.Tensor:
    """Slot indices on the host, pinned when they go to a CUDA device (so the copy there
    is asynchronous and the host does not wait for the device)."""
    host = torch.tensor(slots, dtype=torch.long)
    return host.pin_memory() if device.type == "cuda" else host
