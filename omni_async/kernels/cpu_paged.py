"""CPU decode attention that reads the KV pages in place (``cpu_attention_kernel=True``).

The reference CPU path gathers every row's pages into a padded ``[B, L, KVH, D]`` copy
and runs SDPA over it: at 64 sequences the copy is written and read again each layer.
This kernel walks each row's page table instead: one task per (sequence, KV head), the
query heads of that group scored, softmaxed and summed against the pages where they are
(float32 arithmetic for float32 and bfloat16 caches). It is compiled from the C++ below
with the system compiler on first use (``torch.utils.cpp_extension``, about 20 s once;
torch caches the build). Summation order differs from SDPA and exp is a polynomial
(:data:`~omni_async.kernels.cpu_fused.EXP_POLY`, about 1 ulp, vectorised over a row's
scores), so it is close to the reference (float32: ~1e-6), not bit-equal: opt-in.
"""

from __future__ import annotations

from typing import Any

import torch


SOURCE = r"""
#include <torch/extension.h>
#include <cstdint>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

// Scores, then exp over the whole row (a vectorised loop), then the weighted V sum; the
// query heads of one KV head share each K and V row load. DC is the head dim when it is
// one of the common ones (the dot products then compile to straight-line vector code), 0
// for any other.
template <typename T, int64_t DC>
static void decode_rows(const T* q, const T* kc, const T* vc, const int64_t* pages, const int64_t* lens, T* out,
                        int64_t B, int64_t H, int64_t D_, int64_t KVH, int64_t P, int64_t ps, float scale) {
  const int64_t D = DC ? DC : D_;
  const int64_t rep = H / KVH, span = P * ps;
  at::parallel_for(0, B * KVH, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scores(rep * span), qf(rep * D), acc(rep * D), mx(rep), sum(rep);
    for (int64_t bk = lo; bk < hi; ++bk) {
      const int64_t b = bk / KVH, g = bk % KVH, len = lens[b];
      for (int64_t r = 0; r < rep; ++r)
        for (int64_t d = 0; d < D; ++d) qf[r * D + d] = static_cast<float>(q[(b * H + g * rep + r) * D + d]) * scale;
      std::fill(mx.begin(), mx.end(), -INFINITY);
      for (int64_t t = 0; t < len; ++t) {
        const T* k = kc + ((pages[b * P + t / ps] * ps + t % ps) * KVH + g) * D;
        for (int64_t r = 0; r < rep; ++r) {
          const float* qr = qf.data() + r * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qr[d] * static_cast<float>(k[d]);
          scores[r * span + t] = s;
          mx[r] = std::max(mx[r], s);
        }
      }
      for (int64_t r = 0; r < rep; ++r) {
        float* sr = scores.data() + r * span;
        const float m = mx[r];
        for (int64_t t = 0; t < len; ++t) sr[t] = exp_poly_contracted(sr[t] - m);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; ++t) total += sr[t];
        sum[r] = total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const T* v = vc + ((pages[b * P + t / ps] * ps + t % ps) * KVH + g) * D;
        for (int64_t r = 0; r < rep; ++r) {
          const float w = scores[r * span + t] / sum[r];
          float* ar = acc.data() + r * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ar[d] += w * static_cast<float>(v[d]);
        }
      }
      for (int64_t r = 0; r < rep; ++r)
        for (int64_t d = 0; d < D; ++d) out[(b * H + g * rep + r) * D + d] = static_cast<T>(acc[r * D + d]);
    }
  });
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor pages, int64_t ps,
                           torch::Tensor lens, double scale) {
  auto out = torch::empty_like(q);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = kc.size(1), P = pages.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_decode", [&] {
    auto run = D == 64 ? decode_rows<scalar_t, 64> : D == 128 ? decode_rows<scalar_t, 128> : decode_rows<scalar_t, 0>;
    run(q.data_ptr<scalar_t>(), kc.data_ptr<scalar_t>(), vc.data_ptr<scalar_t>(), pages.data_ptr<int64_t>(),
        lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, H, D, KVH, P, ps, static_cast<float>(scale));
  });
  return out;
}
"""

FUNCTIONS = ["paged_decode"]


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
