"""Timing a piece of device work the way a decode step replays it: captured once in a CUDA
graph, then ``replays`` replays between two events (wall time on CPU). Shared by the GPU
probes (gemm_shapes, paged_decode_speed, small_m_layer)."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch


def graph_timer(fn: Callable[[], Any], device: str) -> tuple[Callable[[int], float], Any]:
    """``(timed, out)``: ``timed(replays)`` runs ``fn`` that many times and returns the ms they
    took (a graph captured from ``fn`` on CUDA, kept alive with the timer); ``out`` is what
    ``fn`` returned in its run (on CUDA, the captured run's outputs, which each replay
    rewrites)."""
    out = fn()
    if device != "cuda":
        def timed_cpu(replays: int) -> float:
            t0 = time.perf_counter()
            for _ in range(replays):
                fn()
            return (time.perf_counter() - t0) * 1e3
        return timed_cpu, out
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()

    def timed(replays: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    timed.graph = graph  # type: ignore[attr-defined]  # kept alive with the timer
    return timed, out
