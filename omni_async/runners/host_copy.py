"""A step's one copy to the host and its reading there: the sampled tokens, their ``ok``
flags and (when asked) logprobs packed into one int64 tensor, copied without waiting
(the step's completion marker says when it landed), and read back as Python lists once
the step completed (``runners.base``'s launch and collect)."""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Sequence

import numpy as np
import torch

from .types import BatchResult


def copy_to_host(result: BatchResult, wait: bool = False) -> torch.Tensor:
    """One ``[2 or 3, B]`` int64 tensor (tokens, ok, float32 logprob bits) copied
    to pinned host memory without waiting (the step's event marks it complete), or
    with a wait when asked. A fused multi-step decode's ``packed`` goes as it is."""
    if result.packed is not None:
        return to_host(result.packed, wait)
    tokens = result.next_token_ids.to(torch.long).reshape(-1)  # a multi-step decode's [k, B] flattened
    ok = result.sample_ok.reshape(-1) if result.sample_ok is not None else torch.ones_like(tokens, dtype=torch.bool)
    parts = [tokens, ok.to(torch.long)]
    if result.next_token_logprobs is not None:
        parts.append(result.next_token_logprobs.reshape(-1).to(torch.float32).view(torch.int32).to(torch.long))
    return to_host(torch.stack(parts), wait)


def rows_ok(ok: list[int], steps: list[int]) -> list[int]:
    """Per row of a multi-step decode: 1 when each of its forwards sampled a token."""
    size = len(steps)
    return [int(all(ok[j * size + i] for j in range(n))) for i, n in enumerate(steps)]


def to_host(packed: torch.Tensor, wait: bool) -> torch.Tensor:
    if packed.device.type == "cpu" or wait:
        return packed.cpu()
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    return host


def host_values(host: torch.Tensor, rows: int) -> tuple[list[int], list[int] | None, list[float] | None]:
    """Token ids, ok flags and logprobs (or None) as Python lists; a fused multi-step
    decode's ``[2, k, B]`` less its padding rows, forward-major. The ok flags are None
    when every one is set (the usual step: checked in numpy, no list made)."""
    arr = host.numpy()
    if arr.ndim == 3:
        arr = arr[:, :, :rows].reshape(arr.shape[0], -1)
    logprobs = arr[2].astype(np.int32).view(np.float32).astype(np.float64).tolist() if arr.shape[0] > 2 else None
    return arr[0].tolist(), None if arr[1].all() else arr[1].tolist(), logprobs


_FINISH_REASON, _EPOCH = attrgetter("finish_reason"), attrgetter("epoch")


def live_rows(kept: Sequence[bool], reqs: Sequence[Any], epochs: Sequence[int]) -> list[int]:
    """The rows whose sample the step keeps and whose request neither finished nor was
    retracted since the step was scheduled. When that is every row (the usual decode
    step) three C-level passes over the rows say so; else one Python pass picks them."""
    n = len(reqs)
    if all(kept) and list(map(_FINISH_REASON, reqs)).count(None) == n and list(map(_EPOCH, reqs)) == epochs:
        return list(range(n))
    return [i for i, (k, r, e) in enumerate(zip(kept, reqs, epochs)) if k and r.finish_reason is None and r.epoch == e]
