"""Paged KV cache: page allocator, cache tensors, and attention over pages."""

from .allocator import KVAllocationError, PageAllocator
from .attention import AttentionContext, paged_attention
from .cache import PagedKVCache

__all__ = ["PageAllocator", "KVAllocationError", "PagedKVCache", "AttentionContext", "paged_attention"]
