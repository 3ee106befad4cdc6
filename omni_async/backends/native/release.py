"""A closed native stage returns its device memory at once, without a cyclic GC pass:
closing drops every reference to the device state (the model, its KV cache, CUDA graphs,
the runner's buffers), so the memory comes back when ``aclose()`` returns even while the
caller still holds the closed engine, and on CUDA the caching allocator hands it back."""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["release_stage_memory", "empty_device_cache", "RUNNER_DEVICE_STATE", "device_state_of"]

# The attributes through which each part holds device memory (the weights, the KV cache,
# CUDA graphs, the runner's step buffers). The config, tokenizer, allocator and core stay:
# a closed engine can still be inspected.
RUNNER_DEVICE_STATE = ("graphs", "sampling_graphs", "fused_decode", "_later_cols", "model", "kv", "inputs")


def device_state_of(stack: Any, worker: Any) -> list[tuple[Any, tuple[str, ...]]]:
    """What closing the stage built from ``stack`` lets go of, part by part."""
    return [
        (stack.runner, RUNNER_DEVICE_STATE),
        (worker, ("model",)),
        (stack, ("kv",)),
        (stack.loaded, ("model",)),
    ]


def release_stage_memory(device: Any, held: Sequence[tuple[Any, tuple[str, ...]]]) -> None:
    """A closed stage's device state goes now: each ``(part, names)`` in ``held`` stops
    referring to what those attributes held (set to None), and on CUDA the caching
    allocator hands the freed blocks back to the device."""
    for part, names in held:
        release = getattr(part, "release_stream", None)
        if release is not None:
            release()
        for name in names:
            if hasattr(part, name):
                setattr(part, name, None)
    empty_device_cache(device)


def empty_device_cache(device: Any) -> None:
    """Hand the CUDA caching allocator's free blocks back to the device, so the next
    engine (or another process) can use what this one held. Nothing to do on CPU."""
    if device is None:
        return
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_initialized():
        with torch.cuda.device(dev):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
