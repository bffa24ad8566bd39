// bf16 rounding and the bf16 softmax row, shared by prefill attention (prefill_attention.cpp's
// bf16 flavour) and decode attention over a bf16 cache (attention.h): both round Q, K, P and V
// to bf16 the same way and sum in float32, so a token's attention has the same numerics whether
// its context was attended in a prefill chunk or a decode step. The avx512 variant only.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
namespace inferlab_bf16 {

// exp(s - m) for a row of scores s <= m, as 2^n * p(f) (t = (s - m) log2 e = n + f, |f| <= 1/2,
// p a degree-4 fit of 2^f, relative error 2.8e-6, and vscalefps for the 2^n): the weights are
// rounded to bf16 (2^-9) right after, so exp16's float32-exact degree-5 polynomial, clamps and
// two-step reduction (~17 instructions for 16 values, against 8 here) bought nothing; the softmax
// was a third of a 1,024-token prefill's attention time.
inline __m512 exp_shifted16(__m512 s, __m512 m_log2e) {
  const __m512 t = _mm512_fmsub_ps(s, _mm512_set1_ps(1.44269504088896341f), m_log2e);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.00958285f), f, _mm512_set1_ps(0.05590643f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24024099f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931242f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline uint16_t to_bf16(float f) {  // round to nearest even, as vcvtneps2bf16 does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// One row of d values to bf16 (round to nearest even), 16 at a time.
inline void row_to_bf16(const float* r, int64_t d, uint16_t* out) {
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(r + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)b);
  }
  for (; i < d; ++i) out[i] = to_bf16(r[i]);
}
inline void row_to_bf16(const at::Half* r, int64_t d, uint16_t* out) {
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(f));
  }
  for (; i < d; ++i) out[i] = to_bf16(static_cast<float>(r[i]));
}
inline void row_to_bf16(const at::BFloat16* r, int64_t d, uint16_t* out) {
  std::memcpy(out, r, sizeof(uint16_t) * d);
}

// exp(s - m) of one block row's first c scores, rounded to bf16 into p, 0 from c to nb (nb is
// c rounded up to 16s); returns the sum of the rounded values, so the weights P V uses sum to
// exactly 1. The tail (c not a multiple of 16) masked: its lanes store 0 and add nothing.
inline float softmax_row_bf16(const float* s, uint16_t* p, int64_t c, int64_t nb, float m) {
  const __m512 mb = _mm512_set1_ps(m * 1.44269504088896341f);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t k = 0; k < c; k += 16) {
    const __mmask16 live = c - k >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (c - k)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(live, exp_shifted16(_mm512_maskz_loadu_ps(live, s + k), mb));
    const __m256i ei = (__m256i)_mm512_cvtneps_pbh(e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + k), ei);
    sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(ei), 16)));
  }
  std::fill(p + c, p + nb, uint16_t{0});
  return _mm512_reduce_add_ps(sum);
}

}  // namespace inferlab_bf16
#endif
