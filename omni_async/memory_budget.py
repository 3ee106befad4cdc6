"""A per-engine memory budget that does not depend on load order.

``kv_memory_fraction`` sizes the KV cache from the memory *free* when the engine loads,
so on a shared device the first engine takes most of it and the next one what is left.
``memory_budget`` is instead a share of the device's *total* memory (a float in (0, 1])
or a number of bytes (an int): the engine's weights, its activation and CUDA-graph
reserve and its KV cache together stay within it, and the KV cache gets what remains.
Two engines given 0.5 and 0.3 get the same sizes whichever loads first. On CPU the budget
counts against the machine's total RAM.

The functions here are pure (numbers in, a plan out) so the sizing is tested without a
device; :func:`device_total_bytes` and :func:`model_bytes` read the facts they need.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import ConfigError

if TYPE_CHECKING:  # torch is imported where a device is read: config imports this module
    import torch

__all__ = [
    "MemoryPlan",
    "budget_bytes",
    "check_budget",
    "plan_memory",
    "activation_reserve_bytes",
    "device_total_bytes",
    "model_bytes",
    "MIN_KV_TOKENS",
]

# The least KV a budget must leave after weights and reserve: a few requests of a few
# hundred tokens. Below it the engine could load but hardly serve.
MIN_KV_TOKENS = 1024
# On CUDA, what the reserve counts beyond activations and graphs: cuBLAS/Triton
# workspaces and allocator fragmentation (the CUDA context itself is outside torch).
CUDA_FIXED_RESERVE_BYTES = 512 << 20


@dataclass(frozen=True)
class MemoryPlan:
    """How one engine's budget is spent (bytes), and the KV it buys."""

    budget_bytes: int
    weights_bytes: int
    reserve_bytes: int
    kv_bytes: int
    kv_tokens: int

    def as_dict(self) -> dict[str, int]:
        return {
            "memory_budget_bytes": self.budget_bytes,
            "weights_bytes": self.weights_bytes,
            "reserve_bytes": self.reserve_bytes,
            "kv_bytes": self.kv_bytes,
            "kv_tokens": self.kv_tokens,
        }


def check_budget(budget: Any) -> None:
    """Refuse a budget that is neither a fraction in (0, 1] nor a positive byte count."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ConfigError(f"memory_budget must be a float in (0, 1] or an int number of bytes, got {budget!r}")
    if isinstance(budget, float) and not 0.0 < budget <= 1.0:
        raise ConfigError(f"memory_budget as a float is a fraction of the device's total memory, in (0, 1]; got {budget!r}")
    if isinstance(budget, int) and budget < 1:
        raise ConfigError(f"memory_budget as an int is a number of bytes >= 1, got {budget!r}")


def budget_bytes(budget: float | int, total_bytes: int) -> int:
    """The budget in bytes: a float is that share of ``total_bytes``, an int is bytes
    (and may not exceed the device)."""
    check_budget(budget)
    if isinstance(budget, float):
        return int(budget * total_bytes)
    if budget > total_bytes:
        raise ConfigError(f"memory_budget of {_gib(budget)} exceeds the device's total memory ({_gib(total_bytes)})")
    return int(budget)


def activation_reserve_bytes(
    *,
    hidden_size: int,
    intermediate_size: int,
    vocab_size: int,
    prefill_tokens: int,
    max_batch: int,
    dtype_bytes: int,
    cuda_graph_batch: int = 0,
    device_type: str = "cpu",
) -> int:
    """An estimate of what serving needs beyond weights and KV: one prefill chunk's
    activations (the widest layer tensors live at once), float32 logits and sampling
    buffers for a full batch, and, when CUDA graphs are captured, their pools (a decode
    batch's activations per graph, shared across buckets) plus a fixed CUDA reserve."""
    per_token = (4 * hidden_size + 3 * intermediate_size) * dtype_bytes
    prefill = prefill_tokens * per_token
    logits = max_batch * vocab_size * 4 * 3  # logits, probabilities, a sorted copy
    graphs = cuda_graph_batch * (per_token + vocab_size * 4 * 2)
    fixed = CUDA_FIXED_RESERVE_BYTES if device_type == "cuda" else 0
    return int(prefill + logits + graphs + fixed)


def plan_memory(
    budget: float | int,
    *,
    total_bytes: int,
    weights_bytes: int,
    reserve_bytes: int,
    kv_bytes_per_token: int,
    page_size: int,
    kv_tokens: int | None = None,
    min_kv_tokens: int = MIN_KV_TOKENS,
) -> MemoryPlan:
    """Spend ``budget`` on weights, reserve and KV. With ``kv_tokens`` the KV size is
    given and must fit; without, the KV gets what remains, in whole pages. ConfigError
    when the budget cannot hold the weights, the reserve and ``min_kv_tokens`` of KV."""
    limit = budget_bytes(budget, total_bytes)
    left = limit - weights_bytes - reserve_bytes
    need = max(min_kv_tokens, page_size) if kv_tokens is None else kv_tokens
    if left < need * kv_bytes_per_token:
        what = "the requested kv_capacity_tokens" if kv_tokens is not None else "a minimum KV cache"
        raise ConfigError(
            f"memory_budget {budget!r} ({_gib(limit)} of {_gib(total_bytes)}) cannot hold the weights "
            f"({_gib(weights_bytes)}), the activation reserve ({_gib(reserve_bytes)}) and {what} of {need} tokens "
            f"({_gib(need * kv_bytes_per_token)}): give the engine a larger budget"
        )
    tokens = kv_tokens if kv_tokens is not None else (left // kv_bytes_per_token) // page_size * page_size
    return MemoryPlan(limit, weights_bytes, reserve_bytes, tokens * kv_bytes_per_token, tokens)


def device_total_bytes(device: torch.device) -> int:
    """The device's total memory: the GPU's on CUDA, the machine's RAM on CPU."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def model_bytes(model: torch.nn.Module) -> int:
    """What the loaded model's parameters and buffers occupy (shared tensors once)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t)
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"
