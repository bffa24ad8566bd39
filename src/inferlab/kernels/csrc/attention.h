// The paged decode-attention core shared by attention.cpp (the paged_attention_decode operator)
// and decoder_step.cpp (a whole decode step per call): one (sequence, KV head) task at a time,
// K/V rows read straight from the cache's blocks. See attention.cpp for the method.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include "bf16.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace inferlab_attention {

using namespace inferlab_simd;  // load8, to_float, hsum, hmax, exp8

// The 8 dot products q . rows[j] as one vector: 8 accumulators, then a transposing hadd tree
// (one reduction per 8 dots instead of one per dot). DC > 0: head_dim = DC (compile time).
template <typename T, int DC>
inline __m256 dot8(const float* q, const T* const* rows, int d) {
  const int nd = DC > 0 ? DC : d;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  int c = 0;
  for (; c + 8 <= nd; c += 8) {
    const __m256 qv = _mm256_loadu_ps(q + c);
    a0 = _mm256_fmadd_ps(qv, load8(rows[0] + c), a0);
    a1 = _mm256_fmadd_ps(qv, load8(rows[1] + c), a1);
    a2 = _mm256_fmadd_ps(qv, load8(rows[2] + c), a2);
    a3 = _mm256_fmadd_ps(qv, load8(rows[3] + c), a3);
    a4 = _mm256_fmadd_ps(qv, load8(rows[4] + c), a4);
    a5 = _mm256_fmadd_ps(qv, load8(rows[5] + c), a5);
    a6 = _mm256_fmadd_ps(qv, load8(rows[6] + c), a6);
    a7 = _mm256_fmadd_ps(qv, load8(rows[7] + c), a7);
  }
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
  if (DC <= 0 && c < nd) {  // a head_dim that is not a multiple of 8
    alignas(32) float tail[8];
    for (int j = 0; j < 8; ++j) {
      float t = 0.f;
      for (int i = c; i < nd; ++i) t += q[i] * to_float(rows[j][i]);
      tail[j] = t;
    }
    s = _mm256_add_ps(s, _mm256_load_ps(tail));
  }
  return s;
}

// acc[0..nd) += sum_j p[j] * rows[j][0..nd) for n rows; 8 vectors (64 floats) of acc in
// registers at a time, the rows (already in L1 from the first head) streamed past them.
template <typename T, int DC>
inline void accumulate_rows(float* acc, const float* p, const T* const* rows, int n, int d) {
  const int nd = DC > 0 ? DC : d;
  int c = 0;
  for (; c + 64 <= nd; c += 64) {
    __m256 a0 = _mm256_loadu_ps(acc + c), a1 = _mm256_loadu_ps(acc + c + 8);
    __m256 a2 = _mm256_loadu_ps(acc + c + 16), a3 = _mm256_loadu_ps(acc + c + 24);
    __m256 a4 = _mm256_loadu_ps(acc + c + 32), a5 = _mm256_loadu_ps(acc + c + 40);
    __m256 a6 = _mm256_loadu_ps(acc + c + 48), a7 = _mm256_loadu_ps(acc + c + 56);
    for (int j = 0; j < n; ++j) {
      const __m256 pv = _mm256_set1_ps(p[j]);
      const T* r = rows[j] + c;
      a0 = _mm256_fmadd_ps(pv, load8(r), a0);
      a1 = _mm256_fmadd_ps(pv, load8(r + 8), a1);
      a2 = _mm256_fmadd_ps(pv, load8(r + 16), a2);
      a3 = _mm256_fmadd_ps(pv, load8(r + 24), a3);
      a4 = _mm256_fmadd_ps(pv, load8(r + 32), a4);
      a5 = _mm256_fmadd_ps(pv, load8(r + 40), a5);
      a6 = _mm256_fmadd_ps(pv, load8(r + 48), a6);
      a7 = _mm256_fmadd_ps(pv, load8(r + 56), a7);
    }
    _mm256_storeu_ps(acc + c, a0);
    _mm256_storeu_ps(acc + c + 8, a1);
    _mm256_storeu_ps(acc + c + 16, a2);
    _mm256_storeu_ps(acc + c + 24, a3);
    _mm256_storeu_ps(acc + c + 32, a4);
    _mm256_storeu_ps(acc + c + 40, a5);
    _mm256_storeu_ps(acc + c + 48, a6);
    _mm256_storeu_ps(acc + c + 56, a7);
  }
  for (; c + 8 <= nd; c += 8) {
    __m256 a = _mm256_loadu_ps(acc + c);
    for (int j = 0; j < n; ++j) a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), load8(rows[j] + c), a);
    _mm256_storeu_ps(acc + c, a);
  }
  for (; c < nd; ++c) {
    float a = acc[c];
    for (int j = 0; j < n; ++j) a += p[j] * to_float(rows[j][c]);
    acc[c] = a;
  }
}

constexpr int kTile = 32;  // V rows per tile in pass 2: 8 KiB at D=64 fp32, stays in L1

// Blocks sit anywhere in the cache (4 KiB per block and head at D=64 fp32), and one core reading
// one random 4 KiB run after another gets a third of its streaming bandwidth: the hardware
// prefetcher restarts at each run. So a task walks its context as kStreams interleaved
// sequential streams (row i of segment 0, row i of segment 1, ...): the prefetcher follows
// all of them at once. Measured on this machine (1 thread, 30 layers, batch 32): 25-30% less
// time than walking the context in order; software prefetch alone gained nothing measurable.
// Softmax and the weighted sum do not care about the order (only fp32 rounding does).
constexpr int kStreams = 8;

// The grouped passes' pass 1 also prefetches each V row at the offset of the K row it reads
// as it goes: pass 2 reads the same rows in the same order, and with both streams in flight the
// context's 2 KiB runs (one per block and KV head, scattered through the pool) wait on memory
// together rather than one after the other. Measured on a Zen 5, batch 32 of 272-token contexts,
// float16 K/V, 30 layers' distinct blocks, 2 threads: 8.1-10.3 -> 7.2-9.1 ms (each of 5
// alternated pairs faster, median 0.95x); into L1 rather than L2: 0.95x again.

// Software prefetch of one row (every cache line of it), a little ahead of its use, into L2 (T1).
// Why L2: a prefetch into L1 holds one of the core's few L1 miss buffers until its line arrives,
// so with the context's runs scattered through the pool the prefetches queue behind each other;
// into L2 more are in flight. Measured on a Zen 4 (2 threads): reading batch 32's scattered 2 KiB
// runs with the run two ahead prefetched, 12.3-13.5 GB/s by T0 against 18.0-18.9 by T1 (plain
// reads 11.6-13.5); the decode step's attention phase at batch 32, in-process A/B rounds
// alternated, 13.36 -> 11.10 and 12.71 -> 11.23 ms (12 / 10 rounds), batch 8 of 512-token
// contexts 5.37 -> 4.73 ms. (On the Zen 5 of the note above, L1 and L2 measured the same.)
template <typename T>
inline void prefetch_row(const T* p, int64_t d) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(c + b, _MM_HINT_T1);
}

// Pass 1's prefetch at the visiting order's position t0: the 8 K rows 16 positions ahead, and the
// V rows at the same offsets where vpf is given (pass 2 reads them in the same order).
template <typename T>
inline void prefetch_keys(const T* kc, const T* vpf, const int64_t* offs, int64_t t0, int64_t lp, int64_t d) {
  if (t0 + 16 >= lp) return;
  for (int j = 0; j < 8; ++j) {
    prefetch_row(kc + offs[t0 + 16 + j], d);
    if (vpf) prefetch_row(vpf + offs[t0 + 16 + j], d);
  }
}

// Grouped passes for every cache dtype at head_dim 64 / 128 (kGrouped): dot8 and
// accumulate_rows take one query head at a time, so every K and V row is widened again for each
// head that reads it; these widen a row once for GB <= 3 heads and keep all of their sums in
// registers. avx512: 8 keys x GB heads of 16-lane score accumulators, GB x DC / 16 for V (at
// SmolLM2's 3 heads per KV head, ~2x fewer instructions per K row, ~2.5x per V row). AVX2 (16
// registers): 4 keys x GB heads, and V in halves of 32 values. int8 codes too (their K scales
// multiply the finished scores, `ksc`; the V scales ride in the probabilities, decode_task): an
// int8 row costs two widening instructions where a float16 one costs one, and widened once per
// head an int8 cache's attention phase at batch 32 took 13.3 ms against float16's 9.0 on a Zen 4
// for half the bytes. Grouped, in-process A/B of the decode step (8 alternated rounds): 10.09 ->
// 7.47 ms at 32 sequences of ~260 tokens, 2.38 -> 1.78 at 8.
#if defined(__AVX512F__)
template <int DC>
constexpr bool kGrouped = DC > 0 && DC % 16 == 0;
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const at::BFloat16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// Lane j of the result: the sum of a[j]'s 16 lanes, in dot8's order: p_i = lane i + lane i + 8,
// then ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)). Why on 512-bit registers: the same
// tree through 256-bit halves and hadd (3 uops each) took ~37 uops per 8 sums, more than the
// vdpbf16ps making them (3 heads x 8 keys: ~40% of the scores pass's instructions); here 25.
inline __m256 sum8x16(const __m512* a) {
  // p of a[j] and a[j + 1] side by side: lanes 0-7 a[j]'s, 8-15 a[j + 1]'s.
  __m512 b[4];
  for (int j = 0; j < 4; ++j)
    b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // Adjacent pairs, twice (each 128-bit lane: two rows' pairs, then their sums of four).
  auto pairs = [](__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  // d's 128-bit lanes: [a0 a2 a4 a6] first halves, [a0 a2 a4 a6] second, [a1 a3 a5 a7] first, second.
  const __m512 d = pairs(pairs(b[0], b[1]), pairs(b[2], b[3]));
  const __m512 lo = _mm512_shuffle_f32x4(d, d, _MM_SHUFFLE(2, 0, 2, 0)), hi = _mm512_shuffle_f32x4(d, d, _MM_SHUFFLE(3, 1, 3, 1));
  const __m256 s = _mm512_castps512_ps256(_mm512_add_ps(lo, hi));  // a0 a2 a4 a6 a1 a3 a5 a7
  return _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Pass 1 for heads g0 .. g0 + GB - 1: sc[g][t] = qf[g] . k(offs[t]) for t < lp (a multiple of 8),
// times ksc[t] where given (an int8 cache's K scales in visiting order).
// vpf (or null): the V rows at the same offsets are prefetched beside the K rows (see prefetch_row).
template <typename T, int GB, int DC>
inline void scores_group(const float* qf, const T* kc, const int64_t* offs, int64_t lp, float* sc, const T* vpf,
                         const float* ksc) {
  for (int64_t t0 = 0; t0 < lp; t0 += 8) {
    prefetch_keys(kc, vpf, offs, t0, lp, DC);
    __m512 acc[GB][8];
    for (int g = 0; g < GB; ++g)
      for (int j = 0; j < 8; ++j) acc[g][j] = _mm512_setzero_ps();
    for (int c = 0; c < DC; c += 16) {
      __m512 qv[GB];
      for (int g = 0; g < GB; ++g) qv[g] = _mm512_loadu_ps(qf + g * DC + c);
      for (int j = 0; j < 8; ++j) {
        const __m512 k = load16(kc + offs[t0 + j] + c);
        for (int g = 0; g < GB; ++g) acc[g][j] = _mm512_fmadd_ps(qv[g], k, acc[g][j]);
      }
    }
    for (int g = 0; g < GB; ++g) {
      const __m256 dots = sum8x16(acc[g]);
      _mm256_storeu_ps(sc + g * lp + t0, ksc ? _mm256_mul_ps(_mm256_loadu_ps(ksc + t0), dots) : dots);
    }
  }
}

// Pass 2 for heads g0 .. g0 + GB - 1: acc[g] = sum_{t < len} p[g][t] v(offs[t]).
template <typename T, int GB, int DC>
inline void accumulate_group(float* acc, const float* p, int64_t lp, const T* vc, const int64_t* offs, int64_t len) {
  constexpr int NV = DC / 16;
  __m512 a[GB][NV];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NV; ++c) a[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    if (t + 32 < len) prefetch_row(vc + offs[t + 32], DC);
    const T* r = vc + offs[t];
    __m512 pv[GB];
    for (int g = 0; g < GB; ++g) pv[g] = _mm512_set1_ps(p[g * lp + t]);
    for (int c = 0; c < NV; ++c) {
      const __m512 v = load16(r + c * 16);
      for (int g = 0; g < GB; ++g) a[g][c] = _mm512_fmadd_ps(pv[g], v, a[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + g * DC + c * 16, a[g][c]);
}

#else
template <int DC>
constexpr bool kGrouped = DC > 0 && DC % 32 == 0;

// 4 accumulators of 8 lanes -> their 4 sums (lane j = sum of a[j]).
inline __m128 sum4x8(const __m256* a) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

template <typename T, int GB, int DC>
inline void scores_group(const float* qf, const T* kc, const int64_t* offs, int64_t lp, float* sc, const T* vpf,
                         const float* ksc) {
  for (int64_t t0 = 0; t0 < lp; t0 += 4) {
    if (t0 % 8 == 0) prefetch_keys(kc, vpf, offs, t0, lp, DC);
    __m256 acc[GB][4];
    for (int g = 0; g < GB; ++g)
      for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_setzero_ps();
    for (int c = 0; c < DC; c += 8) {
      __m256 qv[GB];
      for (int g = 0; g < GB; ++g) qv[g] = _mm256_loadu_ps(qf + g * DC + c);
      for (int j = 0; j < 4; ++j) {
        const __m256 k = load8(kc + offs[t0 + j] + c);
        for (int g = 0; g < GB; ++g) acc[g][j] = _mm256_fmadd_ps(qv[g], k, acc[g][j]);
      }
    }
    for (int g = 0; g < GB; ++g) {
      const __m128 dots = sum4x8(acc[g]);
      _mm_storeu_ps(sc + g * lp + t0, ksc ? _mm_mul_ps(_mm_loadu_ps(ksc + t0), dots) : dots);
    }
  }
}

template <typename T, int GB, int DC>
inline void accumulate_group(float* acc, const float* p, int64_t lp, const T* vc, const int64_t* offs, int64_t len) {
  for (int c0 = 0; c0 < DC; c0 += 32) {  // the second half finds the rows in L1 / L2
    __m256 a[GB][4];
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < 4; ++c) a[g][c] = _mm256_setzero_ps();
    for (int64_t t = 0; t < len; ++t) {
      if (c0 == 0 && t + 32 < len) prefetch_row(vc + offs[t + 32], DC);
      const T* r = vc + offs[t] + c0;
      __m256 pv[GB];
      for (int g = 0; g < GB; ++g) pv[g] = _mm256_set1_ps(p[g * lp + t]);
      for (int c = 0; c < 4; ++c) {
        const __m256 v = load8(r + c * 8);
        for (int g = 0; g < GB; ++g) a[g][c] = _mm256_fmadd_ps(pv[g], v, a[g][c]);
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc + g * DC + c0 + c * 8, a[g][c]);
  }
}
#endif

// Both passes over every head, in groups of up to 3 (GB x 8 accumulators, GB queries and one
// row fit the 32 registers). Pass 1's first group prefetches the V rows pass 2 reads; ksc: see
// scores_group.
template <typename T, int DC>
inline void scores_all(const float* qf, const T* kc, const T* vc, const int64_t* offs, int64_t lp, float* sc,
                       int64_t g_heads, const float* ksc) {
  for (int64_t g0 = 0; g0 < g_heads; g0 += 3) {
    const int64_t n = std::min<int64_t>(3, g_heads - g0);
    const float* q = qf + g0 * DC;
    float* o = sc + g0 * lp;
    if (n == 3) scores_group<T, 3, DC>(q, kc, offs, lp, o, g0 == 0 ? vc : nullptr, ksc);
    else if (n == 2) scores_group<T, 2, DC>(q, kc, offs, lp, o, g0 == 0 ? vc : nullptr, ksc);
    else scores_group<T, 1, DC>(q, kc, offs, lp, o, g0 == 0 ? vc : nullptr, ksc);
  }
}

template <typename T, int DC>
inline void accumulate_all(float* acc, const float* p, int64_t lp, const T* vc, const int64_t* offs, int64_t len,
                           int64_t g_heads) {
  for (int64_t g0 = 0; g0 < g_heads; g0 += 3) {
    const int64_t n = std::min<int64_t>(3, g_heads - g0);
    float* a = acc + g0 * DC;
    const float* pg = p + g0 * lp;
    if (n == 3) accumulate_group<T, 3, DC>(a, pg, lp, vc, offs, len);
    else if (n == 2) accumulate_group<T, 2, DC>(a, pg, lp, vc, offs, len);
    else accumulate_group<T, 1, DC>(a, pg, lp, vc, offs, len);
  }
}

// Scratch reused across tasks on one thread (sized to the longest context seen).
struct Scratch {
  std::vector<int64_t> lin;    // element offset of context position t's row within a head
  std::vector<int64_t> offs;   // the same offsets in the interleaved visiting order
  std::vector<float> scores;   // [G][Lp] scores, then probabilities
  std::vector<float> qf;       // [G][D] scaled query, fp32
  std::vector<float> acc;      // [G][D]
  std::vector<float> sum, max; // [G] softmax denominator and largest score
  std::vector<float> ksc, vsc; // int8 caches: each visited row's K and V scale, in visiting order
  std::vector<uint16_t> qb, pb; // bf16 caches (decode_task_dot): the query and the probabilities in bf16
};

// r[t] = exp(r[t] - max) over the len scores of a head, 0 from len to lp (a multiple of 8);
// returns their sum, the softmax's denominator, and the max in *max_out. The avx512 variant runs
// 16 lanes (exp16 is exp8's arithmetic lane for lane; only the sum's order differs): 3% off batch
// 32's attention phase on a Zen 4 (in-process A/B, 10 rounds).
inline float softmax_row(float* r, int64_t len, int64_t lp, float* max_out) {
#if defined(__AVX512F__)
  auto lanes = [](int64_t n) { return static_cast<__mmask16>(n >= 16 ? 0xffff : (1u << n) - 1); };
  __m512 mv = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < len; t += 16) mv = _mm512_mask_max_ps(mv, lanes(len - t), mv, _mm512_loadu_ps(r + t));
  *max_out = _mm512_reduce_max_ps(mv);
  const __m512 mb = _mm512_set1_ps(*max_out);
  __m512 sv = _mm512_setzero_ps();
  for (int64_t t = 0; t < lp; t += 16) {
    const __mmask16 in = lanes(lp - t);
    const __m512 e = _mm512_maskz_mov_ps(lanes(len - t), exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, r + t), mb)));
    _mm512_mask_storeu_ps(r + t, in, e);
    sv = _mm512_add_ps(sv, e);
  }
  return _mm512_reduce_add_ps(sv);
#else
  const int64_t full = len / 8 * 8;
  __m256 mv = _mm256_set1_ps(-INFINITY);
  for (int64_t t = 0; t < full; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(r + t));
  float m = hmax(mv);
  for (int64_t t = full; t < len; ++t) m = std::max(m, r[t]);
  *max_out = m;
  const __m256 mb = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  for (int64_t t = 0; t < lp; t += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(r + t), mb));
    if (t + 8 > len) {  // the last, partial group: keep only the valid lanes
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, e);
      for (int64_t j = len - t; j < 8; ++j) tmp[j] = 0.f;
      e = _mm256_load_ps(tmp);
    }
    _mm256_storeu_ps(r + t, e);
    sv = _mm256_add_ps(sv, e);
  }
  return hsum(sv);
#endif
}

// Positions a task visits, padded to whole groups of 8 (padding re-reads the last row).
inline int64_t visit_len(int64_t len) { return (len + 7) / 8 * 8; }

// The element offset of each row a (sequence, KV head) task reads, in visiting order, into
// offs[0 .. visit_len(len)), for the len positions from `start` on (a partition, below):
// segment st covers positions [st * seg, (st + 1) * seg) of them, step i visits row i of every
// segment (kStreams above); scores and probabilities keep this order. `lin`: len entries of
// scratch. The order depends on the block table and the positions only, not on the head or the
// layer, so a caller running many heads and layers of one step computes it once per sequence and
// partition (decoder_step.cpp: 4% off batch 32's attention phase on a Zen 4).
inline void visit_order(const int32_t* table, int64_t start, int64_t len, int64_t bs, int64_t d, int64_t* lin,
                        int64_t* offs) {
  for (int64_t t = 0, blk = start / bs, o = start % bs; t < len; ++blk, o = 0) {
    const int64_t base = static_cast<int64_t>(table[blk]) * bs * d;
    for (; o < bs && t < len; ++o, ++t) lin[t] = base + o * d;
  }
  const int64_t seg = (len + kStreams - 1) / kStreams;
  int64_t k = 0;
  for (int64_t i = 0; i < seg; ++i)
    for (int64_t p = i; p < len; p += seg) offs[k++] = lin[p];
  for (int64_t t = len; t < visit_len(len); ++t) offs[t] = offs[len - 1];
}

// A context longer than kPartition positions is attended in partitions of kPartition (the last
// one shorter), each its own task, and the partitions' results are merged (merge_parts): so one
// long sequence's heads spread over every thread (3 KV heads on 2 threads left one idle a third
// of the time). The boundaries depend on the context's length alone, never on the batch, so a
// sequence's output has the same bits whatever else is in the step (speculative verification's
// rows and a plain decode row agree). Shorter contexts are one partition: the one-pass result.
// Measured on a Zen 4 (decode step, in-process A/B against no partitions, 8 rounds): one sequence
// of 4,000 tokens, the attention phase 4.58 -> 4.35 ms (256-position partitions: 4.47); of 2,000,
// 2.02 -> 2.10; 16 of 1,000, 13.53 -> 13.77 (6 rounds). Small: on this host one thread's scattered
// reads of K/V already take most of what two get, so the idle thread cost little.
constexpr int64_t kPartition = 512;
inline int64_t num_parts(int64_t len) { return (len + kPartition - 1) / kPartition; }

// Where a partition's unnormalised result goes: acc [G][D] = sum_t e^(s_t - m) v_t, and per head
// max (the partition's largest score m) and sum (sum_t e^(s_t - m)).
struct Partial {
  float* acc;
  float* max;
  float* sum;
};

// One (sequence, KV head)'s output from its `parts` partitions (acc [parts][G][D], max and sum
// [parts][G]): out[g] = sum_p e^(max_p - M) acc_p / sum_p e^(max_p - M) sum_p, M the largest max_p.
template <typename Q>
inline void merge_parts(const float* acc, const float* max, const float* sum, int64_t parts, int64_t g_heads,
                        int64_t d, Q* out) {
  float stack[64];  // a context of up to 32K positions; longer ones on the heap
  std::vector<float> heap(parts > 64 ? parts : 0);
  float* w = parts > 64 ? heap.data() : stack;
  for (int64_t g = 0; g < g_heads; ++g) {
    float m = -INFINITY;
    for (int64_t p = 0; p < parts; ++p) m = std::max(m, max[p * g_heads + g]);
    float den = 0.f;
    for (int64_t p = 0; p < parts; ++p) {
      w[p] = std::exp(max[p * g_heads + g] - m);
      den += w[p] * sum[p * g_heads + g];
    }
    const float inv = 1.0f / den;
    for (int64_t i = 0; i < d; ++i) {
      float a = 0.f;
      for (int64_t p = 0; p < parts; ++p) a += w[p] * acc[(p * g_heads + g) * d + i];
      out[g * d + i] = static_cast<Q>(a * inv);
    }
  }
}

// A batch's (sequence, partition) pairs in order (pair u is partition u - first of its sequence),
// and the buffers for the unnormalised results of sequences of several partitions: the tasks of
// the paged operator (attention.cpp) and of the decode step's attention phase (decoder_step.cpp).
class Partitions {
 public:
  struct Task {
    int64_t seq, start, len;  // the positions [start, start + len) of sequence seq
    bool partial;             // one of several partitions: the result goes to `part`
    Partial part;
  };
  Partitions(int64_t b, const int32_t* lens, int64_t kv_heads, int64_t g_heads, int64_t d)
      : lens_(lens), first_(b + 1, 0), kvh_(kv_heads), gd_(g_heads * d), g_(g_heads) {
    for (int64_t i = 0; i < b; ++i) first_[i + 1] = first_[i] + num_parts(lens[i]);
    seq_.resize(first_[b]);
    for (int64_t i = 0; i < b; ++i)
      for (int64_t u = first_[i]; u < first_[i + 1]; ++u) seq_[u] = i;
    if (split()) {  // a slot per (pair, KV head)
      acc_.resize(pairs() * kvh_ * gd_);
      max_.resize(pairs() * kvh_ * g_);
      sum_.resize(pairs() * kvh_ * g_);
    }
  }
  int64_t pairs() const { return static_cast<int64_t>(seq_.size()); }
  int64_t parts(int64_t i) const { return first_[i + 1] - first_[i]; }
  bool split() const { return pairs() > static_cast<int64_t>(first_.size()) - 1; }
  // Pair u's task for KV head kh.
  Task task(int64_t u, int64_t kh) const {
    const int64_t i = seq_[u], p = u - first_[i], n = parts(i);
    const int64_t start = p * kPartition;
    Task t{i, start, n == 1 ? lens_[i] : std::min<int64_t>(kPartition, lens_[i] - start), n > 1, {}};
    if (t.partial) {
      const int64_t slot = slot0(i, kh) + p;
      t.part = {acc_.data() + slot * gd_, max_.data() + slot * g_, sum_.data() + slot * g_};
    }
    return t;
  }
  // Sequence i's output for KV head kh from its partitions (nothing to do for one).
  template <typename Q>
  void merge(int64_t i, int64_t kh, int64_t d, Q* out) const {
    if (parts(i) == 1) return;
    const int64_t s = slot0(i, kh);
    merge_parts(acc_.data() + s * gd_, max_.data() + s * g_, sum_.data() + s * g_, parts(i), g_, d, out);
  }

 private:
  // Sequence i's partitions for KV head kh are slots slot0 .. slot0 + parts - 1 (merge_parts' layout).
  int64_t slot0(int64_t i, int64_t kh) const { return first_[i] * kvh_ + kh * parts(i); }
  const int32_t* lens_;
  std::vector<int64_t> first_, seq_;
  int64_t kvh_, gd_, g_;
  mutable std::vector<float> acc_, max_, sum_;  // written through the tasks' Partial pointers
};

// A task's end: acc [G][D] over the softmax's sums into out (one partition), or left
// unnormalised in *part with the sums and maxima (one of several; merge_parts).
template <typename Q>
inline void finish_task(const float* acc, const float* sum, const float* max, int64_t g_heads, int64_t d, Q* out,
                        const Partial* part) {
  if (part) {
    std::memcpy(part->acc, acc, sizeof(float) * g_heads * d);
    std::memcpy(part->sum, sum, sizeof(float) * g_heads);
    std::memcpy(part->max, max, sizeof(float) * g_heads);
    return;
  }
  for (int64_t g = 0; g < g_heads; ++g) {
    const float inv = 1.0f / sum[g];
    for (int64_t i = 0; i < d; ++i) out[g * d + i] = static_cast<Q>(acc[g * d + i] * inv);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// ---- bf16 caches by vdpbf16ps (the avx512 variant) -----------------------------------------
// Why: widened to float32 (the grouped passes above), a K or V row costs a conversion and GB
// FMAs per 16 values (~45 instructions per key and KV head at SmolLM2's 3 heads, the time it
// takes with the K/V in cache); vdpbf16ps multiplies 32 bf16 pairs per instruction straight from
// the cache's bytes (~26). Measured on a Zen 4, batch 32 of 280-token contexts, one layer's K/V
// over and over (in cache), 2 threads: 185 -> 115 us a layer; 8 sequences on one thread 87 -> 58.
// In the decode step, K/V from memory: the attention phase 8.80 -> 8.04 ms at 32 sequences, 2.36
// -> 2.14 at 8 (8 alternated rounds, a bfloat16 against a float16 cache). Numerics: q, K, P and
// V rounded to bf16, every sum float32: bf16.h's, the same as prefill attention's bf16 flavour
// beside bf16 or w8a8 products, so a token attends alike in a prefill chunk and in a decode step
// (models/precision.py bf16_decode_attention decides; a float16 cache keeps float32 arithmetic).

// Pass 1 for heads g0 .. g0 + GB - 1: sc[g][t] = qb[g] . k(offs[t]) for t < lp (a multiple of
// 8); qb: GB rows of DC bf16 (the scaled query, rounded). A K row's consecutive pairs of values
// are vdpbf16ps's pairs, so the cache needs no other layout. vpf: as scores_group.
template <int GB, int DC>
inline void scores_group_dot(const uint16_t* qb, const at::BFloat16* kc, const int64_t* offs, int64_t lp, float* sc,
                             const at::BFloat16* vpf) {
  for (int64_t t0 = 0; t0 < lp; t0 += 8) {
    prefetch_keys(kc, vpf, offs, t0, lp, DC);
    __m512 acc[GB][8];
    for (int g = 0; g < GB; ++g)
      for (int j = 0; j < 8; ++j) acc[g][j] = _mm512_setzero_ps();
    for (int c = 0; c < DC; c += 32) {
      __m512bh qv[GB];
      for (int g = 0; g < GB; ++g) qv[g] = (__m512bh)_mm512_loadu_si512(qb + g * DC + c);
      for (int j = 0; j < 8; ++j) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(kc + offs[t0 + j] + c);
        for (int g = 0; g < GB; ++g) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], qv[g], k);
      }
    }
    for (int g = 0; g < GB; ++g) _mm256_storeu_ps(sc + g * lp + t0, sum8x16(acc[g]));
  }
}

// Pass 2 for heads g0 .. g0 + GB - 1: acc[g] = sum_{t < len} p[g][t] v(offs[t]), p in bf16 pairs
// (pp[g * pstride + t / 2] holds p[t] and p[t + 1]; 0 past len). vdpbf16ps pairs along its
// 32-bit lanes, so two consecutive rows are interleaved in registers (unpacklo / unpackhi per
// 128-bit lane: dims 8L + 0..3 and 8L + 4..7 of each 32), and the sums are put back in dim order
// once at the end. When len is odd the last pair's second row is visit_order's padding (p = 0).
template <int GB, int DC>
inline void accumulate_group_dot(float* acc, const uint32_t* pp, int64_t pstride, const at::BFloat16* vc,
                                 const int64_t* offs, int64_t len) {
  constexpr int NZ = DC / 32;
  __m512 lo[GB][NZ], hi[GB][NZ];
  for (int g = 0; g < GB; ++g)
    for (int z = 0; z < NZ; ++z) lo[g][z] = hi[g][z] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; t += 2) {
    if (t + 33 < len) {
      prefetch_row(vc + offs[t + 32], DC);
      prefetch_row(vc + offs[t + 33], DC);
    }
    const at::BFloat16* r0 = vc + offs[t];
    const at::BFloat16* r1 = vc + offs[t + 1];
    __m512bh pv[GB];
    for (int g = 0; g < GB; ++g) pv[g] = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[g * pstride + t / 2]));
    for (int z = 0; z < NZ; ++z) {
      const __m512i x0 = _mm512_loadu_si512(r0 + 32 * z), x1 = _mm512_loadu_si512(r1 + 32 * z);
      const __m512bh l = (__m512bh)_mm512_unpacklo_epi16(x0, x1), h = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
      for (int g = 0; g < GB; ++g) {
        lo[g][z] = _mm512_dpbf16_ps(lo[g][z], pv[g], l);
        hi[g][z] = _mm512_dpbf16_ps(hi[g][z], pv[g], h);
      }
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int g = 0; g < GB; ++g)
    for (int z = 0; z < NZ; ++z) {
      _mm512_storeu_ps(acc + g * DC + 32 * z, _mm512_permutex2var_ps(lo[g][z], first, hi[g][z]));
      _mm512_storeu_ps(acc + g * DC + 32 * z + 16, _mm512_permutex2var_ps(lo[g][z], second, hi[g][z]));
    }
}

// One (sequence, KV head) over a bf16 cache at head_dim DC (a multiple of 32): decode_task's
// contract (below), its passes by vdpbf16ps.
template <typename Q, int DC>
void decode_task_dot(const Q* q, const at::BFloat16* kc, const at::BFloat16* vc, const int32_t* table, int64_t start,
                     int64_t len, int64_t bs, int64_t g_heads, float scale, Q* out, Scratch& s, const int64_t* visit,
                     const Partial* part) {
  const int64_t lp = visit_len(len);
  const int64_t ps = (len + 15) / 16 * 16;  // a head's probabilities: softmax_row_bf16 writes whole 16s
  s.scores.resize(g_heads * lp);
  s.qf.resize(g_heads * DC);
  s.qb.resize(g_heads * DC);
  s.pb.resize(g_heads * ps);
  s.acc.resize(g_heads * DC);
  if (!visit) {
    s.offs.resize(lp);
    s.lin.resize(len);
    visit_order(table, start, len, bs, DC, s.lin.data(), s.offs.data());
    visit = s.offs.data();
  }
  for (int64_t i = 0; i < g_heads * DC; ++i) s.qf[i] = to_float(q[i]) * scale;  // scaled, then rounded
  inferlab_bf16::row_to_bf16(s.qf.data(), g_heads * DC, s.qb.data());

  float* sc = s.scores.data();
  for (int64_t g0 = 0; g0 < g_heads; g0 += 3) {
    const int64_t n = std::min<int64_t>(3, g_heads - g0);
    const uint16_t* qg = s.qb.data() + g0 * DC;
    const at::BFloat16* vpf = g0 == 0 ? vc : nullptr;
    if (n == 3) scores_group_dot<3, DC>(qg, kc, visit, lp, sc + g0 * lp, vpf);
    else if (n == 2) scores_group_dot<2, DC>(qg, kc, visit, lp, sc + g0 * lp, vpf);
    else scores_group_dot<1, DC>(qg, kc, visit, lp, sc + g0 * lp, vpf);
  }

  s.sum.resize(g_heads);
  s.max.resize(g_heads);
  for (int64_t g = 0; g < g_heads; ++g) {
    const float* r = sc + g * lp;
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < len; t += 16) {
      const __mmask16 live = len - t >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (len - t)) - 1);
      mv = _mm512_mask_max_ps(mv, live, mv, _mm512_maskz_loadu_ps(live, r + t));
    }
    s.max[g] = _mm512_reduce_max_ps(mv);
    s.sum[g] = inferlab_bf16::softmax_row_bf16(r, s.pb.data() + g * ps, len, ps, s.max[g]);
  }

  const uint32_t* pp = reinterpret_cast<const uint32_t*>(s.pb.data());
  for (int64_t g0 = 0; g0 < g_heads; g0 += 3) {
    const int64_t n = std::min<int64_t>(3, g_heads - g0);
    float* a = s.acc.data() + g0 * DC;
    const uint32_t* pg = pp + g0 * ps / 2;
    if (n == 3) accumulate_group_dot<3, DC>(a, pg, ps / 2, vc, visit, len);
    else if (n == 2) accumulate_group_dot<2, DC>(a, pg, ps / 2, vc, visit, len);
    else accumulate_group_dot<1, DC>(a, pg, ps / 2, vc, visit, len);
  }
  finish_task(s.acc.data(), s.sum.data(), s.max.data(), g_heads, DC, out, part);
}
#endif

// One (sequence, KV head): T is the cache's element type, Q the query's and output's.
// T = int8_t: kc / vc are codes and ks / vs this head's scales, one per slot (models/kv_cache.py);
// a row is dequantized in registers by folding its scale into the dot product (score =
// k_scale * (q . codes)) and into the probability that weights it (p * v_scale), so the inner
// loops are the float ones on widened codes. Other T: ks / vs are unused (null).
// The task covers the len positions from `start` on: the whole context, or one partition of it
// whose unnormalised result goes to *part (null: the whole context, normalised into out).
// `visit`: those positions' visit_order, or null to compute it here.
template <typename T, typename Q, int DC>
void decode_task(const Q* q, const T* kc, const T* vc, const float* ks, const float* vs, const int32_t* table,
                 int64_t start, int64_t len, int64_t bs, int64_t d, int64_t g_heads, float scale, Q* out, Scratch& s,
                 const int64_t* visit, const Partial* part) {
  constexpr bool kQuant = std::is_same_v<T, int8_t>;
  const int64_t lp = visit_len(len);
  s.scores.resize(g_heads * lp);
  s.qf.resize(g_heads * d);
  s.acc.assign(g_heads * d, 0.f);
  if (!visit) {
    s.offs.resize(lp);
    s.lin.resize(len);
    visit_order(table, start, len, bs, d, s.lin.data(), s.offs.data());
    visit = s.offs.data();
  }
  const int64_t* offs = visit;
  if constexpr (kQuant) {
    s.ksc.resize(lp);
    s.vsc.resize(lp);
    const int64_t nd = DC > 0 ? DC : d;
    for (int64_t t = 0; t < lp; ++t) {
      const int64_t slot = offs[t] / nd;
      s.ksc[t] = ks[slot];
      s.vsc[t] = vs[slot];
    }
  }
  for (int64_t i = 0; i < g_heads * d; ++i) s.qf[i] = to_float(q[i]) * scale;

  // Pass 1: scores[g][t] = (scale q_g) . k_t  (t in visiting order)
  float* sc = s.scores.data();
  const T* rows[8];
  constexpr bool kWide = kGrouped<DC>;  // scores_group / accumulate_group
  if constexpr (kWide)
    scores_all<T, DC>(s.qf.data(), kc, vc, offs, lp, sc, g_heads, kQuant ? s.ksc.data() : nullptr);
  else
  for (int64_t t0 = 0; t0 < lp; t0 += 8) {
    for (int j = 0; j < 8; ++j) rows[j] = kc + offs[t0 + j];
    if (t0 + 16 < lp)
      for (int j = 0; j < 8; ++j) prefetch_row(kc + offs[t0 + 16 + j], d);
    if constexpr (kQuant) {
      const __m256 kscale = _mm256_loadu_ps(s.ksc.data() + t0);
      for (int64_t g = 0; g < g_heads; ++g)
        _mm256_storeu_ps(sc + g * lp + t0,
                         _mm256_mul_ps(kscale, dot8<T, DC>(s.qf.data() + g * d, rows, static_cast<int>(d))));
    } else {
      for (int64_t g = 0; g < g_heads; ++g)
        _mm256_storeu_ps(sc + g * lp + t0, dot8<T, DC>(s.qf.data() + g * d, rows, static_cast<int>(d)));
    }
  }

  // Softmax per head over the len valid scores (the padding lanes are zeroed).
  s.sum.resize(g_heads);
  s.max.resize(g_heads);
  for (int64_t g = 0; g < g_heads; ++g) {
    float* r = sc + g * lp;
    s.sum[g] = softmax_row(r, len, lp, &s.max[g]);
    if constexpr (kQuant)  // each probability carries its V row's scale into pass 2 (padding lanes stay 0)
      for (int64_t t = 0; t < lp; t += 8)
        _mm256_storeu_ps(r + t, _mm256_mul_ps(_mm256_loadu_ps(r + t), _mm256_loadu_ps(s.vsc.data() + t)));
  }

  // Pass 2: acc[g] = sum_t p[g][t] v_t, a tile of V rows at a time, reused for every head.
  const T* vrows[kTile];
  if constexpr (kWide)
    accumulate_all<T, DC>(s.acc.data(), sc, lp, vc, offs, len, g_heads);
  else
  for (int64_t t0 = 0; t0 < len; t0 += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, len - t0));
    for (int j = 0; j < n; ++j) vrows[j] = vc + offs[t0 + j];
    for (int64_t j = t0 + kTile; j < std::min<int64_t>(t0 + 2 * kTile, len); ++j) prefetch_row(vc + offs[j], d);
    for (int64_t g = 0; g < g_heads; ++g)
      accumulate_rows<T, DC>(s.acc.data() + g * d, sc + g * lp + t0, vrows, n, static_cast<int>(d));
  }
  finish_task(s.acc.data(), s.sum.data(), s.max.data(), g_heads, d, out, part);
}

// decode_task with head_dim 64 and 128 unrolled at compile time; any other head_dim works.
// ks / vs: an int8 cache's scales for this head (see decode_task), else null; start, len, visit
// and part: see decode_task. dot: a bfloat16 cache multiplied by vdpbf16ps (decode_task_dot) at
// head_dim 64 / 128, where the variant has AVX512_BF16 (the caller checks: can_dot); else, and at
// other head dims, float32.
template <typename T, typename Q>
inline void decode_heads(const Q* q, const T* kc, const T* vc, const float* ks, const float* vs, const int32_t* table,
                         int64_t start, int64_t len, int64_t bs, int64_t d, int64_t g_heads, float scale, Q* out,
                         Scratch& s, const int64_t* visit = nullptr, bool dot = false, const Partial* part = nullptr) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (dot && d == 64)
      return decode_task_dot<Q, 64>(q, kc, vc, table, start, len, bs, g_heads, scale, out, s, visit, part);
    if (dot && d == 128)
      return decode_task_dot<Q, 128>(q, kc, vc, table, start, len, bs, g_heads, scale, out, s, visit, part);
  }
#endif
  if (d == 64)
    decode_task<T, Q, 64>(q, kc, vc, ks, vs, table, start, len, bs, d, g_heads, scale, out, s, visit, part);
  else if (d == 128)
    decode_task<T, Q, 128>(q, kc, vc, ks, vs, table, start, len, bs, d, g_heads, scale, out, s, visit, part);
  else
    decode_task<T, Q, 0>(q, kc, vc, ks, vs, table, start, len, bs, d, g_heads, scale, out, s, visit, part);
}

// Whether decode_heads can multiply a `cache` dtype cache in bf16 (`dot`): a bfloat16 cache, on
// the variant with AVX512_BF16.
inline bool can_dot(at::ScalarType cache) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return cache == at::kBFloat16;
#else
  (void)cache;
  return false;
#endif
}

// Every context length and every block a context uses, checked once before the threads start
// (in the caller's index dtype, so an int64 id past int32 cannot wrap into a valid one).
template <typename I>
void check_tables(const at::Tensor& tables, const at::Tensor& lens, int64_t bs, int64_t slots, const char* what) {
  const I* tp = tables.data_ptr<I>();
  const I* lp = lens.data_ptr<I>();
  const int64_t b = tables.size(0), maxb = tables.size(1);
  for (int64_t i = 0; i < b; ++i) {
    const int64_t len = lp[i];
    TORCH_CHECK_VALUE(len >= 1, what, ": context_lens[", i, "] is ", len,
                      "; a decode query attends to at least its own token");
    TORCH_CHECK_VALUE(len <= maxb * bs, what, ": context_lens[", i, "] = ", len,
                      " needs more than the ", maxb, " blocks of ", bs, " in its block table row");
    const int64_t need = (len + bs - 1) / bs;
    for (int64_t j = 0; j < need; ++j) {
      const int64_t blk = tp[i * maxb + j];
      TORCH_CHECK_VALUE(blk >= 0 && (blk + 1) * bs <= slots, what, ": block_tables[", i, ", ", j,
                        "] = ", blk, " is outside the cache's ", slots / bs, " blocks");
    }
  }
}

}  // namespace inferlab_attention
