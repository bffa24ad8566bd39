// 4-bit group-wise weights (weight_dtype int4): the decode products and the dequantization
// that the prefill GEMM and the plain-torch fallback share. Used by linear.cpp (linear_w4) and
// decoder_step.cpp (uint8 codes + float16 (d, m) pairs).
//
// The format, per output row and group of 32 consecutive input features g:
//   codes  uint8 [N, K / 2]: byte 16 g + j holds q[32 g + j] in its low nibble and q[32 g + j + 16]
//          in its high one (j < 16): GGUF's Q4_0 / Q4_1 order, so those blocks' bytes are ours as
//          they are; one AND gives elements 0..15 of a group, a shift and an AND 16..31.
//   dm     float16 [N, K / 32, 2]: (d, m) per group; w = d * q + m, q in 0..15.
// 16 + 4 bytes per 32 weights: 5 bits per weight.
//
// Why an integer dot product: x is quantized per group of 32 to int8 (symmetric, one float scale
// s_g per group, and its group sums S_g), so that a group's products are one vpdpbusd pair
// (AVX-512 VNNI: unsigned codes x signed int8, 64 per instruction, no offset trick needed) or
// vpmaddubsw + vpmaddwd (AVX2), and
//   y = sum_g d_g s_g dot_g(q, xq) + m_g s_g S_g.
// x is laid out per call in the order the nibbles unpack to (kQ4Chunk groups at a time: their
// 16 low-nibble elements, then their 16 high ones), with each group's s_g and s_g S_g / 4
// repeated over the 4 int32 lanes a group's sums land in, so each chunk is a few FMAs.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace inferlab_q4 {

constexpr int64_t kQ4Group = 32;  // weights per (d, m) pair
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
constexpr int64_t kQ4Chunk = 4;  // groups per vector step: 64 code bytes, one zmm
constexpr int kRowsXQ4 = 4;      // x rows per tile: 16 sums + 4 weight registers + x, of 32 zmm
#else
constexpr int64_t kQ4Chunk = 2;  // 32 code bytes, one ymm
constexpr int kRowsXQ4 = 2;      // 8 sums + 4 weight registers + x, of 16 ymm
#endif
constexpr int64_t kQ4Lanes = kQ4Chunk * 4;  // int32 lanes per chunk (4 per group)
constexpr int kRowsWQ4 = 4;                 // weight rows per block (one hsum4)
constexpr int64_t kQ4PrefetchBytes = 8192;

inline int64_t q4_groups(int64_t K) { return K / kQ4Group; }
inline int64_t q4_chunks(int64_t K) { return (q4_groups(K) + kQ4Chunk - 1) / kQ4Chunk; }

// x quantized for the products: M rows, each chunks * kQ4Chunk * 32 int8 codes (zero-padded) and
// chunks * kQ4Lanes lane scales s and lane offsets c = s * S / 4.
struct Q4X {
  std::vector<int8_t> q;
  std::vector<float> s, c;
  int64_t M = 0, K = 0, ldq = 0, lds = 0;
};

inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// One row of x (K floats, K a multiple of 32) into row i of xq: per group s = max|x| / 127,
// q = round(x / s) (to nearest even), S = sum q.
inline void quantize_x_row(const float* x, int64_t K, Q4X& xq, int64_t i) {
  int8_t* qrow = xq.q.data() + i * xq.ldq;
  float* srow = xq.s.data() + i * xq.lds;
  float* crow = xq.c.data() + i * xq.lds;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t g = 0; g < q4_groups(K); ++g) {
    const float* xg = x + g * kQ4Group;
    __m256 v[4], mx = _mm256_setzero_ps();
    for (int t = 0; t < 4; ++t) {
      v[t] = _mm256_loadu_ps(xg + 8 * t);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[t]));
    }
    const float amax = inferlab_simd::hmax(mx);
    const float s = amax / 127.f;
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i qi[4];
    for (int t = 0; t < 4; ++t) qi[t] = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], inv));
    const int32_t sum = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3])));
    const __m256i q8 = inferlab_simd::pack32(qi[0], qi[1], qi[2], qi[3]);
    const int64_t c = g / kQ4Chunk, p = g % kQ4Chunk;
    int8_t* base = qrow + c * kQ4Chunk * kQ4Group;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(base + p * 16), _mm256_castsi256_si128(q8));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(base + kQ4Chunk * 16 + p * 16), _mm256_extracti128_si256(q8, 1));
    for (int l = 0; l < 4; ++l) {
      srow[c * kQ4Lanes + p * 4 + l] = s;
      crow[c * kQ4Lanes + p * 4 + l] = s * static_cast<float>(sum) * 0.25f;
    }
  }
}

// All M rows of x (row stride K) into xq, resized as needed; the padding past the last group zero.
inline void quantize_x(const float* x, int64_t M, int64_t K, Q4X& xq) {
  const int64_t chunks = q4_chunks(K);
  xq.M = M, xq.K = K, xq.ldq = chunks * kQ4Chunk * kQ4Group, xq.lds = chunks * kQ4Lanes;
  if (xq.q.size() < static_cast<size_t>(M * xq.ldq)) xq.q.resize(M * xq.ldq);
  if (xq.s.size() < static_cast<size_t>(M * xq.lds)) xq.s.resize(M * xq.lds), xq.c.resize(M * xq.lds);
  for (int64_t i = 0; i < M; ++i) {
    std::fill_n(xq.q.data() + i * xq.ldq, xq.ldq, int8_t{0});
    std::fill_n(xq.s.data() + i * xq.lds, xq.lds, 0.f);
    std::fill_n(xq.c.data() + i * xq.lds, xq.lds, 0.f);
    quantize_x_row(x + i * K, K, xq, i);
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
inline __m256 q4_fold(__m512 a) { return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)); }

// out[i][j] = row m0 + i of x . weight row j, for MB rows of xq and NB (4 or 1) weight rows
// (codes w + j * ldw bytes, pairs dm + j * ldm halves); `stream`: prefetch the codes ahead.
template <int MB, int NB>
inline void dot_tile_q4(const Q4X& xq, int64_t m0, const uint8_t* w, int64_t ldw, const uint16_t* dm, int64_t ldm,
                        bool stream, float out[][kRowsWQ4]) {
  const int64_t groups = q4_groups(xq.K), chunks = q4_chunks(xq.K);
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i idx_d = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
  const __m512i idx_m = _mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7);
  const char* pf = reinterpret_cast<const char*>(w) + kQ4PrefetchBytes;
  // the (d, m) pairs are a second stream (a fifth of the bytes): prefetched as many rows ahead
  const char* pfd = reinterpret_cast<const char*>(dm + std::max<int64_t>(1, kQ4PrefetchBytes / ldw) * ldm);
  __m512 acc[MB][NB];
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t left = std::min<int64_t>(kQ4Chunk, groups - c * kQ4Chunk);
    const __mmask64 cmask = left == kQ4Chunk ? ~__mmask64{0} : (__mmask64{1} << (left * 16)) - 1;
    const __mmask8 dmask = static_cast<__mmask8>((1u << (left * 2)) - 1);
    if (stream) {
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) _mm_prefetch(pf + j * ldw + c * 64, _MM_HINT_T0);
      if ((c & 3) == 0) {
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) _mm_prefetch(pfd + (j * ldm + c * 8) * 2, _MM_HINT_T0);
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      const __m512i v = _mm512_maskz_loadu_epi8(cmask, w + j * ldw + c * 64);
      const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      const __m256 dmv = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(dmask, dm + j * ldm + c * 8));
      const __m512 d16 = _mm512_permutexvar_ps(idx_d, _mm512_castps256_ps512(dmv));
      const __m512 m16 = _mm512_permutexvar_ps(idx_m, _mm512_castps256_ps512(dmv));
#pragma GCC unroll 4
      for (int i = 0; i < MB; ++i) {
        const int8_t* xr = xq.q.data() + (m0 + i) * xq.ldq + c * 128;
        const int64_t so = (m0 + i) * xq.lds + c * kQ4Lanes;
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xr));
        dot = _mm512_dpbusd_epi32(dot, hi, _mm512_loadu_si512(xr + 64));
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d16, _mm512_loadu_ps(xq.s.data() + so)),
                                    acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(m16, _mm512_loadu_ps(xq.c.data() + so), acc[i][j]);
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i) {
    if constexpr (NB == kRowsWQ4) {
      __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(q4_fold(acc[i][0]), q4_fold(acc[i][1])),
                                _mm256_hadd_ps(q4_fold(acc[i][2]), q4_fold(acc[i][3])));
      _mm_storeu_ps(out[i], _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
    } else {
      for (int j = 0; j < NB; ++j) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
    }
  }
}
#else
// The AVX2 variant of the tile above: 2 groups per step, vpmaddubsw (pairs of u4 x s8 into int16:
// at most 2 * 15 * 127, and the low and high halves added, 4 * 15 * 127 = 7620, never saturate)
// then vpmaddwd by ones into int32 lanes, 4 per group. The last group of an odd count is copied
// into a zeroed buffer (there are no byte-masked loads in AVX2).
template <int MB, int NB>
inline void dot_tile_q4(const Q4X& xq, int64_t m0, const uint8_t* w, int64_t ldw, const uint16_t* dm, int64_t ldm,
                        bool stream, float out[][kRowsWQ4]) {
  const int64_t groups = q4_groups(xq.K), chunks = q4_chunks(xq.K);
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i idx_d = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
  const __m256i idx_m = _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3);
  const char* pf = reinterpret_cast<const char*>(w) + kQ4PrefetchBytes;
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const bool full = (c + 1) * kQ4Chunk <= groups;
    if (stream && (c & 1) == 0) {
      for (int j = 0; j < NB; ++j) _mm_prefetch(pf + j * ldw + c * 32, _MM_HINT_T0);
    }
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      __m256i v;
      __m128i dmh;
      if (full) {
        v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * ldw + c * 32));
        dmh = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(dm + j * ldm + c * 4));
      } else {
        v = _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * ldw + c * 32)));
        int32_t pair;
        std::memcpy(&pair, dm + j * ldm + c * 4, 4);
        dmh = _mm_cvtsi32_si128(pair);
      }
      const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
      const __m256 dmv = _mm256_castps128_ps256(_mm_cvtph_ps(dmh));
      const __m256 d8 = _mm256_permutevar8x32_ps(dmv, idx_d), m8 = _mm256_permutevar8x32_ps(dmv, idx_m);
#pragma GCC unroll 4
      for (int i = 0; i < MB; ++i) {
        const int8_t* xr = xq.q.data() + (m0 + i) * xq.ldq + c * 64;
        const int64_t so = (m0 + i) * xq.lds + c * kQ4Lanes;
        const __m256i p = _mm256_add_epi16(
            _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr))),
            _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32))));
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
        acc[i][j] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d8, _mm256_loadu_ps(xq.s.data() + so)), acc[i][j]);
        acc[i][j] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(xq.c.data() + so), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MB; ++i) {
    if constexpr (NB == kRowsWQ4) {
      __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(acc[i][0], acc[i][1]), _mm256_hadd_ps(acc[i][2], acc[i][3]));
      _mm_storeu_ps(out[i], _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
    } else {
      for (int j = 0; j < NB; ++j) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[i][j]), _mm256_extractf128_ps(acc[i][j], 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        out[i][j] = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
      }
    }
  }
}
#endif

// y[i * ldy + r] = (x row i . weight row r0 + r) + bias[r0 + r] for r in [0, rows), every row of
// xq (quantize_x); codes [N, K / 2], dm [N, K / 32, 2] as float16 bits; bias may be null.
inline void row_products_q4(const Q4X& xq, const uint8_t* codes, const uint16_t* dm, int64_t r0, int64_t rows,
                            const float* bias, float* y, int64_t ldy) {
  const int64_t K = xq.K, M = xq.M, ldw = K / 2, ldm = q4_groups(K) * 2;
  float dots[kRowsXQ4][kRowsWQ4];
  for (int64_t b = 0; b < rows; b += kRowsWQ4) {
    const int nb = static_cast<int>(std::min<int64_t>(kRowsWQ4, rows - b));
    const uint8_t* wp = codes + (r0 + b) * ldw;
    const uint16_t* dp = dm + (r0 + b) * ldm;
    auto emit = [&](int64_t m, int mb) {
      for (int i = 0; i < mb; ++i)
        for (int j = 0; j < nb; ++j) {
          const float v = dots[i][j];
          y[(m + i) * ldy + b + j] = bias ? v + bias[r0 + b + j] : v;
        }
    };
    auto tile = [&](auto mb_tag, int64_t m) {
      constexpr int MB = decltype(mb_tag)::value;
      if (nb == kRowsWQ4) {
        dot_tile_q4<MB, kRowsWQ4>(xq, m, wp, ldw, dp, ldm, m == 0, dots);
      } else {
        for (int j = 0; j < nb; ++j) {
          float one[MB][kRowsWQ4];
          dot_tile_q4<MB, 1>(xq, m, wp + j * ldw, ldw, dp + j * ldm, ldm, m == 0, one);
          for (int i = 0; i < MB; ++i) dots[i][j] = one[i][0];
        }
      }
      emit(m, MB);
    };
    inferlab_simd::for_row_tiles<kRowsXQ4>(M, tile);
  }
}

// rows weight rows (codes, dm as above, K features each) as float32 d * q + m into dst (row stride K).
inline void dequantize_rows_q4(const uint8_t* codes, const uint16_t* dm, int64_t rows, int64_t K, float* dst) {
  const int64_t groups = q4_groups(K);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + r * (K / 2) + g * 16));
      const __m128i nib = _mm_set1_epi8(0x0F);
      const __m128i lo = _mm_and_si128(v, nib), hi = _mm_and_si128(_mm_srli_epi16(v, 4), nib);
      const uint16_t* p = dm + (r * groups + g) * 2;
      const __m256 d = _mm256_set1_ps(static_cast<float>(c10::Half(p[0], c10::Half::from_bits())));
      const __m256 m = _mm256_set1_ps(static_cast<float>(c10::Half(p[1], c10::Half::from_bits())));
      float* o = dst + r * K + g * kQ4Group;
      const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
      for (int t = 0; t < 4; ++t)
        _mm256_storeu_ps(o + 8 * t, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[t])), d, m));
    }
  }
}

}  // namespace inferlab_q4
