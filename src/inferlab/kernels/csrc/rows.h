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
// The sum of squares in 16 (AVX-512) or 8 (AVX2) lanes: a scalar sum is one serial chain of
// dependent adds (~4 cycles each), which made the norms of a 512-token prefill step take ~10 ms
// of its ~220 on the Zen 5 kind; the lanes change the sum's rounding order only.
inline void rms_norm_row(const float* x, const float* w, int64_t n, float eps, float* out) {
  int64_t j = 0;
  float ss = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  ss = _mm512_reduce_add_ps(acc);
#else
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  ss = inferlab_simd::hsum(acc);
#endif
  for (; j < n; ++j) ss += x[j] * x[j];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  j = 0;
#if defined(__AVX512F__)
  const __m512 iv = _mm512_set1_ps(inv);
  for (; j + 16 <= n; j += 16)
    _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + j), iv), _mm512_loadu_ps(w + j)));
#endif
  for (; j < n; ++j) out[j] = x[j] * inv * w[j];
}

// x[j] += r[j], r float32 or bfloat16 (widened exactly): the residual add before a norm.
inline void add_row(float* x, const float* r, int64_t n) {
  for (int64_t j = 0; j < n; ++j) x[j] += r[j];
}
inline void add_row(float* x, const at::BFloat16* r, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + j)));
    _mm512_storeu_ps(x + j, _mm512_add_ps(_mm512_loadu_ps(x + j), _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))));
  }
#endif
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(x + j, _mm256_add_ps(_mm256_loadu_ps(x + j), inferlab_simd::load8(r + j)));
  for (; j < n; ++j) x[j] += static_cast<float>(r[j]);
}

// A bfloat16 row widened to float32 (exact).
inline void widen_row(const at::BFloat16* src, float* dst, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(dst + j, inferlab_simd::load8(src + j));
  for (; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

// out[j] = x[j] * c[j] + rot(x)[j] * s[j], rot(x) = [-x2, x1] (Hugging Face's rotate-half).
// out must not alias x.
inline void rope_row(const float* x, const float* c, const float* s, float* out, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t j = 0; j < h; ++j) out[j] = x[j] * c[j] - x[j + h] * s[j];
  for (int64_t j = h; j < d; ++j) out[j] = x[j] * c[j] + x[j - h] * s[j];
}

// out[j] = silu(g[j]) * u[j] = g u / (1 + exp(-g)), 16 (AVX-512) or 8 lanes at a time with the
// vector exp (exp16 is exp8's arithmetic lane for lane, so both variants' lanes agree bitwise).
#if defined(__AVX512F__)
// 16 lanes of it: also the amx variant's gate/up product epilogue (linear.cpp linear_panels_silu),
// so that both give the same bits.
inline __m512 silu_mul16(__m512 gv, __m512 uv) {
  const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), inferlab_simd::exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv)));
  return _mm512_div_ps(_mm512_mul_ps(gv, uv), den);
}
#endif

inline void silu_mul_row(const float* g, const float* u, int64_t n, float* out) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(out + j, silu_mul16(_mm512_loadu_ps(g + j), _mm512_loadu_ps(u + j)));
#endif
  const __m256 one = _mm256_set1_ps(1.0f);
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
// Round to nearest even, 16 lanes by vcvtneps2bf16 where the CPU has it (the AVX-512 variant),
// else 8 by the integer rounding c10's BFloat16 does (NaN kept a quiet NaN): the scalar cast per
// value cost more than the norm it ends.
inline void store_row(const float* src, at::BFloat16* dst, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512BF16__)
  for (; j + 16 <= n; j += 16) {
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + j));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), reinterpret_cast<const __m256i&>(v));
  }
#endif
  const __m256i lsb = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff), qnan = _mm256_set1_epi32(0x7fc0);
  for (; j + 8 <= n; j += 8) {
    const __m256 f = _mm256_loadu_ps(src + j);
    const __m256i b = _mm256_castps_si256(f);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(b, 16), lsb))), 16);
    r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j), packed);
  }
  for (; j < n; ++j) dst[j] = static_cast<at::BFloat16>(src[j]);
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
