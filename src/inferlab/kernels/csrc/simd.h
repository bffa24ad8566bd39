// AVX2 helpers shared by the kernels: 8 elements of any stored type as 8 float32 lanes, a
// horizontal sum and max, int32 -> int8 packing, and exp on 8 lanes. Header-only and inline;
// each kernel file includes it.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

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

// 32 int32 values (4 vectors of 8) to 32 int8 in order (saturating): the packs interleave
// 128-bit lanes, the permute puts them back.
inline __m256i pack32(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// The same for values in [0, 255], to uint8 (w8a8's x codes, q + 128).
inline __m256i pack32u(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
  return _mm256_permutevar8x32_epi32(_mm256_packus_epi16(ab, cd), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline float hmax(__m256 v) {  // the largest of the 8 lanes
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp on 8 floats: Cody-Waite range reduction and Cephes' degree-5 polynomial (~1 ulp), the
// input clamped to [-87, 88] so 2^n stays a normal float. gcc does not vectorise std::exp, and
// a scalar exp per element made silu_mul 3x slower than torch's at 2,048 rows.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

#if defined(__AVX512F__)
// exp16: exp8 on 512-bit registers (the avx512 variant).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
#endif

// Runs tile(std::integral_constant<int, MB>{}, m) over the M rows of x in blocks of Max rows
// (the micro-kernel's register budget), then once over the MB = M % Max rows left: each tile size
// a compile-time constant, so its accumulators stay in registers.
template <int N, typename F>
inline void tail_tile(int64_t rest, int64_t m, F& tile) {
  if constexpr (N > 0) {
    if (rest == N) tile(std::integral_constant<int, N>{}, m);
    else tail_tile<N - 1>(rest, m, tile);
  }
}

template <int Max, typename F>
inline void for_row_tiles(int64_t M, F&& tile) {
  int64_t m = 0;
  for (; m + Max <= M; m += Max) tile(std::integral_constant<int, Max>{}, m);
  tail_tile<Max - 1>(M - m, m, tile);
}

// The largest of x[0 .. n). Four running maxima, 32 values a step: one vmaxps chain waited on
// its own latency (a 32-row greedy step's 49,152 logits a row: linear_panels_i8_argmax's
// reduction 0.22 -> ~0.06 ms of its ~1.4).
inline float row_max(const float* x, int64_t n) {
  const __m256 lowest = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 m0 = lowest, m1 = lowest, m2 = lowest, m3 = lowest;
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    m0 = _mm256_max_ps(m0, _mm256_loadu_ps(x + j));
    m1 = _mm256_max_ps(m1, _mm256_loadu_ps(x + j + 8));
    m2 = _mm256_max_ps(m2, _mm256_loadu_ps(x + j + 16));
    m3 = _mm256_max_ps(m3, _mm256_loadu_ps(x + j + 24));
  }
  __m256 m = _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3));
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float best = lanes[0];
  for (int i = 1; i < 8; ++i) best = std::max(best, lanes[i]);
  for (; j < n; ++j) best = std::max(best, x[j]);
  return best;
}

// The first index of the maximum (torch.argmax's choice): the sampler's greedy token
// (sampler.cpp), and linear_panels_i8_argmax's per chunk of columns (linear.cpp).
inline int64_t row_argmax(const float* x, int64_t n) {
  const float best = row_max(x, n);
  const __m256 b = _mm256_set1_ps(best);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), b, _CMP_EQ_OQ));
    if (mask) return j + __builtin_ctz(mask);
  }
  for (; j < n; ++j)
    if (x[j] == best) return j;
  return 0;  // an all-NaN row
}

}  // namespace inferlab_simd
