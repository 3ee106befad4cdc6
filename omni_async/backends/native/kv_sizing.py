"""How many KV tokens a native stage gets, and the paged cache that holds them."""

from __future__ import annotations

import os

import torch

from ...config import SchedulerConfig
from ...kv.cache import PagedKVCache
from ...logs import log
from ...memory_budget import MemoryPlan, activation_reserve_bytes, device_total_bytes, model_bytes, plan_memory
from ...models.loader import LoadedModel

# CPU KV when kv_capacity_tokens is not given: this fraction of the memory available now,
# within [CPU_KV_MIN_TOKENS, CPU_KV_MAX_TOKENS] (the cap keeps start-up and tests quick;
# give kv_capacity_tokens for more). DEFAULT_CPU_KV_TOKENS is used when the available
# memory cannot be read.
DEFAULT_CPU_KV_TOKENS = 32768
CPU_KV_MEMORY_FRACTION = 0.1
CPU_KV_MIN_TOKENS = 2048
CPU_KV_MAX_TOKENS = 65536



def kv_pages_for(config: SchedulerConfig, loaded: LoadedModel, device: torch.device, dtype: torch.dtype) -> int:
    cfg = loaded.model.config  # the local KV heads under tensor parallelism
    if config.memory_budget is not None:
        tokens = budget_plan(config, loaded, device, dtype).kv_tokens
    elif config.kv_capacity_tokens is not None:
        tokens = config.kv_capacity_tokens
    elif device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        per_token = PagedKVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)
        tokens = int(free * config.kv_memory_fraction) // per_token
    else:
        per_token = PagedKVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)
        tokens = cpu_kv_tokens(per_token)
    return max(1, tokens // config.page_size)


def budget_plan(config: SchedulerConfig, loaded: LoadedModel, device: torch.device, dtype: torch.dtype) -> MemoryPlan:
    """How ``config.memory_budget`` is spent on this loaded model (ConfigError when it
    cannot hold the weights, the reserve and a minimum KV)."""
    cfg = loaded.model.config
    itemsize = torch.empty((), dtype=dtype).element_size()
    graphs = device.type == "cuda" and config.cuda_graphs
    # Unset, the running limit is derived from the KV this plan sizes: reserve for the most
    # it can become (the largest graph batch).
    running = config.max_running_requests or config.cuda_graph_max_batch
    reserve = activation_reserve_bytes(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        prefill_tokens=config.chunk_size or config.max_prefill_tokens,
        max_batch=running,
        dtype_bytes=itemsize,
        cuda_graph_batch=min(config.cuda_graph_max_batch, running) if graphs else 0,
        device_type=device.type,
    )
    plan = plan_memory(
        config.memory_budget,  # type: ignore[arg-type]
        total_bytes=device_total_bytes(device),
        weights_bytes=model_bytes(loaded.model),
        reserve_bytes=reserve,
        kv_bytes_per_token=PagedKVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype),
        page_size=config.page_size,
        kv_tokens=config.kv_capacity_tokens,
    )
    log.info("engine_memory_plan", device=str(device), **plan.as_dict())
    return plan


def available_memory_bytes() -> int | None:
    """Memory available to new allocations now (psutil when installed, else sysconf)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def cpu_kv_tokens(bytes_per_token: int) -> int:
    """Why not a constant: 32k tokens of a large model's KV can exceed a small machine's
    memory, and are needlessly few on a big one."""
    avail = available_memory_bytes()
    if avail is None:
        return DEFAULT_CPU_KV_TOKENS
    tokens = int(avail * CPU_KV_MEMORY_FRACTION) // max(1, bytes_per_token)
    return max(CPU_KV_MIN_TOKENS, min(CPU_KV_MAX_TOKENS, tokens))


def kv_cache(loaded: LoadedModel, config: SchedulerConfig, device: torch.device, num_pages: int) -> PagedKVCache:
    """The paged KV of the model's (local) KV heads, plus one page at the end that the
    allocator never hands out: the scratch page that padded graph rows, and multi-step
    rows past their last forward, write to."""
    cfg = loaded.model.config
    scratch = 1
    return PagedKVCache(
        num_layers=cfg.num_layers,
        num_pages=num_pages + scratch,
        page_size=config.page_size,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=next(loaded.model.parameters()).dtype,
        device=device,
    )
