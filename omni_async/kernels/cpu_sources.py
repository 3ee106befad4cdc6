"""The C++ of the CPU kernel extension (:mod:`.cpu_kernels` assembles it), kept apart
from the Python wrappers of each family (:mod:`.cpu_fused`, :mod:`.cpu_paged`,
:mod:`.cpu_quant`, :mod:`.cpu_stack`) so that the extension is built from text alone and
the wrappers can load it without an import cycle."""

from __future__ import annotations

# cpu_fused
FUSED_EXP_POLY = r"""
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

FUSED_SOURCE = r"""
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

FUSED_FUNCTIONS = ["add_rms_norm", "silu_mul", "rope_store", "extend_attention"]

# cpu_paged
PAGED_SOURCE = r"""
#include <torch/extension.h>
#include <cstdint>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

// Scores, then exp over the whole row (a vectorised loop), then the weighted V sum. DC is
// the head dim when it is one of the common ones (the dot products then compile to
// straight-line vector code), 0 for any other. A task is one row's query heads
// [h0, h0 + n), n = heads_per_task (decode_heads_per_task): one head (both cores get a
// share at batch 1), one KV head's query heads (they share each K and V row load), or
// every head of the row (many rows: the row's K and V are read token by token, each
// token's heads contiguous, instead of one head's 64 floats out of every token). Each
// query head's arithmetic is the same whatever the task holds, so neither the batch nor
// the thread count changes a row's bits.
template <typename T, int64_t DC>
static void decode_tasks(const T* q, const T* kc, const T* vc, const int64_t* pages, const int64_t* lens, T* out,
                         int64_t H, int64_t D_, int64_t KVH, int64_t P, int64_t ps, float scale, int64_t heads_per_task,
                         int64_t lo, int64_t hi) {
  const int64_t D = DC ? DC : D_;
  const int64_t rep = H / KVH, span = P * ps, n = heads_per_task, per_row = H / n;
  std::vector<float> scores(n * span), qf(n * D), acc(n * D), mx(n), sum(n);
  std::vector<int64_t> offset(n);  // each head's K/V offset within a token's row
  for (int64_t task = lo; task < hi; ++task) {
    const int64_t b = task / per_row, h0 = (task % per_row) * n, len = lens[b];
    for (int64_t j = 0; j < n; ++j) {
      offset[j] = ((h0 + j) / rep) * D;
      for (int64_t d = 0; d < D; ++d) qf[j * D + d] = static_cast<float>(q[(b * H + h0 + j) * D + d]) * scale;
    }
    std::fill(mx.begin(), mx.end(), -INFINITY);
    for (int64_t t = 0; t < len; ++t) {
      const T* krow = kc + (pages[b * P + t / ps] * ps + t % ps) * KVH * D;
      for (int64_t j = 0; j < n; ++j) {
        const float* qr = qf.data() + j * D;
        const T* k = krow + offset[j];
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qr[d] * static_cast<float>(k[d]);
        scores[j * span + t] = s;
        mx[j] = std::max(mx[j], s);
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      float* sr = scores.data() + j * span;
      const float m = mx[j];
      for (int64_t t = 0; t < len; ++t) sr[t] = exp_poly_contracted(sr[t] - m);
      float total = 0.f;
#pragma omp simd reduction(+ : total)
      for (int64_t t = 0; t < len; ++t) total += sr[t];
      sum[j] = total;
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t t = 0; t < len; ++t) {
      const T* vrow = vc + (pages[b * P + t / ps] * ps + t % ps) * KVH * D;
      for (int64_t j = 0; j < n; ++j) {
        const float w = scores[j * span + t] / sum[j];
        const T* v = vrow + offset[j];
        float* ar = acc.data() + j * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ar[d] += w * static_cast<float>(v[d]);
      }
    }
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < D; ++d) out[(b * H + h0 + j) * D + d] = static_cast<T>(acc[j * D + d]);
  }
}

// The query heads one attention task takes (see decode_tasks), from the rows and the
// threads: one place for the stack and the per-op kernel alike.
static int64_t decode_heads_per_task(int64_t B, int64_t H, int64_t KVH) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  if (B * KVH < 2 * threads) return 1;
  if (B < 4 * threads) return H / KVH;
  return H;
}

template <typename T, int64_t DC>
static void decode_rows(const T* q, const T* kc, const T* vc, const int64_t* pages, const int64_t* lens, T* out,
                        int64_t B, int64_t H, int64_t D_, int64_t KVH, int64_t P, int64_t ps, float scale) {
  const int64_t n = decode_heads_per_task(B, H, KVH);
  at::parallel_for(0, B * (H / n), 1, [&](int64_t lo, int64_t hi) {
    decode_tasks<T, DC>(q, kc, vc, pages, lens, out, H, D_, KVH, P, ps, scale, n, lo, hi);
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

PAGED_FUNCTIONS = ["paged_decode"]

# cpu_quant
QUANT_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
// The vector path needs AVX2, FMA and F16C (every AVX2 CPU has the other two); a portable loop otherwise.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define OMNI_BLOCK_SIMD 1
#include <immintrin.h>
#endif

static constexpr int64_t kBlock = 32;

static inline float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }
static inline const uint16_t* half_bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>()); }
static constexpr int64_t kRowTile = 4;  // activation rows sharing one unpacked weight block
// Output columns one task takes at a time (a multiple of every tile's width).
static constexpr int64_t kColumnGroup = 8;

// Each row of x, per block of 32: int8 codes, the scale, and the exact float sum.
static void quantize_rows(const float* x, int64_t B, int64_t K, int8_t* xq, float* dx, float* sx) {
  const int64_t nb = K / kBlock;
  for (int64_t i = 0; i < B * nb; ++i) {
    const float* v = x + i * kBlock;
    float amax = 0.f, sum = 0.f;
    for (int j = 0; j < kBlock; ++j) { amax = std::max(amax, std::fabs(v[j])); sum += v[j]; }
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    for (int j = 0; j < kBlock; ++j) xq[i * kBlock + j] = static_cast<int8_t>(std::nearbyint(v[j] * id));
    dx[i] = d;
    sx[i] = sum;
  }
}

#if defined(OMNI_BLOCK_SIMD)
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// The 32 codes of one weight block as bytes: q4's 16 bytes in both lanes, the high lane
// shifted by 4 (elements 16..31 are the high nibbles), then masked.
template <bool Q4> static inline __m256i unpack(const uint8_t* q) {
  if constexpr (Q4) {
    const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    return _mm256_and_si256(_mm256_srlv_epi32(raw, _mm256_set_epi32(4, 4, 4, 4, 0, 0, 0, 0)), _mm256_set1_epi8(0x0F));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  }
}

// sum_k m[k] * s[k] in a fixed order (8 lanes, then the lanes, then the tail): the q4
// minimums' term of one output, the same bits whatever tile the output is in.
static inline float min_term(const uint16_t* m, const float* s, int64_t nb) {
  __m256 a = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= nb; k += 8)
    a = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + k))), _mm256_loadu_ps(s + k), a);
  float v = hsum(a);
  for (; k < nb; ++k) v = std::fma(_cvtsh_ss(m[k]), s[k], v);
  return v;
}

// The int32 sums of each 4 adjacent u8 x s8 products: one VNNI instruction where the CPU
// has it (AVX512-VNNI with VL), else maddubs then madd. The same integers either way (the
// int16 pair sums of maddubs cannot saturate here: q4 codes 0..15 and |x| <= 127, or q8's
// |w| <= 128 and |x| <= 127, at most 32,512), so the outputs' bits do not depend on it.
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// R activation rows times C weight columns: each block of the C columns is unpacked once
// into registers and multiplied with the R rows' blocks, R*C independent accumulators (the
// FMA latency hidden at one row too). Every output's arithmetic is the same whatever R and
// C are, so a row's result does not depend on its batch.
template <bool Q4, int R, int C>
static inline void gemm_tile(const uint8_t* qs, const uint16_t* d, const uint16_t* m, const float* bias, const int8_t* xq,
                             const float* dx, const float* sx, float* out, int64_t b0, int64_t n0, int64_t N, int64_t nb) {
  constexpr int64_t block_bytes = Q4 ? 16 : 32;
  const int64_t row_bytes = nb * block_bytes;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const uint8_t* wq = qs + n0 * row_bytes;
  const uint16_t* dn = d + n0 * nb;
  for (int64_t k = 0; k < nb; ++k) {
    __m256i w[C], wa[C];
    __m256 dw[C];
    for (int c = 0; c < C; ++c) {
      w[c] = unpack<Q4>(wq + c * row_bytes + k * block_bytes);
      if constexpr (!Q4) wa[c] = _mm256_sign_epi8(w[c], w[c]);
      dw[c] = _mm256_set1_ps(_cvtsh_ss(dn[c * nb + k]));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t xb = (b0 + r) * nb + k;
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + xb * kBlock));
      const __m256 ds = _mm256_broadcast_ss(dx + xb);
      for (int c = 0; c < C; ++c) {
        __m256i p;
        if constexpr (Q4) {
          p = dot_u8s8(w[c], x);  // codes 0..15 are unsigned
        } else {
          p = dot_u8s8(wa[c], _mm256_sign_epi8(x, w[c]));
        }
        const __m256 dot = _mm256_cvtepi32_ps(p);
        acc[r][c] = _mm256_fmadd_ps(_mm256_mul_ps(dw[c], ds), dot, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float v = hsum(acc[r][c]);
      if constexpr (Q4) v += min_term(m + (n0 + c) * nb, sx + (b0 + r) * nb, nb);
      out[(b0 + r) * N + n0 + c] = v + (bias ? bias[n0 + c] : 0.f);
    }
  }
}

// Every row tile of one group of columns [n0, n1): the group's weights stay in L1 while
// all rows pass over them.
template <bool Q4, int R, int C>
static inline void gemm_rows_of(const uint8_t* qs, const uint16_t* d, const uint16_t* m, const float* bias, const int8_t* xq,
                                const float* dx, const float* sx, float* out, int64_t b0, int64_t b1, int64_t n0, int64_t n1,
                                int64_t N, int64_t nb) {
  int64_t n = n0;
  for (; n + C <= n1; n += C)
    for (int64_t b = b0; b + R <= b1; b += R) gemm_tile<Q4, R, C>(qs, d, m, bias, xq, dx, sx, out, b, n, N, nb);
  for (; n < n1; ++n)
    for (int64_t b = b0; b + R <= b1; b += R) gemm_tile<Q4, R, 1>(qs, d, m, bias, xq, dx, sx, out, b, n, N, nb);
}
#endif

// Activation rows quantised per block (quantize_rows), the input of every block product.
struct QuantRows {
  std::vector<int8_t> xq;
  std::vector<float> dx, sx;
  int64_t B, nb;
  QuantRows(int64_t rows, int64_t K) : xq(rows * K), dx(rows * (K / kBlock)), sx(rows * (K / kBlock)), B(rows), nb(K / kBlock) {}
  // Rows [lo, hi) of x [B, K]: each row's codes depend on that row alone.
  void set_rows(const float* x, int64_t lo, int64_t hi) {
    const int64_t K = nb * kBlock;
    quantize_rows(x + lo * K, hi - lo, K, xq.data() + lo * K, dx.data() + lo * nb, sx.data() + lo * nb);
  }
};

// One weight matrix [N, K] in blocks: codes, float16 scales d and (q4) minimums m as bits
// (m null for q8), bias float32 or null.
struct BlockMatrix {
  const uint8_t* qs;
  const uint16_t *d, *m;
  const float* bias;
  int64_t N, K;
  int64_t groups() const { return (N + kColumnGroup - 1) / kColumnGroup; }

  // out[b, n] = sum_blocks d[n,k] * dx[b,k] * dot(q[n,k], xq[b,k]) (+ m[n,k] * sx[b,k] for q4) + bias[n]
  // for the columns of groups [glo, ghi): one task's share. Each output's arithmetic does
  // not depend on how the groups are split, nor on the other rows.
  void groups_of(const QuantRows& x, float* out, int64_t glo, int64_t ghi) const {
    if (m != nullptr) {
      run<true>(x, out, glo, ghi);
    } else {
      run<false>(x, out, glo, ghi);
    }
  }

  void operator()(const QuantRows& x, float* out) const {
    const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, K * x.B * kColumnGroup));
    at::parallel_for(0, groups(), grain, [&](int64_t glo, int64_t ghi) { groups_of(x, out, glo, ghi); });
  }

 private:
  template <bool Q4>
  void run(const QuantRows& x, float* out, int64_t glo, int64_t ghi) const {
    const int64_t B = x.B, nb = K / kBlock;
    const int8_t* xq = x.xq.data();
    const float *dx = x.dx.data(), *sx = x.sx.data();
    const int64_t lo = glo * kColumnGroup, hi = std::min(N, ghi * kColumnGroup);
#if defined(OMNI_BLOCK_SIMD)
    const int64_t full = B - B % kRowTile;  // row tiles of 4, then the rest as one tile
    if (full > 0) gemm_rows_of<Q4, 4, 2>(qs, d, m, bias, xq, dx, sx, out, 0, full, lo, hi, N, nb);
    switch (B - full) {
      case 1: gemm_rows_of<Q4, 1, 1>(qs, d, m, bias, xq, dx, sx, out, full, B, lo, hi, N, nb); break;
      case 2: gemm_rows_of<Q4, 2, 2>(qs, d, m, bias, xq, dx, sx, out, full, B, lo, hi, N, nb); break;
      case 3: gemm_rows_of<Q4, 3, 2>(qs, d, m, bias, xq, dx, sx, out, full, B, lo, hi, N, nb); break;
      default: break;
    }
#else
    const int64_t row_bytes = Q4 ? K / 2 : K, block_bytes = Q4 ? 16 : 32;
    for (int64_t n = lo; n < hi; ++n) {
      const uint8_t* wq = qs + n * row_bytes;
      const uint16_t* dn = d + n * nb;
      const uint16_t* mn = Q4 ? m + n * nb : nullptr;
      for (int64_t b = 0; b < B; ++b) {
        float v = 0.f;
        for (int64_t k = 0; k < nb; ++k) {
          const int64_t xb = b * nb + k;
          int32_t dot = 0;
          for (int j = 0; j < kBlock; ++j) {
            int code;
            if (Q4) {
              const uint8_t byte = wq[k * block_bytes + (j % 16)];
              code = j < 16 ? (byte & 0x0F) : (byte >> 4);
            } else {
              code = static_cast<int8_t>(wq[k * block_bytes + j]);
            }
            dot += code * xq[xb * kBlock + j];
          }
          v += half_to_float(dn[k]) * dx[xb] * static_cast<float>(dot);
        }
        if (Q4) {
          const float* s = sx + b * nb;
          for (int64_t k = 0; k < nb; ++k) v += half_to_float(mn[k]) * s[k];
        }
        out[b * N + n] = v + (bias ? bias[n] : 0.f);
      }
    }
#endif
  }
};

// out[B, N] = x[B, K] times the blocks.
static void linear_blocks_rows(const float* x, int64_t B, int64_t K, const uint8_t* qs, const uint16_t* d, const uint16_t* m,
                               const float* bias, int64_t N, float* out) {
  if (B == 0) return;
  QuantRows rows(B, K);
  rows.set_rows(x, 0, B);
  BlockMatrix{qs, d, m, bias, N, K}(rows, out);
}

torch::Tensor linear_blocks(torch::Tensor x, torch::Tensor qs, torch::Tensor d, c10::optional<torch::Tensor> m,
                            c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [B, K]");
  const int64_t B = x.size(0), K = x.size(1), N = qs.size(0);
  TORCH_CHECK(K % kBlock == 0, "K must be a multiple of 32");
  auto out = torch::empty({B, N}, x.options());
  TORCH_CHECK(d.scalar_type() == at::kHalf && (!m.has_value() || m->scalar_type() == at::kHalf), "scales: float16");
  linear_blocks_rows(x.data_ptr<float>(), B, K, qs.data_ptr<uint8_t>(), half_bits(d), m.has_value() ? half_bits(*m) : nullptr, bias.has_value() ? bias->data_ptr<float>() : nullptr,
                     N, out.data_ptr<float>());
  return out;
}
"""

QUANT_FUNCTIONS = ["linear_blocks"]

# cpu_stack
STACK_SOURCE = r"""
// ---------------------------------------------------------------- the decode stack
struct StackLinear {
  at::Tensor codes, scale, minimum, bias;  // minimum: q4 only; bias: optional
  int64_t N = 0, K = 0;
  BlockMatrix matrix() const {
    return BlockMatrix{codes.data_ptr<uint8_t>(), half_bits(scale), minimum.defined() ? half_bits(minimum) : nullptr,
                       bias.defined() ? bias.data_ptr<float>() : nullptr, N, K};
  }
};

struct StackLayer {
  at::Tensor norm1, norm2;
  StackLinear qkv, o, gate_up, down;
};

class DecodeStack {
 public:
  // Per layer 18 entries: the two norm weights, then codes, scale, minimum, bias of
  // qkv, o, gate_up and down (minimum and bias may be None).
  DecodeStack(const std::vector<std::vector<c10::optional<torch::Tensor>>>& layers, torch::Tensor final_norm, double eps,
              int64_t heads, int64_t kv_heads, int64_t head_dim, double scale)
      : final_norm_(final_norm), eps_(static_cast<float>(eps)), H_(heads), KVH_(kv_heads), D_(head_dim),
        scale_(static_cast<float>(scale)) {
    for (const auto& t : layers) {
      TORCH_CHECK(t.size() == 18, "a stack layer has 18 entries");
      StackLayer layer;
      layer.norm1 = float_tensor(t[0]);
      layer.norm2 = float_tensor(t[1]);
      layer.qkv = linear(t, 2);
      layer.o = linear(t, 6);
      layer.gate_up = linear(t, 10);
      layer.down = linear(t, 14);
      layers_.push_back(layer);
    }
    TORCH_CHECK(!layers_.empty(), "a stack needs a layer");
    hidden_ = layers_[0].o.N;
    inter_ = layers_[0].gate_up.N / 2;
    for (const auto& l : layers_) {
      TORCH_CHECK(l.qkv.N == (H_ + 2 * KVH_) * D_ && l.qkv.K == hidden_ && l.o.K == H_ * D_ && l.o.N == hidden_ &&
                  l.gate_up.K == hidden_ && l.gate_up.N == 2 * inter_ && l.down.K == inter_ && l.down.N == hidden_,
                  "stack layer shapes disagree");
    }
  }

  // The final hidden states [B, hidden] (after the final norm) of one decode step: x the
  // input embeddings [B, hidden], cos/sin [B, D], the caches [slots, KVH, D] per layer,
  // pages [B, P] page ids, lens [B] context lengths (the new token included), slots [B]
  // where each row's new K/V go.
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, const std::vector<torch::Tensor>& k_caches,
                        const std::vector<torch::Tensor>& v_caches, torch::Tensor pages, int64_t page_size, torch::Tensor lens,
                        torch::Tensor slots) {
    const int64_t L = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == hidden_, "x: float32 [B, hidden]");
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == L && static_cast<int64_t>(v_caches.size()) == L, "one cache per layer");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "cos/sin: float32");
    const int64_t B = x.size(0), H = H_, KVH = KVH_, D = D_, W = (H + 2 * KVH) * D;
    for (int64_t i = 0; i < L; ++i) {
      const auto& kc = k_caches[i];
      const auto& vc = v_caches[i];
      TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat,
                  "caches: contiguous float32");
    }
    const auto opts = x.options();
    auto out = torch::empty({B, hidden_}, opts);
    Step st{k_caches, v_caches};
    st.resid = x.contiguous().clone();
    st.out = out;
    st.hidden = torch::empty({B, hidden_}, opts);
    st.delta = torch::empty({B, hidden_}, opts);
    st.qkv = torch::empty({B, W}, opts);
    st.q = torch::empty({B, H, D}, opts);
    st.k = torch::empty({B, KVH, D}, opts);
    st.attn = torch::empty({B, H * D}, opts);
    st.gu = torch::empty({B, 2 * inter_}, opts);
    st.act = torch::empty({B, inter_}, opts);
    st.cos = cos.contiguous();
    st.sin = sin.contiguous();
    st.pages = pages.to(at::kLong).contiguous();
    st.lens = lens.to(at::kLong).contiguous();
    st.slots = slots.to(at::kLong).contiguous();
    st.page_size = page_size;
    if (B == 0) return out;
    // With the row split set (set_rows_per_thread) and many rows: each thread takes whole
    // rows through every layer, one OpenMP region for the step with no barrier inside it
    // (a row's arithmetic does not depend on which rows share its call: the same bits).
    // Each thread streams all the weights itself. Otherwise: one call for all rows, each
    // GEMM and attention a region of its own split by columns and heads.
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    if (threads > 1 && rows_per_thread_ > 0 && B >= rows_per_thread_ * threads) {
      at::parallel_for(0, B, (B + threads - 1) / threads, [&](int64_t lo, int64_t hi) { rows(st, lo, hi); });
    } else {
      rows(st, 0, B);
    }
    return out;
  }

  int64_t rows_per_thread() const { return rows_per_thread_; }
  // 0 turns the row split off (every step split by columns and heads).
  void set_rows_per_thread(int64_t rows) { rows_per_thread_ = std::max<int64_t>(0, rows); }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  // The rows a step splits across threads only from this many rows per thread up; 0
  // never. The engine sets it (kernels/cpu_stack.py's row_split_rows: on at 2 threads):
  // each thread streams all the weights, bytes that grow with the threads and the model.
  int64_t rows_per_thread_ = 0;

  // One step's inputs and scratch, every row's; a rows() call uses its own rows' share.
  struct Step {
    const std::vector<torch::Tensor>& k_caches;
    const std::vector<torch::Tensor>& v_caches;
    at::Tensor resid, out, hidden, delta, qkv, q, k, attn, gu, act, cos, sin, pages, lens, slots;
    int64_t page_size = 0;
  };

  // Rows [b0, b1) of the step through every layer and the final norm. Inside an OpenMP
  // region (the row split) each at::parallel_for below runs on the calling thread.
  void rows(const Step& st, int64_t b0, int64_t b1) const {
    const int64_t n = b1 - b0, H = H_, KVH = KVH_, D = D_, W = (H + 2 * KVH) * D, hid = hidden_, inter = inter_;
    if (n <= 0) return;
    float* r = st.resid.data_ptr<float>() + b0 * hid;
    float* h = st.hidden.data_ptr<float>() + b0 * hid;
    float* dl = st.delta.data_ptr<float>() + b0 * hid;
    float* qkvp = st.qkv.data_ptr<float>() + b0 * W;
    float* qp = st.q.data_ptr<float>() + b0 * H * D;
    float* kp = st.k.data_ptr<float>() + b0 * KVH * D;
    float* ap = st.attn.data_ptr<float>() + b0 * H * D;
    float* gup = st.gu.data_ptr<float>() + b0 * 2 * inter;
    float* actp = st.act.data_ptr<float>() + b0 * inter;
    const float* cp = st.cos.data_ptr<float>() + b0 * D;
    const float* sp = st.sin.data_ptr<float>() + b0 * D;
    const int64_t P = st.pages.size(1);
    const int64_t* pagep = st.pages.data_ptr<int64_t>() + b0 * P;
    const int64_t* lenp = st.lens.data_ptr<int64_t>() + b0;
    const int64_t* slotp = st.slots.data_ptr<int64_t>() + b0;
    auto attend = D == 64 ? decode_tasks<float, 64> : D == 128 ? decode_tasks<float, 128> : decode_tasks<float, 0>;
    const int64_t heads_per_task = decode_heads_per_task(n, H, KVH), tasks = n * (H / heads_per_task);
    QuantRows xa(n, hid), xo(n, H * D), xd(n, inter);  // the inputs of qkv and gate_up, of o, of down
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& layer = layers_[i];
      float* kc = st.k_caches[i].data_ptr<float>();
      float* vc = st.v_caches[i].data_ptr<float>();
      add_rms_norm_rows<float>(r, i == 0 ? nullptr : dl, layer.norm1.data_ptr<float>(), r, h, n, hid, eps_);
      xa.set_rows(h, 0, n);
      layer.qkv.matrix()(xa, qkvp);
      rope_store_rows<float>(qkvp, qkvp + H * D, qkvp + (H + KVH) * D, cp, sp, qp, kp, kc, vc, slotp, n, H, KVH, D, W, D, W, D, W, D);
      at::parallel_for(0, tasks, 1, [&](int64_t lo, int64_t hi) {
        attend(qp, kc, vc, pagep, lenp, ap, H, D, KVH, P, st.page_size, scale_, heads_per_task, lo, hi);
      });
      xo.set_rows(ap, 0, n);
      layer.o.matrix()(xo, dl);
      add_rms_norm_rows<float>(r, dl, layer.norm2.data_ptr<float>(), r, h, n, hid, eps_);
      xa.set_rows(h, 0, n);
      layer.gate_up.matrix()(xa, gup);
      silu_mul_rows<float>(gup, actp, n, inter);
      xd.set_rows(actp, 0, n);
      layer.down.matrix()(xd, dl);
    }
    add_rms_norm_rows<float>(r, dl, final_norm_.data_ptr<float>(), r, st.out.data_ptr<float>() + b0 * hid, n, hid, eps_);
  }

  static at::Tensor float_tensor(const c10::optional<torch::Tensor>& t) {
    TORCH_CHECK(t.has_value() && t->scalar_type() == at::kFloat && t->is_contiguous(), "a contiguous float32 tensor");
    return *t;
  }
  static at::Tensor half_tensor(const c10::optional<torch::Tensor>& t) {
    TORCH_CHECK(t.has_value() && t->scalar_type() == at::kHalf && t->is_contiguous(), "a contiguous float16 tensor");
    return *t;
  }
  static StackLinear linear(const std::vector<c10::optional<torch::Tensor>>& t, size_t at) {
    StackLinear out;
    TORCH_CHECK(t[at].has_value() && t[at]->scalar_type() == at::kByte && t[at]->is_contiguous(), "codes: contiguous uint8");
    out.codes = *t[at];
    out.scale = half_tensor(t[at + 1]);
    if (t[at + 2].has_value()) out.minimum = half_tensor(t[at + 2]);
    if (t[at + 3].has_value()) out.bias = float_tensor(t[at + 3]);
    out.N = out.codes.size(0);
    out.K = out.scale.size(1) * kBlock;
    TORCH_CHECK(out.codes.size(1) == (out.minimum.defined() ? out.K / 2 : out.K), "codes and scales disagree");
    return out;
  }

  std::vector<StackLayer> layers_;
  at::Tensor final_norm_;
  float eps_;
  int64_t H_, KVH_, D_, hidden_ = 0, inter_ = 0;
  float scale_;
};
"""

STACK_BINDINGS = r"""
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<const std::vector<std::vector<c10::optional<torch::Tensor>>>&, torch::Tensor, double, int64_t, int64_t, int64_t,
                    double>())
      .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>())
      .def("num_layers", &DecodeStack::num_layers)
      .def("rows_per_thread", &DecodeStack::rows_per_thread)
      .def("set_rows_per_thread", &DecodeStack::set_rows_per_thread);
"""
