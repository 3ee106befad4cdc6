"""The decoder's work between the GEMMs as fused C++ CPU kernels (``cpu_fused_ops=True``).

Why: on a small CPU a decode step at 16-64 rows spends as much time between the GEMMs
as in them. Each torch op of residual add + RMSNorm (about six), rotary + KV write (about
ten) and SiLU-and-multiply (two) that is over ATen's grain size (32,768 elements) opens an
OpenMP parallel region, and a region costs far more than its arithmetic here: once the
process holds more OpenMP threads than cores (the loop thread's team plus the step
thread's, e.g. after any parallel torch op on the loop thread) libgomp stops spinning
between regions and every region wakes a sleeping thread (measured on a 2-core VM:
add + RMSNorm of 64 x 576 floats took 0.25 ms through torch in the step thread, 0.02 ms
with no second team). Each op below is one call, one pass over its rows, no temporaries,
and runs on the calling thread unless it has enough rows to pay for a parallel region
(prefill). The attention of an extend step (prefill, with or without a cached prefix) is
one call per layer too, instead of an SDPA call (and its regions) per sequence.

Rounding follows :class:`~omni_async.kernels.reference.ReferenceOps` step by step (the
residual sum, the normalised value, SiLU and the rotary products are rounded to the
activation dtype where the reference rounds them; float32 arithmetic in between, FMA
contraction off), so float32 results differ from the reference only by the summation
order of the RMSNorm mean and of the attention, and by exp (a polynomial, about 1 ulp):
close, not bit-equal, hence opt-in. Float32 and bfloat16 activations. Compiled from the
C++ below with the system compiler on first use (``torch.utils.cpp_extension``, about
20 s once; cached by torch).
"""

from __future__ import annotations

from typing import Any

import torch

from .reference import ReferenceOps

EXP_POLY = r"""
// exp for SiLU and softmax: Cephes' single-precision polynomial (about 1.3 ulp over [-87, 88]; 0 below,
// inf above), branch-free so the loop around it vectorises with one division per element
// (std::floor does with -fno-trapping-math). The clamp is on the power of two, not on x:
// clamping x makes GCC add a second, predicated division.
static inline float exp_poly(float x) {
  float n = std::floor(x * 1.44269504088896341f + 0.5f);
  n = std::min(std::max(n, -127.f), 128.f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return y * __builtin_bit_cast(float, bits);
}
"""

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// Below this many elements an op runs on the calling thread: a parallel region costs more.
static constexpr int64_t kParallelElems = 1 << 18;

template <typename F>
static void over_rows(int64_t rows, int64_t per_row, const F& body) {
  if (rows * per_row < kParallelElems) {
    body(0, rows);
  } else {
    at::parallel_for(0, rows, std::max<int64_t>(1, kParallelElems / 4 / std::max<int64_t>(1, per_row)), body);
  }
}

template <typename T> static inline T round_to(float v) { return static_cast<T>(v); }

// Sum of squares with 16 independent partial sums (vectorisable without reassociation flags).
static inline float sum_squares(const float* v, int64_t n) {
  float part[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) part[j] += v[i + j] * v[i + j];
  float acc = 0.f;
  for (int j = 0; j < 16; ++j) acc += part[j];
  for (; i < n; ++i) acc += v[i] * v[i];
  return acc;
}

template <typename T>
static void add_rms_norm_rows(const T* x, const T* d, const T* w, T* sum, T* out, int64_t rows, int64_t n, float eps) {
  over_rows(rows, n, [&](int64_t lo, int64_t hi) {
    std::vector<float> f(n);
    for (int64_t r = lo; r < hi; ++r) {
      const T* xr = x + r * n;
      if (d != nullptr) {
        const T* dr = d + r * n;
        T* sr = sum + r * n;
        for (int64_t i = 0; i < n; ++i) {
          T s = round_to<T>(static_cast<float>(xr[i]) + static_cast<float>(dr[i]));
          sr[i] = s;
          f[i] = static_cast<float>(s);
        }
      } else {
        for (int64_t i = 0; i < n; ++i) f[i] = static_cast<float>(xr[i]);
      }
      const float inv = 1.f / std::sqrt(sum_squares(f.data(), n) / static_cast<float>(n) + eps);
      T* orow = out + r * n;
      for (int64_t i = 0; i < n; ++i)
        orow[i] = round_to<T>(static_cast<float>(w[i]) * static_cast<float>(round_to<T>(f[i] * inv)));
    }
  });
}

std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps) {
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(1, n);
  auto out = torch::empty_like(x);
  auto sum = delta.has_value() ? torch::empty_like(x) : x;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), delta.has_value() ? delta->data_ptr<scalar_t>() : nullptr,
                                weight.data_ptr<scalar_t>(), sum.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                rows, n, static_cast<float>(eps));
  });
  return {sum, out};
}

template <typename T>
static void silu_mul_rows(const T* gu, T* out, int64_t rows, int64_t n) {
  over_rows(rows, 2 * n, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const T* g = gu + r * 2 * n;
      const T* u = g + n;
      T* o = out + r * n;
      for (int64_t i = 0; i < n; ++i) {
        const float gf = static_cast<float>(g[i]);
        const T silu = round_to<T>(gf / (1.f + exp_poly(-gf)));
        o[i] = round_to<T>(static_cast<float>(silu) * static_cast<float>(u[i]));
      }
    }
  });
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  const int64_t width = gate_up.size(-1), rows = gate_up.numel() / std::max<int64_t>(1, width);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = width / 2;
  auto out = torch::empty(sizes, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, width / 2);
  });
  return out;
}

// One head of one token: x * cos + rotate_half(x) * sin, each product and the sum rounded
// to T as the reference's three ops round them.
template <typename T>
static inline void rotate(const T* x, const T* c, const T* s, T* y, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
    const T a1 = round_to<T>(x1 * static_cast<float>(c[i]));
    const T b1 = round_to<T>(-x2 * static_cast<float>(s[i]));
    const T a2 = round_to<T>(x2 * static_cast<float>(c[i + half]));
    const T b2 = round_to<T>(x1 * static_cast<float>(s[i + half]));
    y[i] = round_to<T>(static_cast<float>(a1) + static_cast<float>(b1));
    y[i + half] = round_to<T>(static_cast<float>(a2) + static_cast<float>(b2));
  }
}

template <typename T>
static void rope_store_rows(const T* q, const T* k, const T* v, const T* cos, const T* sin, T* qo, T* ko, T* kc, T* vc,
                            const int64_t* slots, int64_t tokens, int64_t H, int64_t KVH, int64_t D,
                            int64_t sq, int64_t sqh, int64_t sk, int64_t skh, int64_t sv, int64_t svh) {
  const int64_t half = D / 2;
  over_rows(tokens, (H + 2 * KVH) * D, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const T* c = cos + t * D;
      const T* s = sin + t * D;
      for (int64_t h = 0; h < H; ++h) rotate<T>(q + t * sq + h * sqh, c, s, qo + (t * H + h) * D, half);
      const int64_t slot = slots[t];
      for (int64_t g = 0; g < KVH; ++g) {
        T* krow = ko + (t * KVH + g) * D;
        rotate<T>(k + t * sk + g * skh, c, s, krow, half);
        std::memcpy(kc + (slot * KVH + g) * D, krow, D * sizeof(T));
        std::memcpy(vc + (slot * KVH + g) * D, v + t * sv + g * svh, D * sizeof(T));
      }
    }
  });
}

std::vector<torch::Tensor> rope_store(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                                      torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots) {
  const int64_t T_ = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  auto qo = torch::empty({T_, H, D}, q.options());
  auto ko = torch::empty({T_, KVH, D}, k.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "rope_store", [&] {
    rope_store_rows<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                              cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), qo.data_ptr<scalar_t>(),
                              ko.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                              slots.data_ptr<int64_t>(), T_, H, KVH, D, q.stride(0), q.stride(1), k.stride(0),
                              k.stride(1), v.stride(0), v.stride(1));
  });
  return {qo, ko};
}

// Causal attention of an extend step, reading K/V from the cache through each sequence's
// slots (its cached prefix, then its new tokens, already written): query i of a sequence
// with prefix p attends to its first p + i + 1 positions. One task per (sequence, query
// head), float32 arithmetic.
template <typename T>
static void extend_rows(const T* q, const T* kc, const T* vc, T* out, const int64_t* slots, const int64_t* seqs,
                        int64_t S, int64_t H, int64_t KVH, int64_t D, float scale) {
  const int64_t rep = H / KVH;
  int64_t longest = 1;  // seqs: [S, 4] rows of (q_start, q_len, prefix_len, first slot index)
  for (int64_t s = 0; s < S; ++s) longest = std::max(longest, seqs[s * 4 + 1] + seqs[s * 4 + 2]);
  at::parallel_for(0, S * H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scores(longest), qf(D), acc(D);
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t s = task / H, h = task % H, g = h / rep;
      const int64_t start = seqs[s * 4], n = seqs[s * 4 + 1], prefix = seqs[s * 4 + 2];
      const int64_t* sl = slots + seqs[s * 4 + 3];
      for (int64_t i = 0; i < n; ++i) {
        const T* qrow = q + ((start + i) * H + h) * D;
        for (int64_t d = 0; d < D; ++d) qf[d] = static_cast<float>(qrow[d]) * scale;
        const int64_t len = prefix + i + 1;
        float mx = -INFINITY;
        for (int64_t j = 0; j < len; ++j) {
          const T* krow = kc + (sl[j] * KVH + g) * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qf[d] * static_cast<float>(krow[d]);
          scores[j] = dot;
          mx = std::max(mx, dot);
        }
        for (int64_t j = 0; j < len; ++j) scores[j] = exp_poly(scores[j] - mx);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < len; ++j) sum += scores[j];
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j < len; ++j) {
          const T* vrow = vc + (sl[j] * KVH + g) * D;
          const float w = scores[j] / sum;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) acc[d] += w * static_cast<float>(vrow[d]);
        }
        T* orow = out + ((start + i) * H + h) * D;
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(acc[d]);
      }
    }
  });
}

torch::Tensor extend_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                               torch::Tensor seqs, double scale) {
  auto out = torch::empty_like(q);
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(1), S = seqs.size(0);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "extend_attention", [&] {
    extend_rows<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                          out.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(), seqs.data_ptr<int64_t>(), S, H, KVH, D,
                          static_cast<float>(scale));
  });
  return out;
}
"""

FUNCTIONS = ["add_rms_norm", "silu_mul", "rope_store", "extend_attention"]


def load() -> Any:
    """The compiled CPU kernels (:mod:`.cpu_kernels`; built on first call); ConfigError
    when they cannot be built."""
    from .cpu_kernels import load as load_all

    return load_all()


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, rmsnorm(x + delta) * weight)`` over the last dimension in one pass;
    with ``delta`` None, ``(x, rmsnorm(x) * weight)``. All three share one dtype."""
    d = None if delta is None else delta.contiguous()
    total, out = load().add_rms_norm(x.contiguous(), d, weight.contiguous(), eps)
    return (x if delta is None else total), out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for rows laid out ``[gate | up]`` (the merged GEMM's output)."""
    return load().silu_mul(gate_up.contiguous())


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` ``[T, H, D]`` and ``k`` ``[T, KVH, D]`` into new contiguous tensors
    and write the rotated k and ``v`` into the caches (``[slots, KVH, D]``) at ``slots``."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return tuple(load().rope_store(q, k, v, cos.contiguous(), sin.contiguous(), k_cache, v_cache, slots.to(torch.long).contiguous()))


def extend_tables(seq_slices: list[tuple[int, int, int]], seq_kv_slots: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`extend_attention` reads: every sequence's KV slots end to end, and per
    sequence ``(q_start, q_len, prefix_len, offset of its first slot)``; built once per
    forward (the layers share them)."""
    offsets = [0]
    for slots in seq_kv_slots[:-1]:
        offsets.append(offsets[-1] + int(slots.shape[0]))
    seqs = torch.tensor([(*sl, off) for sl, off in zip(seq_slices, offsets)], dtype=torch.long)
    return torch.cat([s.to(torch.long) for s in seq_kv_slots]), seqs


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor],
                     scale: float) -> torch.Tensor:
    """Causal attention of an extend step's ``q`` ``[T, H, D]`` over each sequence's
    cached prefix and new tokens (their K/V already in the caches ``[slots, KVH, D]``),
    in one call; ``tables`` from :func:`extend_tables`."""
    return load().extend_attention(q.contiguous(), k_cache, v_cache, tables[0], tables[1], scale)


class CpuFusedOps:
    """The decoder's elementwise ops through the kernels above (same interface as
    :class:`~omni_async.kernels.reference.ReferenceOps`); shapes or dtypes they do not
    take (mixed dtypes, a non-contiguous cache) go to the reference ops."""

    name = "cpu_fused"

    def __init__(self) -> None:
        self.reference = ReferenceOps()

    def add_norm(self, x, delta, norm):
        if norm.weight.dtype != x.dtype or (delta is not None and delta.dtype != x.dtype):
            return self.reference.add_norm(x, delta, norm)
        return add_rms_norm(x, delta, norm.weight, norm.eps)

    def silu_mul(self, gate_up):
        return silu_mul(gate_up)

    def rope_store(self, q, k, v, cos, sin, kv, layer, slots):
        kc, vc = kv.k[layer], kv.v[layer]
        if not (kc.is_contiguous() and vc.is_contiguous() and kc.dtype == vc.dtype == q.dtype == k.dtype == v.dtype == cos.dtype):
            return self.reference.rope_store(q, k, v, cos, sin, kv, layer, slots)
        return rope_store(q, k, v, cos, sin, kc, vc, slots)
