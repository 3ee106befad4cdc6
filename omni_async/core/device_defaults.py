"""Limits a user who passes only ``device=`` gets: sized to the device, as pure functions.

Why: a fixed ``max_running_requests=64`` left an H200 running a quarter of a 256-request
burst while the rest queued (NV256: 13.9k output tok/s by default against 37.0k with 256
running, bench/RESULTS.md). On CUDA the KV cache, not a constant, is what bounds how many
requests can decode together, and the CUDA graphs' batch buckets are what a decode step
replays, so the running limit is the largest bucket whose requests the KV can hold at a
typical length, within ``[CUDA_MIN_RUNNING, the largest bucket]``. The prefill budget
and the decode-step tiers (``core.multi_step.AUTO_TIERS``) are the H200 measurements'.
CPU keeps ``CPU_MAX_RUNNING``: its step time grows with the batch, so more rows only
delay each token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..config import CUDA_PREFILL_BUDGET
from .multi_step import AUTO_TIERS

CPU_MAX_RUNNING = 64
CUDA_MIN_RUNNING = 64
# The KV each running request is budgeted (prompt plus answer, tokens): a request of
# this size per slot fits without retraction; longer ones share the room of shorter ones.
TOKENS_PER_RUNNING_REQUEST = 1024


@dataclass(frozen=True)
class CudaDefaults:
    """The limits a CUDA engine gets unless given."""

    max_running_requests: int
    max_prefill_tokens: int
    chunked_prefill_size: int
    decode_tiers: tuple[tuple[int, int], ...]  # (fewest decoding requests, forwards per step)


def cuda_running_limit(kv_capacity_tokens: int, graph_buckets: Sequence[int],
                       tokens_per_request: int = TOKENS_PER_RUNNING_REQUEST) -> int:
    """The largest graph bucket of requests that ``kv_capacity_tokens`` holds at
    ``tokens_per_request`` each; at least ``CUDA_MIN_RUNNING`` (or the largest bucket
    when that is smaller), at most the largest bucket (a larger decode step would run
    without a graph)."""
    if not graph_buckets:
        raise ValueError("graph_buckets is empty")
    largest = max(graph_buckets)
    fits = kv_capacity_tokens // max(1, tokens_per_request)
    held = [b for b in graph_buckets if b <= fits]
    return min(largest, max(max(held, default=0), CUDA_MIN_RUNNING))


def cuda_defaults(kv_capacity_tokens: int, graph_buckets: Sequence[int]) -> CudaDefaults:
    return CudaDefaults(
        max_running_requests=cuda_running_limit(kv_capacity_tokens, graph_buckets),
        max_prefill_tokens=CUDA_PREFILL_BUDGET["max_prefill_tokens"],
        chunked_prefill_size=CUDA_PREFILL_BUDGET["chunked_prefill_size"],
        decode_tiers=AUTO_TIERS,
    )


def running_limit(device_type: str, kv_capacity_tokens: int, graph_buckets: Sequence[int] | None) -> int:
    """``SchedulerConfig.max_running_requests`` when not given: derived on CUDA from
    the KV capacity and the decode graphs' buckets, ``CPU_MAX_RUNNING`` elsewhere."""
    if device_type == "cuda" and graph_buckets:
        return cuda_running_limit(kv_capacity_tokens, graph_buckets)
    return CPU_MAX_RUNNING
