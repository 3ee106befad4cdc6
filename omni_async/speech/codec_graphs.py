"""CUDA graphs of the codec's slot call: one per (batch bucket, chunk frames).

Eagerly a codec call is launch-bound: hundreds of small kernels (the RVQ's 16 lookups, 29
stateful layers each gathering and scattering its past, the transformer, the vocoder's
convolutions and activations) and the Python around each, for a few milliseconds of
arithmetic. Captured, a call is one replay. A graph reads static inputs (the codes
``[bucket, frames, 16]`` and the slots ``[bucket]``) and the slot store's tensors
(:class:`~omni_async.speech.codec_slots.CodecSlots`), and writes a static PCM output; a
call copies its streams' codes and slots in, pads the rest of the bucket with zero codes
and a scratch row (so padding rows touch only that row), and replays. Two holders of graphs
that may replay at the same time (the codec stage's lanes) each hold their own static
inputs, outputs and memory pool (one ``CodecGraphs`` each) and pad with a scratch row of
their own (``scratch_row``).

Buckets: batches of 1, 2, 4, ... 128 streams and chunks of 1, 2, 4, 8, 16 or 32 frames
(the codec stage asks only for those lengths). A graph is captured on the first call that needs
it, or up front: ``capture`` takes a set, ``capture_within`` every bucket a round's frame
budget can use (the codec stage does this when it is built, so no request waits on a capture
and its device-wide synchronize); a larger batch runs as several calls, a chunk
length outside the set eagerly. When the store grows its tensors are new, so every graph
is dropped and captured again on its next use.

Without ``capture`` (a CPU device, or graphs turned off) a call takes the same padded path
eagerly: the bucketing and padding logic, testable without a GPU.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..runners.streams import STREAMS
from .codec_slots import CodecSlots, host_slots

__all__ = ["CallShapes", "CodecGraphs", "BATCH_BUCKETS", "FRAME_BUCKETS", "padded_batches"]

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
FRAME_BUCKETS = (1, 2, 4, 8, 16, 32)


def padded_batches(streams: int, batches: tuple[int, ...] = BATCH_BUCKETS) -> list[int]:
    """The graphed calls' batches a call of ``streams`` runs as: whole largest buckets, then
    the remainder padded to the smallest bucket that holds it."""
    whole, rest = divmod(streams, batches[-1])
    return [batches[-1]] * whole + ([next(b for b in batches if b >= rest)] if rest else [])


class CallShapes:
    """A lane's calls by (streams, frames), counted on any device (bounded: at most 128 x 6
    keys in use): what a graphed call pads to its bucket, and how many calls a round makes,
    are what the codec's device time depends on besides its frames."""

    def __init__(self, batches: tuple[int, ...] = BATCH_BUCKETS) -> None:
        self.batches = tuple(sorted(batches))
        self.calls: dict[tuple[int, int], int] = {}

    def count(self, streams: int, frames: int) -> None:
        self.calls[(streams, frames)] = self.calls.get((streams, frames), 0) + 1

    def count_groups(self, calls: Any) -> None:
        """``calls``: (streams, frames) pairs, one per call."""
        for streams, frames in calls:
            self.count(streams, frames)

    def summary(self) -> dict[str, Any]:
        """Calls by ``"streams x frames"``; the frames of the calls' chunks (``frames_wanted``:
        an ended stream's zero padding counts, the stage counts it apart) against those a
        graphed call computes (its batch padded to a bucket; a batch past the largest bucket
        as several calls)."""
        wanted = computed = 0
        for (n, f), calls in self.calls.items():
            wanted += n * f * calls
            computed += sum(padded_batches(n, self.batches)) * f * calls
        return {"calls": sum(self.calls.values()), "by_shape": {f"{n}x{f}": c for (n, f), c in sorted(self.calls.items())},
                "frames_wanted": wanted, "frames_computed": computed,
                "useful_share": round(wanted / computed, 4) if computed else None}


class CodecGraphs:
    def __init__(self, slots: CodecSlots, *, capture: bool | None = None, batches: tuple[int, ...] = BATCH_BUCKETS,
                 frames: tuple[int, ...] = FRAME_BUCKETS, scratch_row: int = 0, sms: int | None = None) -> None:
        self.slots = slots
        self.sms = sms  # captured on a stream confined to that many SMs: their replays keep to them
        self.scratch_row = scratch_row
        slots.scratch_row(scratch_row)  # one the store has
        self.device = slots.device
        self.capture_graphs = self.device.type == "cuda" if capture is None else capture
        if self.capture_graphs and self.device.type != "cuda":
            raise ValueError("CodecGraphs: capturing graphs needs a CUDA device")
        self.batches, self.frames = tuple(sorted(batches)), tuple(sorted(frames))
        self.max_batch = self.batches[-1]
        with torch.inference_mode():
            self.codes = {f: torch.zeros((self.max_batch, f, slots.decoder.num_quantizers), dtype=torch.long,
                                         device=self.device) for f in self.frames}
            self.slot_index = torch.full((self.max_batch,), self.scratch, dtype=torch.long, device=self.device)
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self.pool: Any = None
        self._generation = slots.generation
        self.replays = 0
        self.eager_calls = 0
        self.captures = 0
        self.capture_seconds = 0.0

    @property
    def scratch(self) -> int:
        """The slot this holder's padding rows read and write (it moves when the store grows)."""
        return self.slots.scratch_row(self.scratch_row)

    def bucket_for(self, batch: int) -> int:
        return next(b for b in self.batches if b >= batch)

    def complete(self) -> bool:
        """Every bucket captured over the store's current tensors (always, without capture):
        a call replays, never captures."""
        if not self.capture_graphs:
            return True
        return self._generation == self.slots.generation and all((b, f) in self.graphs for b in self.batches for f in self.frames)

    # ------------------------------------------------------------ calls

    def run(self, codes: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """``codes [B, F, 16]`` for the open ``slots`` -> float32 PCM ``[B, F * 1920]``.
        With graphs, the result is the graph's static output, and graphs share one memory
        pool: enqueue its copy (``.to("cpu", non_blocking=True)``, ``.clone()``) before the
        next call, which may overwrite it."""
        self.slots.check(codes, slots)
        frames = codes.shape[1]
        if not slots or frames not in self.codes:
            self.eager_calls += 1
            return self.slots.run(codes, slots)
        if len(slots) > self.max_batch:
            pieces = [self.run(codes[i:i + self.max_batch], slots[i:i + self.max_batch]).clone()
                      for i in range(0, len(slots), self.max_batch)]
            return torch.cat(pieces)
        with torch.inference_mode():
            return self._padded(codes, slots)

    def _padded(self, codes: torch.Tensor, slots: list[int]) -> torch.Tensor:
        n, frames = len(slots), codes.shape[1]
        bucket = self.bucket_for(n)
        self._inputs(codes, slots, bucket)
        if not self.capture_graphs:
            self.eager_calls += 1
            return self.slots.step(self.codes[frames][:bucket], self.slot_index[:bucket])[:n]
        if self._generation != self.slots.generation:  # the store grew: its tensors are new
            self.graphs.clear()
            self.pool = None
            self._generation = self.slots.generation
        entry = self.graphs.get((bucket, frames))
        if entry is None:
            entry = self._capture(bucket, frames)
            self._inputs(codes, slots, bucket)  # the warm-up ran on scratch inputs
        graph, out = entry
        graph.replay()
        self.replays += 1
        return out[:n]

    def _inputs(self, codes: torch.Tensor, slots: list[int], bucket: int) -> None:
        """The static inputs of a call: its codes and slots, then zero codes on the scratch
        slot up to the bucket."""
        n, frames = len(slots), codes.shape[1]
        static = self.codes[frames]
        static[:n].copy_(codes, non_blocking=True)
        self.slot_index[:n].copy_(host_slots(slots, self.device), non_blocking=True)
        if bucket > n:
            static[n:bucket].zero_()
            self.slot_index[n:bucket] = self.scratch

    # ------------------------------------------------------------ capture

    def capture(self, batches: tuple[int, ...] | None = None, frames: tuple[int, ...] | None = None) -> None:
        """Capture the graphs of these buckets now (all by default), the largest batch first
        so the shared memory pool is sized by it. Only while no call is in flight."""
        if not self.capture_graphs:
            return
        with torch.inference_mode():
            if self._generation != self.slots.generation:
                self.graphs.clear()
                self.pool = None
                self._generation = self.slots.generation
            for b in sorted(batches or self.batches, reverse=True):
                for f in frames or self.frames:
                    if (b, f) not in self.graphs:
                        self._capture(b, f)

    def capture_within(self, frames_budget: int, max_frames: int) -> None:
        """Capture now every bucket a call of at most ``frames_budget`` frames can use (a
        round under that budget makes only such calls; n streams of f frames pad to
        ``bucket_for(n)``), chunks up to ``max_frames``; a chunk alone past the budget gets
        its batch of one."""
        pairs = [(b, f) for b in self.batches for f in self.frames
                 if f <= max_frames and b <= self.bucket_for(min(max(1, frames_budget // f), self.max_batch))]
        if not self.capture_graphs:
            return
        with torch.inference_mode():
            for b, f in sorted(pairs, key=lambda bf: -bf[0] * bf[1]):  # the largest first: it sizes the pool
                if self._generation != self.slots.generation:
                    self.graphs.clear()
                    self.pool = None
                    self._generation = self.slots.generation
                if (b, f) not in self.graphs:
                    self._capture(b, f)

    def _capture(self, bucket: int, frames: int) -> tuple[Any, torch.Tensor]:
        """Warm up and capture one bucket's call over scratch inputs: every row on the
        scratch slot, so the warm-up runs write no stream's state."""
        start = time.perf_counter()
        codes, index = self.codes[frames][:bucket], self.slot_index[:bucket]
        codes.zero_()
        index.fill_(self.scratch)
        with STREAMS.borrowed(self.device, self.sms) as stream, torch.cuda.stream(stream):
            for _ in range(2):
                self.slots.step(codes, index)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                out = self.slots.step(codes, index)
            if self.pool is None:
                self.pool = graph.pool()
        torch.cuda.synchronize(self.device)
        self.graphs[(bucket, frames)] = (graph, out)
        self.captures += 1
        self.capture_seconds += time.perf_counter() - start
        return graph, out
