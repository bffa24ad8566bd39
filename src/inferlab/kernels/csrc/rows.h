// The per-row arithmetic of the decoder layer's small operators, shared by fused.cpp (one
// operator per call) and decoder_step.cpp (a whole decode step per call), so both paths compute
// the same numbers in the same order.
#pragma once

#include <immintrin.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace inferlab_rows {

// out[j] = x[j] / rms(x) * w[j], rms(x) = sqrt(mean(x^2) + eps). out may be x.
inline void rms_norm_row(const float* x, const float* w, int64_t n, float eps, float* out) {
  float ss = 0.f;
  for (int64_t j = 0; j < n; ++j) ss += x[j] * x[j];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j) out[j] = x[j] * inv * w[j];
}

// out[j] = x[j] * c[j] + rot(x)[j] * s[j], rot(x) = [-x2, x1] (Hugging Face's rotate-half).
// out must not alias x.
inline void rope_row(const float* x, const float* c, const float* s, float* out, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t j = 0; j < h; ++j) out[j] = x[j] * c[j] - x[j + h] * s[j];
  for (int64_t j = h; j < d; ++j) out[j] = x[j] * c[j] + x[j - h] * s[j];
}

// out[j] = silu(g[j]) * u[j] = g u / (1 + exp(-g)), 8 lanes at a time with the vector exp.
inline void silu_mul_row(const float* g, const float* u, int64_t n, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 gv = _mm256_loadu_ps(g + j);
    const __m256 den = _mm256_add_ps(one, inferlab_simd::exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
    _mm256_storeu_ps(out + j, _mm256_div_ps(_mm256_mul_ps(gv, _mm256_loadu_ps(u + j)), den));
  }
  for (; j < n; ++j) out[j] = g[j] * u[j] / (1.f + std::exp(-g[j]));
}

// A float32 row into a K/V cache row of float32, float16 or bfloat16 (round to nearest even).
inline void store_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, sizeof(float) * n); }
inline void store_row(const float* src, at::Half* dst, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; j < n; ++j) dst[j] = static_cast<at::Half>(src[j]);
}
inline void store_row(const float* src, at::BFloat16* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<at::BFloat16>(src[j]);
}

// A float32 row into int8 codes and its one scale: the int8 K/V cache's format, with the
// arithmetic of models/kv_cache.py's quantize_kv, so every writer stores the same codes:
// scale = max|x| / 127, code = round-half-even(x / scale) (a zero row: scale 0, codes 0).
// True division and vroundps (round to nearest even, as torch.round), 8 lanes at a time: a
// libm nearbyintf call per value cost ~0.4 ms of a 1-stream decode step (30 layers).
inline void quantize_row(const float* src, int8_t* dst, float* scale, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 mv = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_andnot_ps(sign, _mm256_loadu_ps(src + j)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  float amax = 0.f;
  for (float v : lanes) amax = std::max(amax, v);
  for (; j < n; ++j) amax = std::max(amax, std::fabs(src[j]));
  const float s = amax / 127.f;
  const float div = std::max(s, std::numeric_limits<float>::min());
  const __m256 dv = _mm256_set1_ps(div), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  alignas(32) int32_t codes[8];
  for (j = 0; j + 8 <= n; j += 8) {
    __m256 c = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(src + j), dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    c = _mm256_min_ps(hi, _mm256_max_ps(lo, c));
    _mm256_store_si256(reinterpret_cast<__m256i*>(codes), _mm256_cvtps_epi32(c));
    for (int i = 0; i < 8; ++i) dst[j + i] = static_cast<int8_t>(codes[i]);
  }
  for (; j < n; ++j) dst[j] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(src[j] / div))));
  *scale = s;
}

// One K or V row into its cache slot: converted (a float cache; `scale` is unused and may be
// null) or quantized with its scale written to `scale` (an int8 cache).
template <typename C>
inline void store_kv_row(const float* src, C* dst, float* /*scale*/, int64_t n) {
  store_row(src, dst, n);
}
inline void store_kv_row(const float* src, int8_t* dst, float* scale, int64_t n) { quantize_row(src, dst, scale, n); }

}  // namespace inferlab_rows
