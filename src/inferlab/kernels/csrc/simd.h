// AVX2 helpers shared by the kernels: 8 elements of any stored type as 8 float32 lanes, and a
// horizontal sum. Header-only and inline; each kernel file includes it.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <cstdint>

namespace inferlab_simd {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const at::BFloat16* p) {  // bfloat16 is the top half of a float32
  __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
inline __m256 load8(const int8_t* p) {
  __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}
inline float to_float(float v) { return v; }
inline float to_float(at::Half v) { return static_cast<float>(v); }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(int8_t v) { return static_cast<float>(v); }

inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace inferlab_simd
