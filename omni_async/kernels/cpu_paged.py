"""CPU decode attention that reads the KV pages in place (``cpu_attention_kernel=True``).

The reference CPU path gathers every row's pages into a padded ``[B, L, KVH, D]`` copy
and runs SDPA over it: at 64 sequences the copy is written and read again each layer.
This kernel walks each row's page table instead: one task per (sequence, KV head), the
query heads of that group scored, softmaxed and summed against the pages where they are
(float32 arithmetic for float32 and bfloat16 caches). It is compiled from the C++ below
with the system compiler on first use (``torch.utils.cpp_extension``, about 20 s once;
torch caches the build). Summation order differs from SDPA, so it is close to the
reference (float32: ~1e-6), not bit-equal: opt-in.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .. import errors
from ..logs import log

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

template <typename T>
static void decode_rows(const T* q, const T* kc, const T* vc, const int64_t* pages, const int64_t* lens, T* out,
                        int64_t B, int64_t H, int64_t D, int64_t KVH, int64_t P, int64_t ps, float scale) {
  const int64_t rep = H / KVH;
  at::parallel_for(0, B * KVH, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scores(P * ps), qf(D), acc(D);
    for (int64_t bk = lo; bk < hi; ++bk) {
      const int64_t b = bk / KVH, g = bk % KVH, len = lens[b];
      for (int64_t r = 0; r < rep; ++r) {
        const int64_t head = g * rep + r;
        for (int64_t d = 0; d < D; ++d) qf[d] = static_cast<float>(q[(b * H + head) * D + d]) * scale;
        float mx = -INFINITY;
        for (int64_t t = 0; t < len; ++t) {
          const T* k = kc + ((pages[b * P + t / ps] * ps + t % ps) * KVH + g) * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qf[d] * static_cast<float>(k[d]);
          scores[t] = s;
          mx = std::max(mx, s);
        }
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          scores[t] = std::exp(scores[t] - mx);
          sum += scores[t];
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t t = 0; t < len; ++t) {
          const T* v = vc + ((pages[b * P + t / ps] * ps + t % ps) * KVH + g) * D;
          const float w = scores[t] / sum;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) acc[d] += w * static_cast<float>(v[d]);
        }
        for (int64_t d = 0; d < D; ++d) out[(b * H + head) * D + d] = static_cast<T>(acc[d]);
      }
    }
  });
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor pages, int64_t ps,
                           torch::Tensor lens, double scale) {
  auto out = torch::empty_like(q);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = kc.size(1), P = pages.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_decode", [&] {
    decode_rows<scalar_t>(q.data_ptr<scalar_t>(), kc.data_ptr<scalar_t>(), vc.data_ptr<scalar_t>(),
                          pages.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                          B, H, D, KVH, P, ps, static_cast<float>(scale));
  });
  return out;
}
"""

_lock = threading.Lock()
_module: Any = None


def load() -> Any:
    """The compiled extension (built on first call); ConfigError when it cannot be built."""
    global _module
    with _lock:
        if _module is None:
            from torch.utils.cpp_extension import load_inline

            try:
                _module = load_inline(
                    "omni_async_cpu_paged", cpp_sources=_SOURCE, functions=["paged_decode"],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                )
            except Exception as exc:  # no compiler, no ninja, a failed build
                log.error("cpu_attention_kernel_build_failed", error=repr(exc))
                raise errors.ConfigError(f"cpu_attention_kernel=True, but its C++ kernel could not be built: {exc!r}") from exc
        return _module


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor, page_size: int,
                 kv_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` ``[B, H, D]``, caches ``[slots, KVH, D]``, ``pages`` ``[B, P]`` page ids,
    ``kv_lens`` ``[B]``: the attention output ``[B, H, D]``."""
    return load().paged_decode(
        q.contiguous(), k_cache, v_cache, pages.to(torch.long).contiguous(), page_size, kv_lens.to(torch.long).contiguous(), scale,
    )
