"""CPU decode attention that reads the KV pages in place (``cpu_attention_kernel=True``).

The reference CPU path gathers every row's pages into a padded ``[B, L, KVH, D]`` copy
and runs SDPA over it: at 64 sequences the copy is written and read again each layer.
This kernel walks each row's page table instead: one task per (sequence, KV head), the
query heads of that group scored, softmaxed and summed against the pages where they are
(float32 arithmetic for float32 and bfloat16 caches). It is compiled from the C++ below
with the system compiler on first use (``torch.utils.cpp_extension``, about 20 s once;
torch caches the build). Summation order differs from SDPA and exp is a polynomial
(:data:`~omni_async.kernels.cpu_sources.FUSED_EXP_POLY`, about 1 ulp, vectorised over a row's
scores), so it is close to the reference (float32: ~1e-6), not bit-equal: opt-in.
"""

from __future__ import annotations

from typing import Any

import torch





def load() -> Any:
    """The compiled CPU kernels (:mod:`.cpu_kernels`; built on first call); ConfigError
    when they cannot be built."""
    from .cpu_kernels import load as load_all

    return load_all()


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor, page_size: int,
                 kv_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` ``[B, H, D]``, caches ``[slots, KVH, D]``, ``pages`` ``[B, P]`` page ids,
    ``kv_lens`` ``[B]``: the attention output ``[B, H, D]``."""
    return load().paged_decode(
        q.contiguous(), k_cache, v_cache, pages.to(torch.long).contiguous(), page_size, kv_lens.to(torch.long).contiguous(), scale,
    )
