"""The paged KV cache of a native stage, and a rank's own KV sizing under tensor
parallelism (the ranks then agree on the fewest pages any of them holds)."""

from __future__ import annotations

import torch

from ...config import SchedulerConfig
from ...core.plan import kv_pages
from ...kv.cache import PagedKVCache
from ...models.loader import LoadedModel
from .facts import checkpoint_facts, device_facts


def rank_kv_pages(config: SchedulerConfig, loaded: LoadedModel, device: torch.device) -> int:
    """The KV pages this rank's memory holds, as :func:`omni_async.core.plan.kv_pages`
    sizes them from the facts read here."""
    return kv_pages(config, device_facts(device), checkpoint_facts(loaded.path, loaded))


def kv_cache(loaded: LoadedModel, page_size: int, device: torch.device, num_pages: int) -> PagedKVCache:
    """The paged KV of the model's (local) KV heads, plus one page at the end that the
    allocator never hands out: the scratch page that padded graph rows, and multi-step
    rows past their last forward, write to."""
    cfg = loaded.model.config
    scratch = 1
    return PagedKVCache(
        num_layers=cfg.num_layers,
        num_pages=num_pages + scratch,
        page_size=page_size,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=next(loaded.model.parameters()).dtype,
        device=device,
    )
