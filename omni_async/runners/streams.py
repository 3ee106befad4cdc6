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

from ..errors import ConfigError


class StreamPool:
    """Free CUDA streams per device; one is taken exclusively and given back."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.device, int, int | None], list[Any]] = {}  # by (device, priority, sms)
        self._lock = threading.Lock()

    def take(self, device: torch.device | str, priority: int = 0, sms: int | None = None) -> Any:
        """``sms``: a stream whose kernels run on at most that many SMs (:func:`confined_stream`);
        None: on all of them."""
        device = torch.device(device)
        with self._lock:
            free = self._free.get((device, priority, sms))
            if free:
                return free.pop()
        stream = torch.cuda.Stream(device, priority=priority) if sms is None else confined_stream(device, sms, priority)
        stream.pool_key = (device, priority, sms)  # the key it goes back under (the device may clamp .priority)
        return stream

    def give_back(self, stream: Any) -> None:
        with self._lock:
            self._free.setdefault(getattr(stream, "pool_key", (stream.device, 0, None)), []).append(stream)

    @contextlib.contextmanager
    def borrowed(self, device: torch.device | str, sms: int | None = None) -> Iterator[Any]:
        """A side stream for a graph capture, ordered after the current stream's work
        before and before it after. ``sms``: a confined one (a graph's kernels keep the SMs
        of the stream they were captured on, wherever it is replayed)."""
        current = torch.cuda.current_stream(device)
        stream = self.take(device, 0, sms)
        stream.wait_stream(current)
        try:
            yield stream
        finally:
            current.wait_stream(stream)
            self.give_back(stream)


STREAMS = StreamPool()

# The highest priority a CUDA stream can have (clamped by the device: -5 on Hopper).
HIGH_PRIORITY = -5


def confined_stream(device: torch.device | str, sms: int, priority: int = 0) -> Any:
    """A CUDA stream whose kernels run on at most ``sms`` of the device's SMs: a stream of a
    CUDA green context (CUDA 12.8+, through ``cuda.bindings``), never destroyed: it lives as
    long as the process (the allocator records events on the stream until the very end).

    Why: a stage of large kernels (a codec's convolutions) beside a stage of many small ones
    paced by a clock (a talker's frames) holds every SM for the life of each of its blocks,
    so each small kernel waits for SMs to free, whatever its stream's priority; confined, it
    leaves the other SMs to them. A CUDA graph's kernels run on the SMs of the stream they
    were captured on (replayed elsewhere, they are not confined: measured on an H100)."""
    from cuda.bindings import driver

    def ok(result: Any) -> Any:
        err, *out = result
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA green context: {err}")
        return out[0] if len(out) == 1 else out

    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).multi_processor_count
    if not 0 < sms <= total:
        raise ConfigError(f"sms must be in 1..{total} (this device's SMs), got {sms}")
    torch.cuda.synchronize(index)  # the primary context first: the green one is made beside it
    dev = ok(driver.cuDeviceGet(index))
    whole = ok(driver.cuDeviceGetDevResource(dev, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    groups, _, _ = ok(driver.cuDevSmResourceSplitByCount(1, whole, 0, sms))
    desc = ok(driver.cuDevResourceGenerateDesc([groups[0]], 1))
    green = ok(driver.cuGreenCtxCreate(desc, dev, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
    handle = ok(driver.cuGreenCtxStreamCreate(green, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, priority))
    stream = torch.cuda.ExternalStream(int(handle), device=device)
    stream.sms = groups[0].sm.smCount  # what the device gave (rounded to its SM groups)
    return stream
