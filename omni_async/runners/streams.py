"""CUDA streams reused across stages and graph captures.

The libraries key per-stream state to a stream for the life of the process: cuBLAS keeps
a 32 MiB workspace for each stream it has run a GEMM on. A stream made per engine, or per
graph capture, grew the device's memory by that much each time (on the H200 a closed
thinker-and-talker pair left 1.1 GB allocated, a third of it per-capture side streams, and
every later engine 33 MiB more). Streams come from one pool per device instead: a stage
takes one for its life and gives it back when it closes; a capture borrows one for its
duration.

A stream's priority is part of what is pooled: a stage whose steps someone waits on at a
fixed pace (a talker's frames, played as they come) takes a high-priority stream, so the
device starts its kernels ahead of bulk work queued on other streams (a codec's calls)
whenever both are ready; priorities are clamped to the device's range (CUDA: lower is
higher, 0 the default and lowest)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch


class StreamPool:
    """Free CUDA streams per device; one is taken exclusively and given back."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.device, int], list[Any]] = {}
        self._lock = threading.Lock()

    def take(self, device: torch.device | str, priority: int = 0) -> Any:
        device = torch.device(device)
        with self._lock:
            free = self._free.get((device, priority))
            if free:
                return free.pop()
        stream = torch.cuda.Stream(device, priority=priority)
        stream.pool_priority = priority  # the key it goes back under (the device may clamp .priority)
        return stream

    def give_back(self, stream: Any) -> None:
        with self._lock:
            self._free.setdefault((stream.device, getattr(stream, "pool_priority", 0)), []).append(stream)

    @contextlib.contextmanager
    def borrowed(self, device: torch.device | str) -> Iterator[Any]:
        """A side stream for a graph capture, ordered after the current stream's work
        before and before it after."""
        current = torch.cuda.current_stream(device)
        stream = self.take(device)
        stream.wait_stream(current)
        try:
            yield stream
        finally:
            current.wait_stream(stream)
            self.give_back(stream)


STREAMS = StreamPool()

# The highest priority a CUDA stream can have (clamped by the device: -5 on Hopper).
HIGH_PRIORITY = -5
