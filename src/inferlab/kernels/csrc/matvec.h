// The weight-streaming matrix-vector core shared by linear.cpp (one linear layer per call) and
// decoder_step.cpp (a whole decode step per call): dot products of a few rows of float32 x with
// blocks of 4 weight rows stored as float32, float16, bfloat16 or int8, (AVX-512 BF16) bf16
// weights in panels of 16 output columns multiplied by vdpbf16ps, and w8a8's int8 codes in such
// panels (vpdpbusd on AVX-512 VNNI, vpmaddubsw on AVX2).
//
// A block of 4 weight rows is read from memory once per call, prefetched as one linear stream,
// and re-used for every row of x: converted in registers by each tile of 3 rows up to
// kDirectMaxRows rows (the tiles after the first re-read it from L1), else converted once into
// a small float32 buffer in L1 that an fp32 micro-kernel (3 rows of x by 4 rows of W, 12
// accumulators) re-reads.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace inferlab_matvec {

using namespace inferlab_simd;  // load8, to_float, hsum, hmax, pack32u

constexpr int kRowsW = 4;  // weight rows per block (one horizontal reduction handles 4 sums)
constexpr int kRowsX = 3;  // rows of x per micro-kernel call: 3 x 4 = 12 of the 16 ymm registers
// Up to this many rows of x the weights are read and widened in registers by each row tile (a
// block of 4 weight rows is re-read from L1 by the tiles after the first); from more rows on,
// widened once into an L1 buffer the tiles share. Why 8 and not kRowsX: speculative decoding's
// verification runs 1 + K rows (5 at K = 4) and small batches 4-8, and through the buffer 4-8
// rows cost 1.3-1.9x a 1-row step, against 1.1-1.5x read directly (the avx2 variant, SmolLM2's
// float16 weights, 2 threads, medians of 3 alternated, on a Zen 5 host: the step at 4 / 5 / 8
// rows 13.1 / 14.9 / 19.6 ms -> 10.9 / 12.8 / 15.3 ms; at 12-16 rows the two are even).
constexpr int kDirectMaxRows = 8;
// How far ahead of the reads the weight stream is prefetched. A block's rows are contiguous and
// consecutive blocks too, so the stream is linear: measured on one core of this EPYC, 4 KiB ahead
// took int8 from 6.4 to 14 GB/s and float16 from 11 to 13 GB/s (the hardware prefetcher alone
// does not keep enough lines in flight for 4 interleaved row streams); 8 KiB took a whole decode
// step's float16 weights from 10.4 to 11.5 GB/s on one core (the last of a block's 4 rows is
// 3.5 KiB past its first, so 4 KiB left it barely ahead), and 16 KiB against 8 KiB, 2 threads,
// 9 runs each alternated: median step 9.6 against 10.0 ms, lm_head 2.0 against 2.1 ms.
constexpr int64_t kPrefetchBytes = 16384;
// float16 rows on the AVX2 variant (its default 16-bit weights), in dot_tile and dot_pair: twice
// that. The default model's one-stream float16 decode on a Zen 3 (in-process A/B, alternated
// rounds): 32 KiB against 16 KiB 0.937x and 0.927x the step (8 of 8, 9 of 10 rounds faster), 24
// KiB 0.953x, 48 KiB 1.047x, 64 KiB 0.961x; at 32 rows 1.010x (even). bfloat16 rows even (0.998x,
// 5 of 10) and int8 rows slower (1.047x), so those stay at 16 KiB; the AVX-512 variant, not
// measured so, too.
template <typename T>
constexpr int64_t prefetch_ahead() {
#if defined(__AVX512F__)
  return kPrefetchBytes;
#else
  return std::is_same_v<T, at::Half> ? 2 * kPrefetchBytes : kPrefetchBytes;
#endif
}

// The four sums of a0..a3, in one register: fewer shuffles than four hsum calls.
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// out[i][j] = dot(x row i, w row j) over K, for MB rows of x and NB (4 or 1) rows of w.
// 16-bit and int8 weights (read from memory) are prefetched prefetch_ahead<T>() ahead, as one linear
// stream over the block (w .. w + NB * K); float32 ones are not (from block_dots they come from
// its L1 buffer when M > 3, and straight from memory, unprefetched, when M <= 3).
template <int MB, int NB, typename T>
inline void dot_tile(const float* x, int64_t ldx, const T* w, int64_t ldw, int64_t K, float out[][kRowsW]) {
  constexpr bool kStream = !std::is_same_v<T, float>;
  constexpr int kStepBytes = NB * 8 * sizeof(T);  // weight bytes one k-step consumes
  const char* pf = reinterpret_cast<const char*>(w) + prefetch_ahead<T>();
  __m256 acc[MB][NB];
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if constexpr (kStream) {
#pragma GCC unroll 2
      for (int c = 0; c < kStepBytes; c += 64) _mm_prefetch(pf + k * NB * sizeof(T) + c, _MM_HINT_T0);
    }
    __m256 xv[MB];
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i) xv[i] = _mm256_loadu_ps(x + i * ldx + k);
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      const __m256 wv = load8(w + j * ldw + k);
#pragma GCC unroll 4
      for (int i = 0; i < MB; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i) {
    if constexpr (NB == kRowsW) {
      _mm_storeu_ps(out[i], hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
    } else {
      for (int j = 0; j < NB; ++j) out[i][j] = hsum(acc[i][j]);
    }
  }
  for (; k < K; ++k)  // K not a multiple of 8
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) out[i][j] += x[i * ldx + k] * to_float(w[j * ldw + k]);
}

// out[i][j0], out[i][j0 + 1] = dot(x row i, w rows 0 and 1) over K for MB <= kPairMaxRows rows of
// x: the pair widened once per k step for every row of x. Why: dot_tile takes 3 rows of x at a
// time (with 4 weight rows its sums fill the 16 ymm registers), so 4-6 rows re-read and re-widen
// each block twice; speculative verification (1 + K = 5 rows) and small batches are those row
// counts. Each sum runs the same FMAs in the same order as dot_tile's and ends in hsum4's tree,
// so a row's outputs are the same bits at every row count. Measured with the avx2 variant (torch
// held to AVX2 too) on a Zen 4, SmolLM2's float16 weights, the decode step in alternated rounds
// in one process: 4 rows 17.18 -> 15.44 ms, 5 rows 20.03 -> 18.66 and 19.73 -> 18.65, 6 rows
// 19.99 -> 19.10 (8-12 rounds each; qkv, o and gate/up 8-12% faster, down even). 8 rows as
// pair tiles of 6 + 2 (or 4 + 4): 22.90 -> 27.25 ms, so from 7 rows on the blocks stay dot_tile's.
constexpr int kPairMaxRows = 6;  // 6 x 2 sums + 2 weights + 1 row of x: 15 of the 16 ymm registers
template <int MB, typename T>
inline void dot_pair(const float* x, int64_t ldx, const T* w, int64_t ldw, int64_t K, float out[][kRowsW], int j0) {
  constexpr bool kStream = !std::is_same_v<T, float>;
  constexpr int kStepBytes = 2 * 8 * sizeof(T);  // weight bytes one k-step consumes
  const char* pf = reinterpret_cast<const char*>(w) + prefetch_ahead<T>();
  __m256 acc[MB][2];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if constexpr (kStream) {
      const int64_t at = k * 2 * sizeof(T);
      if (at % 64 < kStepBytes) _mm_prefetch(pf + at, _MM_HINT_T0);  // once per cache line of the stream
    }
    const __m256 w0 = load8(w + k), w1 = load8(w + ldw + k);
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
      acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) {
    alignas(16) float s[4];
    _mm_store_ps(s, hsum4(acc[i][0], acc[i][1], acc[i][0], acc[i][1]));
    out[i][j0] = s[0];
    out[i][j0 + 1] = s[1];
  }
  for (; k < K; ++k)  // K not a multiple of 8
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < 2; ++j) out[i][j0 + j] += x[i * ldx + k] * to_float(w[j * ldw + k]);
}

template <typename T>
inline void convert_rows(const T* w, int64_t rows, int64_t K, const float* scale, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = w + r * K;
    const char* pf = reinterpret_cast<const char*>(src) + kPrefetchBytes;  // the linear stream, ahead
    for (int64_t c = 0; c < K * int64_t(sizeof(T)); c += 64) _mm_prefetch(pf + c, _MM_HINT_T0);
    float* d = dst + r * K;
    const float s = scale ? scale[r] : 1.0f;
    const __m256 sv = _mm256_set1_ps(s);
    int64_t k = 0;
    if (scale) {
      for (; k + 8 <= K; k += 8) _mm256_storeu_ps(d + k, _mm256_mul_ps(load8(src + k), sv));
    } else {
      for (; k + 8 <= K; k += 8) _mm256_storeu_ps(d + k, load8(src + k));
    }
    for (; k < K; ++k) d[k] = to_float(src[k]) * s;
  }
}

// out[i * kRowsW + j] = dot(x row i, w row j) over K, for the M rows of x (row stride K) and
// nb <= kRowsW rows of w (row stride K). buf: kRowsW * K floats of scratch, used from
// kDirectMaxRows + 1 rows on (float32 weights: kRowsX + 1).
template <typename T>
inline void block_dots(const float* x, int64_t M, int64_t K, const T* w, int nb, float* buf, float* out) {
  // Float32 weights are copied from 4 rows on: the copy streams them with prefetch, dot_tile does not.
  const bool convert = M > (std::is_same_v<T, float> ? kRowsX : kDirectMaxRows);
  if (convert) convert_rows(w, nb, K, nullptr, buf);
  auto rows = [&](auto wp) {
    using W = std::remove_cv_t<std::remove_pointer_t<decltype(wp)>>;
    auto tile = [&](auto mb_tag, int64_t m) {
      constexpr int MB = decltype(mb_tag)::value;
      auto* o = reinterpret_cast<float(*)[kRowsW]>(out + m * kRowsW);
      if (nb == kRowsW) {
        dot_tile<MB, kRowsW, W>(x + m * K, K, wp, K, K, o);
      } else {
        for (int j = 0; j < nb; ++j) {
          float one[MB][kRowsW];
          dot_tile<MB, 1, W>(x + m * K, K, wp + j * K, K, K, one);
          for (int i = 0; i < MB; ++i) o[i][j] = one[i][0];
        }
      }
    };
    for_row_tiles<kRowsX>(M, tile);
  };
  if (convert) {
    rows(static_cast<const float*>(buf));
  } else if (M > kRowsX && M <= kPairMaxRows && nb == kRowsW) {  // 4-6 rows: each pair of the block once
    auto pairs = [&](auto mb_tag, int64_t) {
      constexpr int MB = decltype(mb_tag)::value;
      auto* o = reinterpret_cast<float(*)[kRowsW]>(out);
      dot_pair<MB, T>(x, K, w, K, K, o, 0);
      dot_pair<MB, T>(x, K, w + 2 * K, K, K, o, 2);
    };
    tail_tile<kPairMaxRows>(M, 0, pairs);
  } else {
    rows(w);
  }
}

// y[i * ldy + j] = dots[i * kRowsW + j] * scale[r + j] + bias[r + j] for M rows and nb <= kRowsW
// columns: one block's sums out; scale and bias may be null.
inline void store_block(const float* dots, int64_t M, int nb, const float* scale, const float* bias, int64_t r,
                        float* y, int64_t ldy) {
  for (int64_t i = 0; i < M; ++i)
    for (int j = 0; j < nb; ++j) {
      float v = dots[i * kRowsW + j];
      if (scale) v *= scale[r + j];
      if (bias) v += bias[r + j];
      y[i * ldy + j] = v;
    }
}

// y[i * ldy + r] = (x row i) . (w row r0 + r) * scale[r0 + r] + bias[r0 + r] for r in [0, rows),
// block by block; scale and bias may be null. buf: kRowsW * K floats, dots: kRowsW * M floats.
template <typename T>
inline void row_products(const float* x, int64_t M, int64_t K, const T* w, int64_t r0, int64_t rows,
                         const float* scale, const float* bias, float* buf, float* dots, float* y, int64_t ldy) {
  for (int64_t b = 0; b < rows; b += kRowsW) {
    const int nb = static_cast<int>(std::min<int64_t>(kRowsW, rows - b));
    block_dots(x, M, K, w + (r0 + b) * K, nb, buf, dots);
    store_block(dots, M, nb, scale, bias, r0 + b, y + b, ldy);
  }
}


// ---- bf16 weights packed in panels of 16 output columns (the decode step's layout) ----------
// Why: the row layout above multiplies along K, so every output ends in a horizontal reduction
// of 16 lanes; at SmolLM2's K = 576 that is ~14% of a tile's instructions, and its 4-row blocks
// re-read from L1 leave little room for x's rows. Packed in panels, a zmm of weights holds 16
// output columns x 2 consecutive k (vdpbf16ps's pairs), so a pair of x values broadcast to all
// lanes makes 16 outputs' partial sums at once: no reductions, and each accumulator is 16
// finished outputs. Panel p of a [N, K] matrix holds columns 16p .. 16p + 15 as [Kp / 2][16][2]
// (Kp = K rounded up to even), contiguous, the panels one after another, zero-padded past N and
// K: one linear stream per panel. Measured on one core of this Zen 5, SmolLM2's shapes, 32 rows,
// 30 layers' worth streamed from memory: 273-358 GFLOP/s against 168-220 for the row layout's
// 6 x 4 tiles (8 x-rows x 3 panels, 24 of the 32 zmm holding sums, beat 6 x 4, 4 x 4 and 12 x 2).
// The layout's constants are here, for every variant (the decode step checks a layout with them);
// its kernels (panel_products_bf16) are in the vdpbf16ps section below.
constexpr int64_t kPanel = 16;    // output columns per panel: one zmm of float32 sums
constexpr int kPanelRowsX = 8;    // rows of x per tile
constexpr int kPanelsPerTile = 3; // panels per tile: 8 x 3 sums + 3 weights + 1 broadcast

inline int64_t panel_k(int64_t K) { return (K + 1) / 2 * 2; }

#if defined(__AVX512DQ__)
inline __m256 fold512(__m512 a) {  // 16 lanes -> 8, the sums of the two halves
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
}

// How a panel tile's weight loads prefetch (load_panels below).
enum PanelPrefetch : int {
  kPrefetchNone = 0,   // the panels are in cache (another row tile read or fetched them)
  kPrefetchAhead = 1,  // from memory: each stream prefetched `ahead` bytes further, into L1
};

// The next 64 bytes of each of NB panels (panel j's at wp + j * ps + at, in bytes), each stream
// prefetched as `stream` says: a panel tile's weight loads.
template <int NB>
inline void load_panels(const void* wp, int64_t ps, int64_t at, PanelPrefetch stream, int64_t ahead, __m512i* out) {
#pragma GCC unroll 4
  for (int j = 0; j < NB; ++j) {
    const char* src = static_cast<const char*>(wp) + j * ps + at;
    if (stream != kPrefetchNone) _mm_prefetch(src + ahead, _MM_HINT_T0);
    out[j] = _mm512_loadu_si512(src);
  }
}

// The next column tile of a panel product, fetched into L1 by the row tiles of the current one,
// each its share, one line at a time as its k loop steps. Why: left to the first row tile alone
// (the `stream` prefetch above), a tile of 3 panels wants 192 bytes per 24 vdpbf16ps, more than
// one core's misses in flight deliver, and stalls while the later row tiles re-read from cache
// with memory idle. Measured on a Zen 4, one core, 32 rows, SmolLM2's gate/up and down streamed
// from memory: 177 -> 203 and 192 -> 206 GFLOP/s (223 with the weights in L2); prefetching into
// L2 instead: 188 / 189.
class NextTile {
 public:
  NextTile() = default;
  // `bytes` of panels at `next` (null: nothing to fetch), shared by `tiles` row tiles of `steps`
  // k steps each; this is row tile `r`'s share.
  NextTile(const void* next, int64_t bytes, int64_t r, int64_t tiles, int64_t steps)
      : next_(static_cast<const char*>(next)),
        inc_((static_cast<uint64_t>(bytes) << 16) / static_cast<uint64_t>(tiles * steps)),
        pos_(static_cast<uint64_t>(r * steps) * inc_) {}
  // One k step: the line this share has reached, once.
  inline void step() {
    if (!next_) return;
    const uint64_t line = pos_ >> 22;  // bytes << 16, 64 bytes a line
    if (line != line_) _mm_prefetch(next_ + (line << 6), _MM_HINT_T0);
    line_ = line;
    pos_ += inc_;
  }

 private:
  const char* next_ = nullptr;
  uint64_t inc_ = 0, pos_ = 0, line_ = ~uint64_t{0};
};
#endif

#if defined(__AVX512BF16__)
// ---- vdpbf16ps (the AVX-512 variant) -------------------------------------------------------
// Why: with 16-bit weights, the float32 path above spends two instructions (widen, FMA) per 8
// products; vdpbf16ps does 32 per instruction from bf16 bytes, once x is rounded to bf16 (per
// call, M x K values: cheap beside the M x K x rows products). Sums stay float32, so a dot
// differs from the float32 path only by x's rounding (2^-9 relative per element).
// Two layouts: bf16 weights in panels (below: the decode step's and linear_panels'), and rows of
// bf16 in L1 (int8 codes converted block by block, kI8Bf16MinRows): a block of 4 rows re-read by
// each tile of 6 x-rows, 6 x 4 = 24 of the 32 zmm registers holding the sums.
constexpr int kRowsX16 = 6;

// x (M x K float32, contiguous) rounded to bf16, round to nearest even, into dst (M x K).
inline void x_to_bf16(const float* x, int64_t n, uint16_t* dst) {
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(x + k));
    _mm512_storeu_si512(dst + k, reinterpret_cast<const __m512i&>(v));
  }
  for (; k < n; ++k) dst[k] = at::BFloat16(x[k]).x;
}

// y[i * ldy + j] = dot(x row i, w row j) over K (* scale[j] + bias[j], either may be null) for MB
// rows of bf16 x and NB (4 or 1) rows of bf16 w (in L1). The sums go straight to y, 4 at a time,
// scaled in registers: at 32 rows a dots buffer copied out one float at a time cost ~15% of the
// products.
template <int MB, int NB>
inline void dot_tile_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K,
                          const float* scale, const float* bias, float* y, int64_t ldy) {
  __m512 acc[MB][NB];
#pragma GCC unroll 6
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  auto step = [&](auto load) {
    __m512bh wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      const __m512i v = load(w + j * ldw);
      wv[j] = reinterpret_cast<const __m512bh&>(v);
    }
#pragma GCC unroll 6
    for (int i = 0; i < MB; ++i) {
      const __m512i v = load(x + i * ldx);
      const __m512bh xv = reinterpret_cast<const __m512bh&>(v);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) step([k](const uint16_t* p) { return _mm512_loadu_si512(p + k); });
  if (k < K) {  // K not a multiple of 32: masked loads, the missing lanes zero
    const __mmask32 mask = static_cast<__mmask32>((uint64_t{1} << (K - k)) - 1);
    step([k, mask](const uint16_t* p) { return _mm512_maskz_loadu_epi16(mask, p + k); });
  }
  if constexpr (NB == kRowsW) {
    const __m128 sv = scale ? _mm_loadu_ps(scale) : _mm_set1_ps(1.0f);
    const __m128 bv = bias ? _mm_loadu_ps(bias) : _mm_setzero_ps();
#pragma GCC unroll 6
    for (int i = 0; i < MB; ++i) {
      __m128 v = hsum4(fold512(acc[i][0]), fold512(acc[i][1]), fold512(acc[i][2]), fold512(acc[i][3]));
      _mm_storeu_ps(y + i * ldy, _mm_fmadd_ps(v, sv, bv));
    }
  } else {
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) {
        float v = _mm512_reduce_add_ps(acc[i][j]);
        if (scale) v *= scale[j];
        if (bias) v += bias[j];
        y[i * ldy + j] = v;
      }
  }
}

// One block of nb <= 4 bf16 weight rows (row stride K) times the M bf16 rows of xb, into
// y[i * ldy + j], scaled and biased per row (either null).
inline void block_tiles_bf16(const uint16_t* xb, int64_t M, int64_t K, const uint16_t* wp, int nb, const float* sc,
                             const float* bs, float* y, int64_t ldy) {
  auto tile = [&](auto mb_tag, int64_t m) {
    constexpr int MB = decltype(mb_tag)::value;
    float* yt = y + m * ldy;
    if (nb == kRowsW) {
      dot_tile_bf16<MB, kRowsW>(xb + m * K, K, wp, K, K, sc, bs, yt, ldy);
    } else {
      for (int j = 0; j < nb; ++j)
        dot_tile_bf16<MB, 1>(xb + m * K, K, wp + j * K, K, K, sc ? sc + j : nullptr, bs ? bs + j : nullptr, yt + j,
                             ldy);
    }
  };
  for_row_tiles<kRowsX16>(M, tile);
}

// x (M x K float32, contiguous) rounded to bf16 into dst (M x Kp), a zero past K when K is odd.
inline void x_to_bf16_rows(const float* x, int64_t M, int64_t K, uint16_t* dst) {
  const int64_t kp = panel_k(K);
  if (kp == K) {
    x_to_bf16(x, M * K, dst);
    return;
  }
  for (int64_t i = 0; i < M; ++i) {
    x_to_bf16(x + i * K, K, dst + i * kp);
    dst[i * kp + K] = 0;
  }
}

// 16 sums out, masked to the first `mask` lanes: float32 as they are, or rounded to bf16 (round
// to nearest even, as the rest of the bf16 path rounds).
inline void store16(float* y, __mmask16 mask, __m512 v) { _mm512_mask_storeu_ps(y, mask, v); }
inline void store16(at::BFloat16* y, __mmask16 mask, __m512 v) {
  const __m256bh h = _mm512_cvtneps_pbh(v);
  _mm256_mask_storeu_epi16(y, mask, reinterpret_cast<const __m256i&>(h));
}

// y[i * ldy + 16j + c] = sum over k of x[i][k] * panel j's column c (* scale + bias, either
// null), for MB rows of x (bf16, stride ldx) and NB panels from wp on (each 16 * kp values);
// the last panel stores `last` <= 16 columns. `stream`: the panels come from memory (prefetched
// ahead, load_panels); `fetch`: this row tile's share of the next column tile.
template <int MB, int NB, typename Y>
inline void panel_tile_bf16(const uint16_t* x, int64_t ldx, const uint16_t* wp, int64_t kp, PanelPrefetch stream,
                            NextTile fetch, const float* scale, const float* bias, int last, Y* y, int64_t ldy) {
  constexpr int64_t kAhead = kPrefetchBytes / NB;  // bytes ahead in each panel's stream
  const int64_t ps = kPanel * kp;                  // values per panel
  __m512 acc[MB][NB];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kp / 2; ++p) {
    fetch.step();
    __m512i wi[NB];
    load_panels<NB>(wp, ps * 2, p * 4 * kPanel, stream, kAhead, wi);
    __m512bh wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) wv[j] = reinterpret_cast<const __m512bh&>(wi[j]);
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * ldx + 2 * p, sizeof(pair));
      const __m512i b = _mm512_set1_epi32(pair);
      const __m512bh xb = reinterpret_cast<const __m512bh&>(b);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, wv[j]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NB; ++j) {
    const int cols = j == NB - 1 ? last : static_cast<int>(kPanel);
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
    const __m512 sv = scale ? _mm512_maskz_loadu_ps(mask, scale + j * kPanel) : _mm512_set1_ps(1.0f);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + j * kPanel) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) store16(y + i * ldy + j * kPanel, mask, _mm512_fmadd_ps(acc[i][j], sv, bv));
  }
}

// MB rows of x (bf16, stride ldx) times np panels from wp on (each 16 * kp values), one panel
// after the other: y[i * ldy + 16j + c] = dot(x row i, panel j's column c) (* scale + bias,
// either null); the last panel stores `last` <= 16 columns. Why: a tile of 3 panels read side by
// side is 3 interleaved streams 2 * kp * 16 bytes apart, which memory serves more slowly than one
// linear stream (2 threads of a Zen 4 reading SmolLM2-sized runs: 24-28 GB/s against 28-32); with
// a few rows nothing is lost by reading x once per panel. One sum per row and panel, in k order,
// as panel_tile_bf16 keeps it: a row's sums are the same bits at every row count, so batching
// and speculative verification change no token (tests/test_kernels_linear.py); at one row it
// runs as fast as four sums split over k (11.46 against 11.58 ms, 14 rounds). SmolLM2's decode
// step on that Zen 4, alternated rounds in one process against the 3-panel tiles: 1 row 13.2 ->
// 10.6 ms (20 rounds; 10.1 with decoder_step.cpp's per-thread runs too), 2 rows 13.2 -> 11.3, 3
// rows 12.4 -> 11.5, 4 rows 14.6 -> 14.3, 5 rows 16.4 -> 17.0, 8 rows 16.7 -> 20.0 (10 rounds
// each; these with the sums split over k). The rows past 3 lost because nothing ran ahead of
// their slower loop (a step per 64 bytes of weights takes one broadcast and one vdpbf16ps per
// row): from kRowsPrefetchFrom rows on, the stream is prefetched kRowsAhead bytes ahead into L1,
// and so every one-tile product (up to kPanelStreamRows = 8 rows: a decode step of a few streams,
// speculative verification at K = 4 is 5) streams its panels one after the other. The decode
// step on a Zen 4, in-process A/B rounds alternated against the 3-panel tile (with its L2
// prefetch): 3 rows 12.88 -> 12.07 ms (the prefetch alone, 12 rounds), 4 rows 13.17 -> 11.33,
// 5 rows 14.01 -> 12.93, 8 rows 16.11 -> 15.09 (10 rounds each); 2048 bytes ahead was within
// 2% of 3072, 4096 and 6144 behind them; at one and two rows no gain (10.29 against 11.15 ms at
// one row, 12 rounds, in a slow spell; 10.21 / 10.30 at two), so those keep the hardware's.
constexpr int kPanelStreamRows = kPanelRowsX;
constexpr int kRowsPrefetchFrom = 3;
constexpr int64_t kRowsAhead = 3072;
template <int MB, typename Y>
inline void panel_rows_bf16(const uint16_t* x, int64_t ldx, const uint16_t* wp, int64_t kp, int64_t np, int last,
                            const float* scale, const float* bias, Y* y, int64_t ldy) {
  const int64_t steps = kp / 2;  // k pairs: 64 bytes of a panel each
  for (int64_t j = 0; j < np; ++j) {
    const uint16_t* w = wp + j * kPanel * kp;
    __m512 acc[MB];
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < steps; ++p) {
      if constexpr (MB >= kRowsPrefetchFrom)
        _mm_prefetch(reinterpret_cast<const char*>(w + p * 2 * kPanel) + kRowsAhead, _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(w + p * 2 * kPanel);
      const __m512bh wv = reinterpret_cast<const __m512bh&>(v);
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) {
        int32_t pair;
        std::memcpy(&pair, x + i * ldx + 2 * p, sizeof(pair));
        const __m512i b = _mm512_set1_epi32(pair);
        acc[i] = _mm512_dpbf16_ps(acc[i], reinterpret_cast<const __m512bh&>(b), wv);
      }
    }
    const int cols = j == np - 1 ? last : static_cast<int>(kPanel);
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
    const __m512 sv = scale ? _mm512_maskz_loadu_ps(mask, scale + j * kPanel) : _mm512_set1_ps(1.0f);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + j * kPanel) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) store16(y + i * ldy + j * kPanel, mask, _mm512_fmadd_ps(acc[i], sv, bv));
  }
}

// The amx variant's tile products (amx.h, included at the end of this file): panel_products_bf16
// hands every product to them (K a whole number of 32-value tiles), panel_products_i8 those of
// kAmxMinRowsI8 rows or more. Measured on 2 cores of a Xeon with AMX, SmolLM2's layer shapes,
// GFLOP/s against the vdpbf16ps / vpdpbusd kernels (medians of 7, two rounds): bf16 at 1 row
// 68-72 against 43-45 (one vdpbf16ps chain per panel waits on its latency), 8 rows 437-471
// against 173-190, 16 rows 720-765 against 181-187, 512 rows ~1,270 against ~200. int8 (session
// 37, the tiles then loading each group's corrections): 1 row 88-102 against 123-134, 4 rows
// 344-352 against 373-391, 8 rows even, 12 rows 649-733 against 602-637, so tiles from 9 rows;
// with tdpbssd on the signed codes (amx.h), the default model's w8a8 decode step, in-process
// rounds alternated (8), tiles from 2 / 3 rows against from 9: 2 streams 5.12 / - against 5.89
// ms, 4 streams 6.70 / 6.53 against 8.39, 8 streams 9.16 / 9.01 against 11.08; at one stream the
// tiles lost (4.76 against 4.53 ms).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
constexpr int64_t kAmxMinRowsI8 = 2;
template <typename Y>
inline void amx_products_bf16(const uint16_t* xb, int64_t ldx, int64_t M, int64_t kp, const uint16_t* w,
                              int64_t rows, const float* scale, const float* bias, Y* y, int64_t ldy, bool cold);
inline void amx_products_i8(const int8_t* xs, const float* sx, int64_t M, int64_t groups, const int8_t* w,
                            int64_t rows, const float* scale, const float* bias, float* y, int64_t ldy);
inline const int8_t* amx_signed_codes(const uint8_t* xq, int64_t ldx, int64_t M, std::vector<int8_t>& buf);
#endif

// row_products' contract for bf16 weights in panels (kernels/linear.py pack_panels of an [N, K]
// matrix) and x already in bf16 (M rows of stride ldx >= Kp, zero past K):
// y[i * ldy + r] = (x row i) . (w row r0 + r) * scale[r0 + r] + bias[r0 + r] for r in [0, rows),
// r0 a multiple of 16 and r0 + rows <= N; y float32 or bf16. Up to kPanelStreamRows rows, the
// panels one after the other (panel_rows_bf16); more, column tiles of 3 panels, each streamed
// from memory by its first tile of 8 x-rows; the others re-read it from cache. `cold`:
// the panels come from memory (a decode step's weights), so with more than one row tile, each
// column tile after the first is fetched while the row tiles of the one before run (NextTile);
// else (a prefill's later row blocks, whose panels are in L3) the fetches only cost: measured
// on a Zen 4 with the weights in L3, 216 -> 206 GFLOP/s on one core. `after` (or null): panels
// the caller multiplies next (its next task's first columns, `after_cols` of them), fetched the
// same way by the last column tile, so that a task's first tile does not start cold either.
template <typename Y>
inline void panel_products_bf16(const uint16_t* xb, int64_t ldx, int64_t M, int64_t K, const at::BFloat16* panels,
                                int64_t r0, int64_t rows, const float* scale, const float* bias, Y* y, int64_t ldy,
                                bool cold, const at::BFloat16* after = nullptr, int64_t after_cols = 0) {
  const int64_t kp = panel_k(K);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(panels) + r0 * kp;  // panel r0 / 16
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
  if (kp % 32 == 0) {
    amx_products_bf16(xb, ldx, M, kp, w, rows, scale ? scale + r0 : nullptr, bias ? bias + r0 : nullptr, y, ldy,
                      cold);
    return;
  }
#endif
  if (M <= kPanelStreamRows) {  // a few rows: the panels one after the other (panel_rows_bf16)
    const int64_t np = (rows + kPanel - 1) / kPanel;
    const int last = static_cast<int>(rows - (np - 1) * kPanel);
    const float* sc = scale ? scale + r0 : nullptr;
    const float* bs = bias ? bias + r0 : nullptr;
    for_row_tiles<kPanelStreamRows>(M, [&](auto mb_tag, int64_t m) {
      panel_rows_bf16<decltype(mb_tag)::value>(xb + m * ldx, ldx, w, kp, np, last, sc, bs, y + m * ldy, ldy);
    });
    return;
  }
  // Tiles of 3 panels by 8 x-rows; where 4 panels are left (a 64-wide head of qkv), one tile of
  // 4 by 6 x-rows (24 sums too) rather than 3 + a lone panel, whose 8 sums per weight load
  // leave the tile bound by x's broadcasts (the qkv phase at 32 rows: 424 GFLOP/s with it).
  auto four = [](int64_t left) { return left > kPanel * kPanelsPerTile && left <= kPanel * 4; };
  auto width = [&](int64_t left) { return std::min<int64_t>(kPanel * (four(left) ? 4 : kPanelsPerTile), left); };
  for (int64_t c = 0; c < rows;) {
    const int64_t left = rows - c, cols = width(left);
    const bool wide = four(left);  // one tile of 4 panels by kRowsX16 x-rows
    const int np = static_cast<int>((cols + kPanel - 1) / kPanel);
    const int last = static_cast<int>(cols - (np - 1) * kPanel);
    const int64_t mb = wide ? kRowsX16 : kPanelRowsX, tiles = (M + mb - 1) / mb;
    const uint16_t* wp = w + c * kp;
    // The next column tile's panels (or `after`'s), fetched by this one's row tiles when there are several.
    const bool last_tile = c + cols >= rows;
    const int64_t next_cols = !last_tile ? width(left - cols)
                              : after    ? std::min<int64_t>(after_cols, kPanel * kPanelsPerTile)
                                         : 0;
    const uint16_t* next_ptr = !last_tile ? wp + np * kPanel * kp : reinterpret_cast<const uint16_t*>(after);
    const int64_t next_bytes = cold && tiles > 1 ? (next_cols + kPanel - 1) / kPanel * kPanel * kp * 2 : 0;
    const bool fetched = cold && c > 0 && tiles > 1;  // the row tiles before fetched this one
    const float* sc = scale ? scale + r0 + c : nullptr;
    const float* bs = bias ? bias + r0 + c : nullptr;
    // Row tile m / mb's prefetch (load_panels `stream`) and share of the next column tile.
    auto stream = [&](int64_t m) { return m > 0 || fetched ? kPrefetchNone : kPrefetchAhead; };
    auto fetch = [&](int64_t m) {
      return NextTile(next_bytes ? next_ptr : nullptr, next_bytes, m / mb, tiles, kp / 2);
    };
    auto tile = [&](auto mb_tag, int64_t m) {
      constexpr int MB = decltype(mb_tag)::value;
      const uint16_t* xt = xb + m * ldx;
      Y* yt = y + m * ldy + c;
      if (np == 3) panel_tile_bf16<MB, 3>(xt, ldx, wp, kp, stream(m), fetch(m), sc, bs, last, yt, ldy);
      else if (np == 2) panel_tile_bf16<MB, 2>(xt, ldx, wp, kp, stream(m), fetch(m), sc, bs, last, yt, ldy);
      else panel_tile_bf16<MB, 1>(xt, ldx, wp, kp, stream(m), fetch(m), sc, bs, last, yt, ldy);
    };
    auto tile4 = [&](auto mb_tag, int64_t m) {
      constexpr int MB = decltype(mb_tag)::value;
      panel_tile_bf16<MB, 4>(xb + m * ldx, ldx, wp, kp, stream(m), fetch(m), sc, bs, last, y + m * ldy + c, ldy);
    };
    if (wide) for_row_tiles<kRowsX16>(M, tile4);
    else for_row_tiles<kPanelRowsX>(M, tile);
    c += cols;
  }
}

// ---- int8 weights by vdpbf16ps from kI8Bf16MinRows rows of x --------------------------------
// Why: int8 codes converted to float32 in registers (row_products above) cost 3 instructions per
// 8 products, so from a few rows of x on int8 weight-only ran 3x slower than bf16 weights (32
// rows, SmolLM2's shapes, one core). A code -127..127 is exact in bf16, so each block of 4 rows
// is converted once into L1 (its int8 stream prefetched as before) and multiplied by vdpbf16ps
// with x rounded to bf16, as the bf16 weights and oneDNN's path from MKL_MIN_ROWS rows round it;
// the row scales are applied to the float32 sums. Below kI8Bf16MinRows rows the float32 path
// (exact products) stays: one or two decode rows are bound by the weight stream, not arithmetic.
constexpr int64_t kI8Bf16MinRows = 4;  // kernels/linear.py INT8_BF16_MIN_ROWS

inline void codes_to_bf16(const int8_t* w, int64_t rows, int64_t K, uint16_t* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* src = w + r * K;
    const char* pf = reinterpret_cast<const char*>(src) + kPrefetchBytes;  // the linear stream, ahead
    for (int64_t c = 0; c < K; c += 64) _mm_prefetch(pf + c, _MM_HINT_T0);
    uint16_t* d = dst + r * K;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k))));
      const __m512 hi =
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k + 16))));
      const __m512bh v = _mm512_cvtne2ps_pbh(hi, lo);
      _mm512_storeu_si512(d + k, reinterpret_cast<const __m512i&>(v));
    }
    for (; k < K; ++k) d[k] = at::BFloat16(static_cast<float>(src[k])).x;
  }
}

// row_products for int8 weights (weight-only): the float32 template below kI8Bf16MinRows rows,
// else the codes as bf16 tiles (above). buf: kRowsW * K floats, here holding 4 rows of bf16 codes.
inline void row_products(const float* x, int64_t M, int64_t K, const int8_t* w, int64_t r0, int64_t rows,
                         const float* scale, const float* bias, float* buf, float* dots, float* y, int64_t ldy) {
  if (M < kI8Bf16MinRows) {
    row_products<int8_t>(x, M, K, w, r0, rows, scale, bias, buf, dots, y, ldy);
    return;
  }
  thread_local std::vector<uint16_t> xb;  // per thread, grown once
  if (xb.size() < static_cast<size_t>(M * K)) xb.resize(M * K);
  x_to_bf16(x, M * K, xb.data());
  uint16_t* wb = reinterpret_cast<uint16_t*>(buf);
  for (int64_t b = 0; b < rows; b += kRowsW) {
    const int nb = static_cast<int>(std::min<int64_t>(kRowsW, rows - b));
    const int64_t r = r0 + b;
    codes_to_bf16(w + r * K, nb, K, wb);
    block_tiles_bf16(xb.data(), M, K, wb, nb, scale ? scale + r : nullptr, bias ? bias + r : nullptr, y + b,
                     ldy);
  }
}
#endif  // __AVX512BF16__

// ---- int8 weights x int8 activations (weight_dtype w8a8) -----------------------------------
// Why: int8 weights are a quarter of float32's bytes, and converting them to float32 in
// registers (above) costs 3 instructions per 8 products; an integer dot product does 32
// (vpmaddubsw, AVX2) or 64 (vpdpbusd, AVX-512 VNNI) per instruction. x is quantized on the fly,
// per group of values, symmetric: s = max|x_group| / qmax, q = round(x / s) in [-qmax, qmax]
// (to nearest even). Per group, not per row: one scale per row let an outlier channel crush the
// rest, and on SmolLM2 greedy tokens parted from float32's within 1-2 tokens on 3 of 4 prompts.
// Each group's integer sum dot_g(q, w) is exact; y = sum_g dot_g * s_g (float32) * w's row scale.
// The group and qmax are each variant's own (kI8ScaleGroup, kI8QMax, below): 192 values and 127
// on AVX-512 (vpdpbusd takes 8-bit x whole; a scale per 3 of vpdpbusd's 64-value groups, see
// quantize_row_u8), 16 values and 63 on AVX2 (vpmaddubsw's int16 pairs hold 7-bit x exactly; the
// smaller group buys back the lost bit). Decided once per build and reported (kernels/build.py
// KernelInfo, linear.cpp's w8a8_numerics). The outlier channels that make groups necessary are
// mostly taken off x at load (models/smoothing.py, SmoothQuant's scales folded into the weights).
//
// Both variants keep the codes in panels of 16 output columns (panel_products_i8), and x's codes
// in rows of whole kI8Group values (i8_groups) with a scale per kI8ScaleGroup of them.

constexpr int64_t kI8Group = 64;  // k values a panel and x's code rows are padded to = bytes per vpdpbusd

inline int64_t i8_groups(int64_t K) { return (K + kI8Group - 1) / kI8Group; }
inline int64_t i8_scale_groups(int64_t K);  // scales per row of x's codes (below the variants)

// A process-wide unique id for one quantization of x (never 0): panel_products_i8 callers pass it
// with the codes, and the AVX2 variant (and the amx variant's tiles) then prepare those codes once
// per thread, not once per call (a linear's columns go out in many calls: 8-14% of a 512-row product).
inline uint64_t next_x_epoch() {
  static std::atomic<uint64_t> epochs{0};
  return ++epochs;
}

// The codes a thread's own copy of x (the avx2 variant's TiledX, the amx variant's signed codes)
// was made from: `same` says whether these codes at this epoch are what it holds (epoch 0: never),
// and otherwise records them, the caller then making the copy anew.
struct MadeFrom {
  const uint8_t* xq = nullptr;
  int64_t m = 0;
  uint64_t epoch = 0;
  bool same(const uint8_t* q, int64_t rows, uint64_t e) {
    if (e != 0 && e == epoch && q == xq && rows == m) return true;
    xq = q, m = rows, epoch = e;
    return false;
  }
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
// -- the AVX-512 variant: vpdpbusd --
constexpr int64_t kI8GroupsPerScale = 3;     // x's codes per scale: 3 groups of 64 (see quantize_row_u8)
constexpr int64_t kI8ScaleGroup = kI8GroupsPerScale * kI8Group;  // x values per scale
constexpr int kI8QMax = 127;                  // x's codes: q in [-127, 127], stored as q + 128
constexpr uint8_t kI8PanelXor = 0;            // the panels hold the codes as they are
constexpr bool kI8ColumnSums = true;          // `corr` (below) is read
constexpr int64_t kI8ScaleBlock = 0;          // the scales are any float32 (the AVX2 variant's are not)
constexpr bool kI8SplitRows = false;          // linear.cpp products_i8 shares panels out (see the AVX2 variant's)
// vpdpbusd multiplies unsigned by signed bytes, so x is stored as u = q + 128, and
// dot(u, w) = dot(q, w) + 128 * sum(w_group): the weight's per-group sums, times -128, computed
// once at load (`corr`), start each group's integer sum, which is then exact.

// One row of x as u8 codes, padded to whole groups of 64 with 128 (q = 0), and its scales, one per
// kI8ScaleGroup values (the last may hold fewer). Why 192 values a scale and not 64: each scale
// is a step after the integer sums (convert, multiply-add per 16 outputs), and on the amx
// variant's tiles that step, once per tdpbssd at 64, held the products at ~1.8 TOP/s where the
// tiles alone run ~3.5 (profile_step.md, session 41); at 192 it comes once per three. The scale
// is coarser for it; the load-time smoothing (models/smoothing.py) more than pays that back.
inline void quantize_row_u8(const float* x, int64_t K, uint8_t* dst, float* scales) {
  const __m512i off = _mm512_set1_epi32(128);
  const int64_t width = i8_groups(K) * kI8Group;
  for (int64_t k0 = 0, sg = 0; k0 < width; k0 += kI8ScaleGroup, ++sg) {
    const int64_t n = std::min(kI8ScaleGroup, K - k0), span = std::min(kI8ScaleGroup, width - k0);
    const float* xg = x + k0;
    float amax = 0.f;
    if (n == kI8ScaleGroup) {
      __m512 mx = _mm512_abs_ps(_mm512_loadu_ps(xg));
      for (int c = 16; c < kI8ScaleGroup; c += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(xg + c)));
      amax = _mm512_reduce_max_ps(mx);
    } else {
      for (int64_t c = 0; c < n; ++c) amax = std::max(amax, std::fabs(xg[c]));
    }
    scales[sg] = amax / 127.f;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    uint8_t* d = dst + k0;
    if (n == kI8ScaleGroup) {
      const __m512 iv = _mm512_set1_ps(inv);
      for (int c = 0; c < kI8ScaleGroup; c += 16) {  // round to nearest even (MXCSR's default), + 128
        const __m512i q = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + c), iv)), off);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + c), _mm512_cvtepi32_epi8(q));
      }
    } else {
      for (int64_t c = 0; c < n; ++c) d[c] = static_cast<uint8_t>(std::nearbyint(xg[c] * inv) + 128.f);
      for (int64_t c = n; c < span; ++c) d[c] = 128;
    }
  }
}

// ---- w8a8 in panels of 16 output columns (vpdpbusd's layout) --------------------------------
// Why: in rows (as the AVX2 variant keeps them), every group of every (x row, weight row) pair
// ends in a convert and an FMA and every output in a horizontal reduction: ~3 instructions per
// 64 products, which left w8a8 slower than bf16 panels once a step had many rows (32 streams,
// prefill). Packed as bf16's panels are, a zmm of codes holds 16 output columns x 4 consecutive
// k (vpdpbusd's quads), and x's 4 codes of that quad broadcast to all lanes make 16 outputs'
// partial sums at once: 64 products per instruction, the int32 sums of a group of 64 k
// converted and scaled once per 16 of them. SmolLM2's layer shapes, 2 threads: 1,150 GOP/s at
// 32 rows and 1,400 at 512 against bf16 panels' 710 and 810 (weight-only int8, rows: 520-570).
// Panel p holds columns 16p .. 16p + 15 as [Kq / 4][16][4] int8 (Kq = K rounded up to whole
// groups of 64, zero past K), contiguous: one linear stream (kernels/linear.py pack_panels_i8).
// corr: -128 x each column's code sums per group, [panels, groups, 16] int32 (x is stored as
// u = q + 128: vpdpbusd multiplies unsigned by signed bytes), the start of each group's sums,
// which are then exact.
constexpr int kPanelRowsXI8 = 4;    // rows of x per tile: 4 x 3 int32 + 4 x 3 float sums, 3 weights, 1 broadcast
constexpr int kPanelsPerTileI8 = 3;

// x (M x K float32, contiguous) as u8 codes, M rows of stride i8_groups(K) * 64, and its
// scales (M x i8_scale_groups(K)): quantize_row_u8 per row.
inline void quantize_rows_u8(const float* x, int64_t M, int64_t K, uint8_t* dst, float* scales) {
  const int64_t ldx = i8_groups(K) * kI8Group, ls = i8_scale_groups(K);
  for (int64_t i = 0; i < M; ++i) quantize_row_u8(x + i * K, K, dst + i * ldx, scales + i * ls);
}

// The scales of code groups [g0, g0 + kI8GroupsPerScale) of `groups` are one: their integer sums
// add up before the one convert and multiply. `corr` (a panel's corrections, one vector of 16 a
// group) summed over them: where those sums start.
inline int64_t i8_scale_end(int64_t g0, int64_t groups) { return std::min(groups, g0 + kI8GroupsPerScale); }
inline __m512i i8_corrections(const int32_t* corr, int64_t g0, int64_t g1) {
  __m512i c = _mm512_loadu_si512(corr + g0 * kPanel);
  for (int64_t g = g0 + 1; g < g1; ++g) c = _mm512_add_epi32(c, _mm512_loadu_si512(corr + g * kPanel));
  return c;
}

// y[i * ldy + 16j + c] = (sum_g dot_g(q row i, panel j's column c) * sx[i][g]) * scale + bias
// (bias may be null) for MB rows of u8 x (stride ldx = groups * 64, scales sx + i * groups) and
// NB panels from wp on; the last panel stores `last` <= 16 columns. `stream`: the panels come
// from memory (prefetched ahead); `fetch`: this row tile's share of the next column tile.
template <int MB, int NB>
inline void panel_tile_i8(const uint8_t* x, int64_t ldx, const float* sx, int64_t groups, const int8_t* wp,
                          const int32_t* corr, PanelPrefetch stream, NextTile fetch, const float* scale,
                          const float* bias, int last, float* y, int64_t ldy) {
  constexpr int64_t kAhead = kPrefetchBytes / NB;  // bytes ahead in each panel's stream
  const int64_t ps = kPanel * groups * kI8Group;   // bytes per panel
  __m512 acc[MB][NB];
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t ls = (groups + kI8GroupsPerScale - 1) / kI8GroupsPerScale;  // scales a row
  for (int64_t sg = 0; sg < ls; ++sg) {
    const int64_t g0 = sg * kI8GroupsPerScale, g1 = i8_scale_end(g0, groups);
    __m512i s[MB][NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      const __m512i c = i8_corrections(corr + j * groups * kPanel, g0, g1);
#pragma GCC unroll 4
      for (int i = 0; i < MB; ++i) s[i][j] = c;
    }
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* xg = x + g * kI8Group;
#pragma GCC unroll 16
      for (int q = 0; q < kI8Group / 4; ++q) {
        fetch.step();
        __m512i wv[NB];
        load_panels<NB>(wp, ps, (g * kI8Group + q * 4) * kPanel, stream, kAhead, wv);
#pragma GCC unroll 4
        for (int i = 0; i < MB; ++i) {
          int32_t quad;
          std::memcpy(&quad, xg + i * ldx + 4 * q, sizeof(quad));
          const __m512i b = _mm512_set1_epi32(quad);
#pragma GCC unroll 4
          for (int j = 0; j < NB; ++j) s[i][j] = _mm512_dpbusd_epi32(s[i][j], b, wv[j]);
        }
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i) {
      const __m512 sv = _mm512_set1_ps(sx[i * ls + sg]);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][j]), sv, acc[i][j]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NB; ++j) {
    const int cols = j == NB - 1 ? last : static_cast<int>(kPanel);
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
    const __m512 sv = _mm512_maskz_loadu_ps(mask, scale + j * kPanel);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + j * kPanel) : _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i)
      _mm512_mask_storeu_ps(y + i * ldy + j * kPanel, mask, _mm512_fmadd_ps(acc[i][j], sv, bv));
  }
}

// panel_tile_i8 for MB rows of x (one row tile), np panels from wp on, one panel after the
// other (as panel_rows_bf16, for the same reason: one linear stream). Two sums per group at one
// row hide vpdpbusd's latency; integer sums are exact, so a row's outputs are still the same bits
// at every row count. The w8a8 decode step of SmolLM2 on a Zen 4, alternated rounds in
// one process against the 3-panel tiles: 1 row 7.97 -> 6.69 ms (12 rounds), 4 rows 9.67 -> 8.13;
// and up to kPanelStreamRowsI8 rows in one pass (2 sums a row: 16 of the 32 zmm registers)
// against a tile of 4 rows plus one of the rest: 5 rows (speculative verification at K = 4)
// 10.93 -> 8.95 ms (10 rounds), 8 rows 11.72 -> 10.34 (8 rounds).
constexpr int kPanelStreamRowsI8 = 8;
template <int MB>
inline void panel_rows_i8(const uint8_t* x, int64_t ldx, const float* sx, int64_t groups, const int8_t* wp,
                          const int32_t* corr, int64_t np, int last, const float* scale, const float* bias, float* y,
                          int64_t ldy) {
  constexpr int U = MB == 1 ? 2 : 1;
  const int64_t ps = kPanel * groups * kI8Group;  // bytes per panel
  const int64_t ls = (groups + kI8GroupsPerScale - 1) / kI8GroupsPerScale;  // scales a row
  for (int64_t j = 0; j < np; ++j) {
    const int8_t* w = wp + j * ps;
    __m512 acc[MB];
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t sg = 0; sg < ls; ++sg) {
      const int64_t g0 = sg * kI8GroupsPerScale, g1 = i8_scale_end(g0, groups);
      __m512i s[U][MB];
      const __m512i c = i8_corrections(corr + j * groups * kPanel, g0, g1);
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) {
        s[0][i] = c;
        if constexpr (U > 1) s[1][i] = _mm512_setzero_si512();
      }
      for (int64_t g = g0; g < g1; ++g) {
        const int8_t* wg = w + g * kI8Group * kPanel;
#pragma GCC unroll 16
        for (int q = 0; q < kI8Group / 4; ++q) {
          const __m512i wv = _mm512_loadu_si512(wg + q * 4 * kPanel);
#pragma GCC unroll 8
          for (int i = 0; i < MB; ++i) {
            int32_t quad;
            std::memcpy(&quad, x + i * ldx + g * kI8Group + 4 * q, sizeof(quad));
            s[q % U][i] = _mm512_dpbusd_epi32(s[q % U][i], _mm512_set1_epi32(quad), wv);
          }
        }
      }
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) {
        __m512i t = s[0][i];
        if constexpr (U > 1) t = _mm512_add_epi32(t, s[1][i]);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_set1_ps(sx[i * ls + sg]), acc[i]);
      }
    }
    const int cols = j == np - 1 ? last : static_cast<int>(kPanel);
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
    const __m512 sv = _mm512_maskz_loadu_ps(mask, scale + j * kPanel);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + j * kPanel) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) _mm512_mask_storeu_ps(y + i * ldy + j * kPanel, mask, _mm512_fmadd_ps(acc[i], sv, bv));
  }
}

// y = x W^T for int8 codes in panels (kernels/linear.py pack_panels_i8 of an [N, K] matrix,
// corrections `corr` [N / 16, groups, 16]) and x already quantized (xq: M rows of stride
// groups * 64, sx: M x i8_scale_groups(K) scales, quantize_rows_u8): y[i * ldy + r] for r in [0, rows) of
// columns r0 .., r0 a multiple of 16. Column tiles of 3 panels, each streamed from memory by
// its first tile of x-rows; the others re-read it from cache. The amx variant multiplies
// kAmxMinRowsI8 rows or more by tiles, from x's signed codes (amx.h): xs, the rows' own (from
// linear.cpp tile_codes, made once for every call of an operator), or else made here once per
// thread for these codes (x_epoch: next_x_epoch's id of their quantization; 0: every call).
inline void panel_products_i8(const uint8_t* xq, const float* sx, int64_t M, int64_t K, const int8_t* panels,
                              const int32_t* corr, int64_t r0, int64_t rows, const float* scale, const float* bias,
                              float* y, int64_t ldy, bool cold, uint64_t x_epoch = 0, const int8_t* xs = nullptr) {
  const int64_t groups = i8_groups(K), ldx = groups * kI8Group, ls = i8_scale_groups(K);
  const int8_t* w = panels + r0 * ldx;               // panel r0 / 16
  const int32_t* cw = corr + r0 * groups;            // its corrections
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
  if (M >= kAmxMinRowsI8) {
    if (!xs) {
      thread_local std::vector<int8_t> own;
      thread_local MadeFrom made;
      if (!made.same(xq, M, x_epoch)) amx_signed_codes(xq, ldx, M, own);
      xs = own.data();
    }
    amx_products_i8(xs, sx, M, groups, w, rows, scale + r0, bias ? bias + r0 : nullptr, y, ldy);
    return;
  }
#else
  (void)x_epoch, (void)xs;
#endif
  if (M <= kPanelStreamRowsI8) {  // the panels one after the other (panel_rows_i8), every row at once
    const int64_t np = (rows + kPanel - 1) / kPanel;
    const int last = static_cast<int>(rows - (np - 1) * kPanel);
    const float* bs = bias ? bias + r0 : nullptr;
    for_row_tiles<kPanelStreamRowsI8>(M, [&](auto mb_tag, int64_t m) {
      panel_rows_i8<decltype(mb_tag)::value>(xq + m * ldx, ldx, sx + m * ls, groups, w, cw, np, last, scale + r0,
                                             bs, y + m * ldy, ldy);
    });
    return;
  }
  const int64_t tiles = (M + kPanelRowsXI8 - 1) / kPanelRowsXI8;
  for (int64_t c = 0; c < rows;) {
    const int64_t cols = std::min<int64_t>(kPanel * kPanelsPerTileI8, rows - c);
    const int np = static_cast<int>((cols + kPanel - 1) / kPanel);
    const int last = static_cast<int>(cols - (np - 1) * kPanel);
    const int8_t* wp = w + c * ldx;
    const int32_t* cp = cw + c * groups;
    const float* sc = scale + r0 + c;
    const float* bs = bias ? bias + r0 + c : nullptr;
    // As panel_products_bf16: `cold` and several row tiles, they fetch the next column tile.
    const int64_t next_cols = std::min<int64_t>(kPanel * kPanelsPerTileI8, rows - c - cols);
    const int64_t next_bytes = cold && tiles > 1 ? (next_cols + kPanel - 1) / kPanel * kPanel * ldx : 0;
    const bool fetched = cold && c > 0 && tiles > 1;
    auto tile = [&](auto mb_tag, int64_t m) {
      constexpr int MB = decltype(mb_tag)::value;
      const uint8_t* xt = xq + m * ldx;
      const float* st = sx + m * ls;
      float* yt = y + m * ldy + c;
      const PanelPrefetch stream = m == 0 && !fetched ? kPrefetchAhead : kPrefetchNone;
      const NextTile fetch(next_bytes ? wp + np * kPanel * ldx : nullptr, next_bytes, m / kPanelRowsXI8, tiles,
                           ldx / 4);
      if (np == 3) panel_tile_i8<MB, 3>(xt, ldx, st, groups, wp, cp, stream, fetch, sc, bs, last, yt, ldy);
      else if (np == 2) panel_tile_i8<MB, 2>(xt, ldx, st, groups, wp, cp, stream, fetch, sc, bs, last, yt, ldy);
      else panel_tile_i8<MB, 1>(xt, ldx, st, groups, wp, cp, stream, fetch, sc, bs, last, yt, ldy);
    };
    for_row_tiles<kPanelRowsXI8>(M, tile);
    c += cols;
  }
}

// The AVX2 variant's tile copy of x (interleave_x_i8) and the calls that make and read it, so
// that decoder_step.cpp shares one x per phase alike on every variant: here the tiles read xq
// and sx as they are, and there is nothing to copy (the amx variant's copy: amx.h).
#if !(defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__))
struct TiledX {};
inline void size_tiled_x(int64_t /*M*/, int64_t /*ldx*/, TiledX& /*out*/) {}
inline void interleave_x_i8(const uint8_t* /*xq*/, const float* /*sx*/, int64_t /*M*/, int64_t /*ldx*/,
                            TiledX& /*out*/, int64_t /*t0*/, int64_t /*t1*/) {}
inline void panel_products_i8_tiled(const uint8_t* xq, const float* sx, const TiledX& /*tx*/, int64_t M, int64_t K,
                                    const int8_t* panels, const int32_t* corr, int64_t r0, int64_t rows,
                                    const float* scale, const float* bias, float* y, int64_t ldy,
                                    const int8_t* /*after*/ = nullptr) {
  panel_products_i8(xq, sx, M, K, panels, corr, r0, rows, scale, bias, y, ldy, /*cold=*/true);
}
#endif

#else
// -- the AVX2 variant: the same panels by vpmaddubsw, x in 7 bits per 16 values --
// Without VNNI the integer dot product is vpmaddubsw (unsigned x signed bytes, 32 products into
// int16 pairs, saturating) then vpmaddwd by ones (the pairs into int32) and vpaddd: both
// multiplying instructions run on the same two pipes of a Zen 3, so 32 products cost a cycle
// there. 8-bit x does not fit: a pair of 255 x 127 saturates (the sign trick spends a third
// instruction per 32 products on those pipes; vpmovsxbw + vpmaddwd on int16, the kernel this
// replaces, two vpmaddwd and two vpaddd: 48-56 GMAC/s a core against ~80 for fbgemm's 7-bit
// vpmaddubsw GEMM). So here x is 7 bits, q in [-63, 63], and the panels hold the codes as
// u = w + 128 (the sign bit flipped at load, kernels/linear.py): a pair is at most
// 2 x 255 x 63 = 32130, never saturated, and dot(u, q) = dot(w, q) + 128 sum(q) is exact; the
// 128 sum(q) is per row of x, taken off once after the sums (interleave_x_i8's corr). The lost bit of x is
// bought back by smaller groups, one scale per 16 values: SmolLM2-135M on the perplexity text,
// x's rounding emulated in plain torch, against float32 (KLD / PPL ratio): 8 bits per 64 values
// 0.0102 / 1.0148 (the AVX-512 variant's numerics), 7 bits per 64 0.0272 / 1.020, per 32 0.0161 /
// 1.014, per 16 0.0111 / 1.012; this kernel in the engine 0.0110 / 1.0137 (float32 scales). One
// core of a Zen 3, with a float32 scale per group: a tile of 4 rows x 16 columns in registers 84
// GMAC/s; panel_products_i8 whole, weights in L2 / L3, 73-78 against the int16 tile's 63-68 at
// 8 to 512 rows (1.12-1.15x, 7 alternated pairs at each of 4 shapes).
//
// Each group's scale is then an integer multiple of a power of two shared by 16 groups (256
// values, kI8ScaleBlock): s_g = m_g 2^e, m_g in [0, 255], the largest group of the block at
// m in [128, 255] (x's 7 bits stay 7: m_g = ceil(max|x_g| / 63 / 2^e), a scale rounded up by at
// most 1/128 for the block's largest group). Why: a float scale per group cost the tile one
// convert and one FMA per row, 8 columns and 16 values (against 12 integer instructions), and the
// int32 sums' float accumulators no longer fitted AVX2's 16 registers (spilled, every group).
// With m_g the scale rides in vpmaddwd, which multiplied by ones before: vpmaddwd(pairs, m_g)
// sums a block's groups in int32 exactly (a lane gets at most 64 quads x 2 x 32130 x 255 =
// 1.05e9 < 2^31), then one convert and FMA by 2^e per block. Measured (2 threads, in-process A/B,
// 12 alternated rounds): products 32 x 3072 x 576 0.884x the time, 32 x 49152 x 576 0.902x,
// 512 x 3072 x 576 0.915x, 2 x 3072 x 576 0.924x, 1 row 1.00x; w8a8 decode at 32 streams 0.93x the
// step. Quality: PPL +1.22% of float32 against +1.37% with float scales (KLD 0.0111 / 0.0110;
// `inferlab perplexity`, the pydoc text, 8 chunks of 512).
constexpr int64_t kI8ScaleGroup = 16;   // x values per scale
constexpr int kI8QMax = 63;             // x's codes: q in [-63, 63], stored as q + 128
constexpr uint8_t kI8PanelXor = 0x80;   // the panels hold w + 128: the codes' sign bit flipped
constexpr bool kI8ColumnSums = false;   // no `corr`: x's sums take the 128 off
constexpr int64_t kI8ScaleBlock = 256;  // values sharing one power of two (scales m_g 2^e)
constexpr int kI8ScaleMul = 255;        // the largest m_g
constexpr int kPanelRowsXI8 = 4;        // rows of x per tile
constexpr int kPanelsPerTileI8 = 1;     // the unit column ranges are cut in (linear.cpp)
constexpr int64_t kI8BlockGroups = kI8ScaleBlock / kI8ScaleGroup;
// Many rows (linear.cpp products_i8): each thread whole blocks of rows over every panel, rather
// than every 64-row pass's panels shared out: a pass cost a fork and join, and each thread made
// its own tile copy of the same 64 rows (interleave_x_i8: 2.2% of a 2,048-token prefill step's
// samples). The panels (at most 1.8 MB a layer's linear here) are then read by both threads from
// L3. In-process A/B, the default model's w8a8 prefill, 8 alternated rounds: 8 prompts of 256
// tokens 0.916x the time (8 of 8), one of 512 0.969x (8 of 8), of 200 0.952x (8 of 8), of 130
// 1.005x (4 of 8; from 2 passes a thread on only). Not measured on the AVX-512 variant: it keeps
// the passes.
constexpr bool kI8SplitRows = true;
constexpr float kI8TinyScale = 0x1p-100f;  // a block whose largest max|x_g| / 63 is below this is zeros

// frexp's exponent of v > 0 (v = f 2^E, f in [0.5, 1)), from its bits where v is normal.
inline int float_exponent(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  const int biased = static_cast<int>((b >> 23) & 0xff);
  if (biased == 0) {
    int e;
    std::frexp(v, &e);
    return e;
  }
  return biased - 126;
}

// 2^e as a float (exact).
inline float pow2f(int e) {
  if (e < -126 || e > 127) return std::ldexp(1.0f, e);
  const uint32_t b = static_cast<uint32_t>(e + 127) << 23;
  float v;
  std::memcpy(&v, &b, sizeof(v));
  return v;
}

// One row of x as u8 codes u = q + 128, padded to whole groups of kI8Group with 128 (q = 0), and
// its scales, one per kI8ScaleGroup values (0 past K): per block of kI8ScaleBlock values, e with
// ceil(t_max / 2^e) in [128, 255] for the block's largest t = max|x_g| / 63, then m_g =
// ceil(t_g / 2^e), s_g = m_g 2^e (float32, exact), q = round(x / s_g) (to nearest even).
inline void quantize_row_u8(const float* x, int64_t K, uint8_t* dst, float* scales) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i off = _mm256_set1_epi32(128);
  const int64_t groups = i8_groups(K) * kI8Group / kI8ScaleGroup;
  for (int64_t b0 = 0; b0 < groups; b0 += kI8BlockGroups) {
    const int64_t nb = std::min(kI8BlockGroups, groups - b0);
    float t[kI8BlockGroups];
    float tmax = 0.f;
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t k0 = (b0 + j) * kI8ScaleGroup, n = std::max<int64_t>(0, std::min(kI8ScaleGroup, K - k0));
      const float* xg = x + k0;
      float amax = 0.f;
      if (n == kI8ScaleGroup) {
        amax = hmax(_mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xg)),
                                  _mm256_andnot_ps(sign, _mm256_loadu_ps(xg + 8))));
      } else {
        for (int64_t c = 0; c < n; ++c) amax = std::max(amax, std::fabs(xg[c]));
      }
      t[j] = amax / static_cast<float>(kI8QMax);
      tmax = std::max(tmax, t[j]);
    }
    if (!(tmax >= kI8TinyScale)) tmax = 0.f;  // (2^-e would overflow) a block of zeros: every m_g 0
    int e = tmax > 0.f ? float_exponent(tmax) - 8 : 0;  // tmax / 2^e in [128, 256)
    if (tmax > 0.f && std::ceil(tmax * pow2f(-e)) > kI8ScaleMul) ++e;
    const float down = pow2f(-e), up = pow2f(e);
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t g = b0 + j, k0 = g * kI8ScaleGroup, n = std::max<int64_t>(0, std::min(kI8ScaleGroup, K - k0));
      const float sg = tmax > 0.f ? std::ceil(t[j] * down) * up : 0.f;
      scales[g] = sg;
      const float inv = sg > 0.f ? 1.0f / sg : 0.f;
      const float* xg = x + k0;
      uint8_t* d = dst + k0;
      if (n == kI8ScaleGroup) {
        const __m256 iv = _mm256_set1_ps(inv);  // round to nearest even (MXCSR's default), + 128
        const __m256i lo = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg), iv)), off);
        const __m256i hi = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + 8), iv)), off);
        const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);  // 16 x u16, in order
        const __m128i b = _mm_packus_epi16(_mm256_castsi256_si128(w16), _mm256_extracti128_si256(w16, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d), b);
      } else {
        for (int64_t c = 0; c < n; ++c) d[c] = static_cast<uint8_t>(std::nearbyint(xg[c] * inv) + 128.f);
        for (int64_t c = n; c < kI8ScaleGroup; ++c) d[c] = 128;
      }
    }
  }
}

// x (M x K float32, contiguous) as u8 codes, M rows of stride i8_groups(K) * 64, and its scales
// (M x i8_scale_groups(K)): quantize_row_u8 per row.
inline void quantize_rows_u8(const float* x, int64_t M, int64_t K, uint8_t* dst, float* scales) {
  const int64_t ldx = i8_groups(K) * kI8Group, ls = ldx / kI8ScaleGroup;
  for (int64_t i = 0; i < M; ++i) quantize_row_u8(x + i * K, K, dst + i * ldx, scales + i * ls);
}

// x's codes as the tiles read them (interleave_x_i8), per thread.
struct TiledX {
  std::vector<int8_t> codes;  // q = u - 128; row tile t's quad j: its 4 rows' 4 codes each, at ((t * ldx / 4 + j) * 4 + r) * 4
  std::vector<int32_t> mul;   // m_g | m_g << 16 (vpmaddwd's pairs), at (t * groups + g) * 4 + r
  std::vector<float> pow2;    // 2^e, at (t * blocks + b) * 4 + r
  std::vector<float> corr;    // -128 sum_g s_g sum(q_g), per row (the panels' u = w + 128)
};

// x's u8 codes (M rows of stride ldx, a multiple of 64) and scales (quantize_row_u8's, M rows of
// ldx / 16) as the tiles read them (TiledX); rows past M in the last tile are zeros (q = 0,
// m = 0). m_g and e come back exactly from s_g: the block's largest s is m 2^e with m in
// [128, 255], so e = its frexp exponent - 8. Why a copy: a tile's broadcasts then come from one
// pointer; per tile and group: the 4 rows' 16 codes, a 4 x 4 transpose of their quads, a vpsadbw a row.
// Grows `out` to hold M rows of stride ldx (before threads fill its tiles: see the overload below).
inline void size_tiled_x(int64_t M, int64_t ldx, TiledX& out) {
  const int64_t groups = ldx / kI8ScaleGroup, blocks = (groups + kI8BlockGroups - 1) / kI8BlockGroups;
  const int64_t rows = (M + kPanelRowsXI8 - 1) / kPanelRowsXI8 * kPanelRowsXI8;
  out.codes.resize(std::max<size_t>(out.codes.size(), rows * ldx));
  out.mul.resize(std::max<size_t>(out.mul.size(), rows * groups));
  out.pow2.resize(std::max<size_t>(out.pow2.size(), rows * blocks));
  out.corr.resize(std::max<size_t>(out.corr.size(), rows));
}

// The row tiles [t0, t1) of M rows into `out`, already sized (size_tiled_x): a tile reads only
// its own 4 rows of xq and sx, so threads can share one TiledX out, a range of tiles each.
inline void interleave_x_i8(const uint8_t* xq, const float* sx, int64_t M, int64_t ldx, TiledX& out, int64_t t0,
                            int64_t t1) {
  static_assert(kPanelRowsXI8 == 4 && kI8ScaleGroup == 16, "a group is 4 quads of 4 rows: one 4 x 4 transpose");
  alignas(16) static const uint8_t kNoRow[kI8ScaleGroup] = {128, 128, 128, 128, 128, 128, 128, 128,
                                                            128, 128, 128, 128, 128, 128, 128, 128};
  const int64_t groups = ldx / kI8ScaleGroup, blocks = (groups + kI8BlockGroups - 1) / kI8BlockGroups;
  const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80)), zero = _mm_setzero_si128();
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* row[kPanelRowsXI8];
    const float* srow[kPanelRowsXI8];
    int64_t step[kPanelRowsXI8];
    float corr[kPanelRowsXI8] = {};
    for (int r = 0; r < kPanelRowsXI8; ++r) {
      const int64_t i = t * kPanelRowsXI8 + r;
      row[r] = i < M ? xq + i * ldx : kNoRow, step[r] = i < M ? kI8ScaleGroup : 0;
      srow[r] = i < M ? sx + i * groups : nullptr;
    }
    int8_t* d = out.codes.data() + t * kPanelRowsXI8 * ldx;
    int32_t* mul = out.mul.data() + t * groups * kPanelRowsXI8;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t g0 = b * kI8BlockGroups, g1 = std::min(groups, g0 + kI8BlockGroups);
      float down[kPanelRowsXI8];
      for (int r = 0; r < kPanelRowsXI8; ++r) {
        float mx = 0.f;
        if (srow[r])
          for (int64_t g = g0; g < g1; ++g) mx = std::max(mx, srow[r][g]);
        const int e = mx > 0.f ? float_exponent(mx) - 8 : 0;
        out.pow2[(t * blocks + b) * kPanelRowsXI8 + r] = mx > 0.f ? pow2f(e) : 0.f;
        down[r] = mx > 0.f ? pow2f(-e) : 0.f;
      }
      for (int64_t g = g0; g < g1; ++g, d += kPanelRowsXI8 * kI8ScaleGroup, mul += kPanelRowsXI8) {
        __m128i v[kPanelRowsXI8];
        for (int r = 0; r < kPanelRowsXI8; ++r) {
          v[r] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row[r] + g * step[r]));
          const __m128i sad = _mm_sad_epu8(v[r], zero);  // the two halves' sums of u
          const int32_t sum_q = _mm_cvtsi128_si32(sad) + _mm_extract_epi16(sad, 4) - 128 * static_cast<int32_t>(kI8ScaleGroup);
          const float sg = srow[r] ? srow[r][g] : 0.f;
          const int32_t m = static_cast<int32_t>(sg * down[r]);
          mul[r] = m | (m << 16);
          corr[r] -= 128.f * static_cast<float>(sum_q) * sg;
          v[r] = _mm_xor_si128(v[r], flip);  // q = u - 128 as int8
        }
        const __m128i a = _mm_unpacklo_epi32(v[0], v[1]), c = _mm_unpacklo_epi32(v[2], v[3]);  // quads 0, 1
        const __m128i e = _mm_unpackhi_epi32(v[0], v[1]), f = _mm_unpackhi_epi32(v[2], v[3]);  // quads 2, 3
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d), _mm_unpacklo_epi64(a, c));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 16), _mm_unpackhi_epi64(a, c));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 32), _mm_unpacklo_epi64(e, f));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 48), _mm_unpackhi_epi64(e, f));
      }
    }
    for (int r = 0; r < kPanelRowsXI8; ++r) out.corr[t * kPanelRowsXI8 + r] = corr[r];
  }
}

// All of x's row tiles, `out` grown to fit.
inline void interleave_x_i8(const uint8_t* xq, const float* sx, int64_t M, int64_t ldx, TiledX& out) {
  size_tiled_x(M, ldx, out);
  interleave_x_i8(xq, sx, M, ldx, out, 0, (M + kPanelRowsXI8 - 1) / kPanelRowsXI8);
}

// y[i * ldy + c] = (sum_g dot_g(q row i, column c) * s_g + corr_i) * scale[c] + bias[c] for c <
// cols (<= 8 NH) of the first NH halves of panel wp (8 columns each), MB rows of x (one row tile
// of TiledX: codes xt, multiples mul, powers of two p2, corrections corr; groups a row). Per
// block: int32 sums from zero, per group and quad vpmaddubsw + vpmaddwd by m_g + vpaddd, then one
// convert and FMA by 2^e into float32. One or two rows (the tile streams the panel from memory,
// at the memory's rate) prefetch a line a quad kPanelAheadI8 ahead; with more rows the caller
// prefetches the next panel into L2 while the row tiles go over this one (panel_products_i8).
// Measured with the int16 tile this replaced, the default model's w8a8 decode at one stream on a
// Zen 3, in one process, rounds alternated, against no prefetch: 512 bytes ahead 1.01x the step,
// 768 1.04, 1 KiB 0.87-0.92 (11 of 12, 9 of 10, 7 of 8 rounds faster), 1.5 KiB 0.88, 2 KiB 0.89,
// 4 KiB 0.90, 16 KiB 0.98: about a memory latency's worth of the stream (~100 ns at 10-15 GB/s a core).
constexpr int64_t kPanelAheadI8 = 1024;

// One quad (4 values) of a group for the 4-row tile (panel_tile_i8's asm): the panel's two halves
// (w0, w1: 8 columns x 4 values each, at w + Q * 64), then per row I its 4 codes broadcast (at
// x + Q * 16 + I * 4), vpmaddubsw by each half, vpmaddwd by the row's m_g (register mI), into
// the row's two sums. AT&T order: sources first, the destination last.
#define INFERLAB_I8_ROW(Q, I, A0, A1)                \
  "vpbroadcastd " #Q "*16+" #I "*4(%[x]), %[b]\n\t"   \
  "vpmaddubsw %[b], %[w0], %[t]\n\t"                  \
  "vpmaddwd %[m" #I "], %[t], %[t]\n\t"               \
  "vpaddd %[t], %[" #A0 "], %[" #A0 "]\n\t"           \
  "vpmaddubsw %[b], %[w1], %[t]\n\t"                  \
  "vpmaddwd %[m" #I "], %[t], %[t]\n\t"               \
  "vpaddd %[t], %[" #A1 "], %[" #A1 "]\n\t"
#define INFERLAB_I8_QUAD(Q)                           \
  "vmovdqu " #Q "*64(%[w]), %[w0]\n\t"                \
  "vmovdqu " #Q "*64+32(%[w]), %[w1]\n\t"             \
  INFERLAB_I8_ROW(Q, 0, s00, s01) INFERLAB_I8_ROW(Q, 1, s10, s11) \
  INFERLAB_I8_ROW(Q, 2, s20, s21) INFERLAB_I8_ROW(Q, 3, s30, s31)
template <int MB, int NH>
inline void panel_tile_i8(const int8_t* xt, const int32_t* mul, const float* p2, const float* corr, int64_t groups,
                          const int8_t* wp, const float* scale, const float* bias, int cols, float* y, int64_t ldy) {
  constexpr int64_t kQuads = kI8ScaleGroup / 4;         // quads per group
  constexpr int64_t kGroupBytes = kQuads * 4 * kPanel;  // a group of a panel: 4 quads of 64 bytes
  // From 3 rows on the float sums live in memory, touched once a block (the barriers below keep
  // gcc from holding them in registers): the group loop wants all 16 of AVX2's.
  alignas(32) float acc[MB][NH][8];
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 2
    for (int h = 0; h < NH; ++h) _mm256_store_ps(acc[i][h], _mm256_setzero_ps());
  const uint8_t* w = reinterpret_cast<const uint8_t*>(wp);
  for (int64_t g0 = 0; g0 < groups; g0 += kI8BlockGroups, p2 += kPanelRowsXI8) {
    const int64_t g1 = std::min(groups, g0 + kI8BlockGroups);
    __m256i s[MB][NH];
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i)
#pragma GCC unroll 2
      for (int h = 0; h < NH; ++h) s[i][h] = _mm256_setzero_si256();
    if constexpr (MB == 4 && NH == 2) {
      // The whole tile (every decode step from 4 rows on): a group per asm block, its 8 sums and
      // the 4 rows' m_g in registers (16 with the 2 weight halves, the broadcast and a product).
      // As intrinsics gcc kept the sums (an array, pinned as below) on the stack, a load and a
      // store around every vpaddd (`objdump`). One thread, 10-1,500 calls a run, 8 alternated runs,
      // best against best: 32 x 576 x 576 (in L2) 1.054x the rate, 32 x 3072 x 576 (L3) 1.055x,
      // 32 x 576 x 1536 1.048x, 32 x 49152 x 576 (from memory: the lm_head) 1.196x, 512 x 3072 x
      // 576 1.050x, 7 rows 1.077x. (The multipliers as vpmaddwd's memory operand instead, freeing
      // 4 registers: gcc still spilled the sums, 0.86x in L2.)
      __m256i s00 = s[0][0], s01 = s00, s10 = s00, s11 = s00, s20 = s00, s21 = s00, s30 = s00, s31 = s00;
      for (int64_t g = g0; g < g1; ++g, w += kGroupBytes, xt += kI8ScaleGroup * kPanelRowsXI8, mul += kPanelRowsXI8) {
        const __m256i m0 = _mm256_set1_epi32(mul[0]), m1 = _mm256_set1_epi32(mul[1]);
        const __m256i m2 = _mm256_set1_epi32(mul[2]), m3 = _mm256_set1_epi32(mul[3]);
        __m256i w0, w1, b, t;
        __asm__(INFERLAB_I8_QUAD(0) INFERLAB_I8_QUAD(1) INFERLAB_I8_QUAD(2) INFERLAB_I8_QUAD(3)
                : [s00] "+x"(s00), [s01] "+x"(s01), [s10] "+x"(s10), [s11] "+x"(s11), [s20] "+x"(s20),
                  [s21] "+x"(s21), [s30] "+x"(s30), [s31] "+x"(s31), [w0] "=&x"(w0), [w1] "=&x"(w1),
                  [b] "=&x"(b), [t] "=&x"(t)
                : [w] "r"(w), [x] "r"(xt), [m0] "x"(m0), [m1] "x"(m1), [m2] "x"(m2), [m3] "x"(m3)
                : "memory");
      }
      s[0][0] = s00, s[0][1] = s01, s[1][0] = s10, s[1][1] = s11;
      s[2][0] = s20, s[2][1] = s21, s[3][0] = s30, s[3][1] = s31;
    } else
    for (int64_t g = g0; g < g1; ++g, w += kGroupBytes, xt += kI8ScaleGroup * kPanelRowsXI8, mul += kPanelRowsXI8) {
      __m256i mv[MB];  // row i's m_g in every int16 lane
#pragma GCC unroll 4
      for (int i = 0; i < MB; ++i) mv[i] = _mm256_set1_epi32(mul[i]);
#pragma GCC unroll 4
      for (int q = 0; q < kQuads; ++q) {
        if constexpr (MB <= 2) _mm_prefetch(reinterpret_cast<const char*>(w) + q * 64 + kPanelAheadI8, _MM_HINT_T0);
        __m256i wv[NH];  // 8 columns x the quad each, u = w + 128
#pragma GCC unroll 2
        for (int h = 0; h < NH; ++h) wv[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + q * 64 + 32 * h));
#pragma GCC unroll 4
        for (int i = 0; i < MB; ++i) {
          int32_t quad;  // row i's 4 codes of this quad
          std::memcpy(&quad, xt + (q * kPanelRowsXI8 + i) * 4, sizeof(quad));
          const __m256i b = _mm256_set1_epi32(quad);
#pragma GCC unroll 2
          for (int h = 0; h < NH; ++h) {
            s[i][h] = _mm256_add_epi32(s[i][h], _mm256_madd_epi16(_mm256_maddubs_epi16(wv[h], b), mv[i]));
            // Integer adds reassociate: unpinned, gcc may sum a group's products as a tree at its
            // end, a ymm of products per quad spilled to the stack (measured 1.4x slower). At one
            // or two rows pinned sums went through the stack from group to group (1.15x slower).
            if constexpr (MB > 2) __asm__("" : "+x"(s[i][h]));
          }
        }
      }
    }
    if constexpr (MB > 2) __asm__ volatile("" ::: "memory");
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i) {
      const __m256 pv = _mm256_set1_ps(p2[i]);
#pragma GCC unroll 2
      for (int h = 0; h < NH; ++h)
        _mm256_store_ps(acc[i][h], _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i][h]), pv, _mm256_load_ps(acc[i][h])));
    }
    if constexpr (MB > 2) __asm__ volatile("" ::: "memory");
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
#pragma GCC unroll 2
  for (int h = 0; h < NH; ++h) {
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8 * h), lane);
    const __m256 sv = _mm256_maskload_ps(scale + 8 * h, mask);
    const __m256 bv = bias ? _mm256_maskload_ps(bias + 8 * h, mask) : _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i) {
      const __m256 a = _mm256_add_ps(_mm256_load_ps(acc[i][h]), _mm256_set1_ps(corr[i]));
      _mm256_maskstore_ps(y + i * ldy + 8 * h, mask, _mm256_fmadd_ps(a, sv, bv));
    }
  }
}

// panel_products_i8 (below) from x's tiles made already (interleave_x_i8), which every thread of
// a phase may share (decoder_step.cpp); xq, sx and corr: the AVX-512 variant's. Each panel whole
// (the next one prefetched meanwhile), every row tile over it before the next, so a panel is read
// from memory once (by the first row tile) and from L1 (9-24 KiB at SmolLM2's K) by the others.
// after (or null): the panel this thread likely multiplies next (decoder_step.cpp's next task), whose
// lines the last panel's row tiles fetch as they fetch a next panel of this call.
inline void panel_products_i8_tiled(const uint8_t* /*xq*/, const float* /*sx*/, const TiledX& tx, int64_t M,
                                    int64_t K, const int8_t* panels, const int32_t* /*corr*/, int64_t r0,
                                    int64_t rows, const float* scale, const float* bias, float* y, int64_t ldy,
                                    const int8_t* after = nullptr) {
  const int64_t ldx = i8_groups(K) * kI8Group, ls = ldx / kI8ScaleGroup;
  const int64_t blocks = (ls + kI8BlockGroups - 1) / kI8BlockGroups;
  const int64_t tiles = (M + kPanelRowsXI8 - 1) / kPanelRowsXI8;
  const int64_t np = (rows + kPanel - 1) / kPanel;
  for (int64_t j = 0; j < np; ++j) {
    const int64_t c0 = j * kPanel, col = r0 + c0;  // this panel's first column
    const int8_t* wp = panels + col * ldx;         // panel col / 16
    const int cols = static_cast<int>(std::min<int64_t>(kPanel, rows - c0));
    const float* bs = bias ? bias + col : nullptr;
    if (M <= 2) {
      if (M == 1)
        panel_tile_i8<1, 2>(tx.codes.data(), tx.mul.data(), tx.pow2.data(), tx.corr.data(), ls, wp, scale + col, bs,
                            cols, y + c0, ldy);
      else
        panel_tile_i8<2, 2>(tx.codes.data(), tx.mul.data(), tx.pow2.data(), tx.corr.data(), ls, wp, scale + col, bs,
                            cols, y + c0, ldy);
      continue;
    }
    // The next panel's lines into L2, a share before each row tile: its first row tile then
    // waits on L2, not memory. Measured with the default model's w8a8 (in-process A/B rounds
    // alternated): decode at 32 streams 0.977x, 0.946x the step (6 of 8, 7 of 8 rounds faster),
    // 8 prompts of 256 tokens 0.983x (4 of 6); two panels ahead 0.986x; into L1 0.980x.
    const int64_t next_lines = j + 1 < np || after ? kPanel * ldx / 64 : 0;
    const int64_t lines_per_tile = (next_lines + tiles - 1) / tiles;
    const char* next_panel = reinterpret_cast<const char*>(j + 1 < np ? wp + kPanel * ldx : after);
    for_row_tiles<kPanelRowsXI8>(M, [&](auto mb_tag, int64_t m) {
      constexpr int MB = decltype(mb_tag)::value;
      const int64_t l0 = m / kPanelRowsXI8 * lines_per_tile, l1 = std::min(next_lines, l0 + lines_per_tile);
      for (int64_t l = l0; l < l1; ++l) _mm_prefetch(next_panel + l * 64, _MM_HINT_T1);
      panel_tile_i8<MB, 2>(tx.codes.data() + m * ldx, tx.mul.data() + m * ls, tx.pow2.data() + m * blocks,
                           tx.corr.data() + m, ls, wp, scale + col, bs, cols, y + m * ldy + c0, ldy);
    });
  }
}

// panel_products_i8 with the AVX-512 variant's arguments (`corr`, `cold` and `xs` unused, sx [M,
// i8_scale_groups(K)]). x is made into a TiledX (interleave_x_i8) once per call, or, given
// x_epoch (next_x_epoch: one id per quantization of the codes), once per thread: the next calls
// with the same codes, epoch and rows reuse the copy.
inline void panel_products_i8(const uint8_t* xq, const float* sx, int64_t M, int64_t K, const int8_t* panels,
                              const int32_t* corr, int64_t r0, int64_t rows, const float* scale,
                              const float* bias, float* y, int64_t ldy, bool /*cold*/, uint64_t x_epoch = 0,
                              const int8_t* /*xs: the amx variant's*/ = nullptr) {
  thread_local TiledX tx;  // per thread, grown once
  thread_local MadeFrom made;  // the codes tx holds
  if (!made.same(xq, M, x_epoch)) interleave_x_i8(xq, sx, M, i8_groups(K) * kI8Group, tx);
  panel_products_i8_tiled(xq, sx, tx, M, K, panels, corr, r0, rows, scale, bias, y, ldy);
}
#endif  // __AVX512VNNI__

// Scales per row of x's codes: one per kI8ScaleGroup values of its whole kI8Group groups (the
// last of them covering what is left: a K of 640 has 10 groups of 64, so 4 scales at 192).
inline int64_t i8_scale_groups(int64_t K) { return (i8_groups(K) * kI8Group + kI8ScaleGroup - 1) / kI8ScaleGroup; }

}  // namespace inferlab_matvec

#include "amx.h"
