"""Paged KV: the page allocator and prefix cache (pure bookkeeping, imported by the batch
core without torch), the cache tensors (``cache``) and attention over them
(``attention``)."""
