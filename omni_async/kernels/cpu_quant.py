"""Linear layers over block-quantised weights, read directly by C++ CPU kernels.

Why: a batch-1 decode step on a small CPU streams every weight once per token, so its
speed is the weights' size over the memory bandwidth. SmolLM2-135M in float32 is 0.54 GB
a token; in 4-bit blocks it is 0.085 GB. The weights stay in blocks of 32 values along
the input dimension and are unpacked in registers:

- ``q4``: 4-bit unsigned codes with a float32 scale and minimum per block
  (``w = d * q + m``, llama.cpp's Q4_1 arrangement). A GGUF file stored in Q4_1 comes
  back from its float32 dequantisation block for block (the same codes, scale and
  minimum up to float32 rounding), so nothing is lost against the file.
- ``q8``: signed 8-bit codes with a float32 scale per block (``w = d * q``, Q8_0's).

Each activation row is quantised per block of 32 to int8 with its own scale (and its
exact float sum kept for the ``m`` term), then every block's dot product is an integer
multiply-add (AVX2 ``maddubs``) scaled once. Per-row, per-block scales keep a request's
result independent of what else is in the batch. Built with the system compiler like
the other CPU kernels (:mod:`.cpu_build`); a portable C++ loop serves CPUs without AVX2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


BLOCK = 32
FORMATS = ("q4", "q8")

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

static constexpr int64_t kBlock = 32;
static constexpr int64_t kRowTile = 4;  // activation rows sharing one unpacked weight block

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

#if defined(__AVX2__)
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// The 32 codes of one weight block as bytes, and the signed source for maddubs.
template <bool Q4> static inline __m256i unpack(const uint8_t* q) {
  if constexpr (Q4) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  }
}
template <bool Q4> static inline __m256 block_dot(__m256i w, const int8_t* xq) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  __m256i p;
  if constexpr (Q4) {
    p = _mm256_maddubs_epi16(w, x);  // codes 0..15 are unsigned
  } else {
    p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  }
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
#endif

// out[b, n] = sum_blocks d[n,k] * dx[b,k] * dot(q[n,k], xq[b,k]) (+ m[n,k] * sx[b,k] for q4) + bias[n]
template <bool Q4>
static void gemm_rows(const uint8_t* qs, const float* d, const float* m, const float* bias, const int8_t* xq,
                      const float* dx, const float* sx, float* out, int64_t B, int64_t N, int64_t K) {
  const int64_t nb = K / kBlock, row_bytes = Q4 ? K / 2 : K, block_bytes = Q4 ? 16 : 32;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, K * B));
  at::parallel_for(0, N, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) {
      const uint8_t* wq = qs + n * row_bytes;
      const float* dn = d + n * nb;
      const float* mn = Q4 ? m + n * nb : nullptr;
      for (int64_t b0 = 0; b0 < B; b0 += kRowTile) {
        const int64_t rows = std::min(kRowTile, B - b0);
        float result[kRowTile] = {0.f, 0.f, 0.f, 0.f};
#if defined(__AVX2__)
        __m256 acc[kRowTile] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t k = 0; k < nb; ++k) {
          const __m256i w = unpack<Q4>(wq + k * block_bytes);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t xb = (b0 + r) * nb + k;
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dn[k] * dx[xb]), block_dot<Q4>(w, xq + xb * kBlock), acc[r]);
          }
        }
        for (int64_t r = 0; r < rows; ++r) result[r] = hsum(acc[r]);
#else
        for (int64_t k = 0; k < nb; ++k) {
          int codes[kBlock];
          for (int j = 0; j < kBlock; ++j) {
            if (Q4) {
              const uint8_t byte = wq[k * block_bytes + (j % 16)];
              codes[j] = j < 16 ? (byte & 0x0F) : (byte >> 4);
            } else {
              codes[j] = static_cast<int8_t>(wq[k * block_bytes + j]);
            }
          }
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t xb = (b0 + r) * nb + k;
            int32_t dot = 0;
            for (int j = 0; j < kBlock; ++j) dot += codes[j] * xq[xb * kBlock + j];
            result[r] += dn[k] * dx[xb] * static_cast<float>(dot);
          }
        }
#endif
        for (int64_t r = 0; r < rows; ++r) {
          float v = result[r];
          if (Q4) {
            const float* s = sx + (b0 + r) * nb;
            for (int64_t k = 0; k < nb; ++k) v += mn[k] * s[k];
          }
          out[(b0 + r) * N + n] = v + (bias ? bias[n] : 0.f);
        }
      }
    }
  });
}

// out[B, N] = x[B, K] times the blocks (m: the q4 minimums, null for q8; bias may be null).
static void linear_blocks_rows(const float* x, int64_t B, int64_t K, const uint8_t* qs, const float* d, const float* m,
                               const float* bias, int64_t N, float* out) {
  if (B == 0) return;
  const int64_t nb = K / kBlock;
  std::vector<int8_t> xq(B * K);
  std::vector<float> dx(B * nb), sx(B * nb);
  quantize_rows(x, B, K, xq.data(), dx.data(), sx.data());
  if (m != nullptr) {
    gemm_rows<true>(qs, d, m, bias, xq.data(), dx.data(), sx.data(), out, B, N, K);
  } else {
    gemm_rows<false>(qs, d, nullptr, bias, xq.data(), dx.data(), sx.data(), out, B, N, K);
  }
}

torch::Tensor linear_blocks(torch::Tensor x, torch::Tensor qs, torch::Tensor d, c10::optional<torch::Tensor> m,
                            c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [B, K]");
  const int64_t B = x.size(0), K = x.size(1), N = qs.size(0);
  TORCH_CHECK(K % kBlock == 0, "K must be a multiple of 32");
  auto out = torch::empty({B, N}, x.options());
  linear_blocks_rows(x.data_ptr<float>(), B, K, qs.data_ptr<uint8_t>(), d.data_ptr<float>(),
                     m.has_value() ? m->data_ptr<float>() : nullptr, bias.has_value() ? bias->data_ptr<float>() : nullptr,
                     N, out.data_ptr<float>());
  return out;
}
"""

FUNCTIONS = ["linear_blocks"]


def load() -> Any:
    """The compiled CPU kernels (:mod:`.cpu_kernels`; built on first call); ConfigError
    when they cannot be built."""
    from .cpu_kernels import load as load_all

    return load_all()


@dataclass
class BlockWeights:
    """One weight matrix ``[N, K]`` in blocks of 32 along K: ``codes`` (uint8; q4 packs
    element j and j+16 of a block into one byte's low and high nibble), per-block
    ``scale`` and, for q4, ``minimum`` (float32 ``[N, K/32]``)."""

    format: str
    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None
    bias: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        extra = 0 if self.minimum is None else self.minimum.numel() * 4
        return self.codes.numel() + self.scale.numel() * 4 + extra

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix these blocks stand for (tests, and the reference)."""
        n = self.codes.shape[0]
        if self.format == "q4":
            c = self.codes.view(n, -1, 16)
            q = torch.cat([c & 0x0F, c >> 4], dim=-1).to(torch.float32)
            return (q * self.scale[..., None] + self.minimum[..., None]).reshape(n, -1)
        q = self.codes.view(torch.int8).view(n, -1, BLOCK).to(torch.float32)
        return (q * self.scale[..., None]).reshape(n, -1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).to(torch.float32).contiguous()
        out = load().linear_blocks(rows, self.codes, self.scale, self.minimum, self.bias)
        return out.view(*shape[:-1], out.shape[-1]).to(x.dtype)


def quantize(weight: torch.Tensor, format: str, bias: torch.Tensor | None = None) -> BlockWeights:
    """``weight`` ``[N, K]`` (K a multiple of 32) in blocks. q4 takes each block's min and
    max as llama.cpp's Q4_1 does (``d = (max - min) / 15``), so a Q4_1 source comes back
    with its own codes."""
    if format not in FORMATS:
        raise ValueError(f"unknown block format {format!r}")
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"input dimension {k} is not a multiple of {BLOCK}")
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    b = None if bias is None else bias.detach().to(torch.float32).contiguous()
    if format == "q8":
        scale = blocks.abs().amax(dim=-1) / 127.0
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = torch.round(blocks * inv[..., None]).clamp(-127, 127).to(torch.int8)
        return BlockWeights("q8", q.reshape(n, k).view(torch.uint8).contiguous(), scale.contiguous(), None, b)
    lo, hi = blocks.amin(dim=-1), blocks.amax(dim=-1)
    scale = (hi - lo) / 15.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round((blocks - lo[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return BlockWeights("q4", packed.reshape(n, k // 2).contiguous(), scale.contiguous(), lo.contiguous(), b)
