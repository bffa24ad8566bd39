// AMX tile products (the amx variant: AMX-TILE, AMX-BF16 and AMX-INT8 beside the avx512 variant's
// flags) on the panels the avx512 kernels multiply: bf16 weights by tdpbf16ps, w8a8's codes by
// tdpbssd. Included at the end of matvec.h, whose panel_products_bf16 hands every product to
// these (K a whole number of 32-value tiles) and panel_products_i8 those of 2 rows or more
// (kAmxMinRowsI8; matvec.h, where the measurements are).
//
// Why: one tdpbf16ps is 16 x 16 x 32 products, one tdpbssd 16 x 16 x 64, each in the time of a
// few dozen vdpbf16ps / vpdpbusd (32 and 64 products each), so a prefill or a many-stream decode
// step, bound by its arithmetic on the avx512 kernels, becomes bound by its weight reads again;
// and at one row of x, where one vdpbf16ps chain per panel waits on its own latency, a tile
// takes 16 columns x 32 k at once. The panel layouts are already AMX's: a panel's 32
// consecutive k of bf16 (16 pairs x 16 columns x 2) and 64 k of int8 codes (16 quads x 16
// columns x 4) are each one 1 KiB tile of 16 rows of 64 bytes (the B operand), and up to 16 rows
// of x's bf16 values (read in place with x's row stride) or signed codes (a copy, below) at one
// k offset are the A operand.
//
// Numerics. w8a8: each group's sum of 64 integer products is exact on either unit (the avx512
// tiles sum u x w from the group's corrections, the AMX tiles q x w from zero: the same integer),
// then converted and scaled by the same float32 instructions in the same order, so a row's
// outputs are the same bits as the avx512 variant's at every row count
// (tests/test_kernels_amx.py). bf16: tdpbf16ps sums pairs of exact
// bf16 products into float32 as vdpbf16ps does, but not with the same rounding steps (measured:
// neither pair order, nor one rounding per pair, reproduces its bits), so its sums differ from
// the avx512 variant's in the last bits; every row count runs on the tiles, so a row's outputs
// are still the same bits at every row count (batching changes no token).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace inferlab_matvec {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
#define INFERLAB_AMX 1

// Rows of 64 bytes: C tiles 0-3 (float32 or int32 sums of up to 16 x-rows by one panel's 16
// columns), A tiles 4-5 (up to 16 rows of x), B tiles 6-7 (one panel's k block, 16 rows).
// kAmxConfigs.c[r]: C and A tiles of r rows (r = M below 16 rows of x, else 16).
struct alignas(64) AmxConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
struct AmxConfigs {
  AmxConfig c[17];
  constexpr AmxConfigs() : c{} {
    for (int r = 1; r <= 16; ++r) {
      c[r].palette = 1;
      for (int t = 0; t < 8; ++t) c[r].colsb[t] = 64, c[r].rows[t] = static_cast<uint8_t>(t < 6 ? r : 16);
    }
  }
};
inline constexpr AmxConfigs kAmxConfigs{};

// GCC's _tile_loadd is an asm statement that names no memory: without this, the compiler may
// leave stores to what a tile then reads (x's rows made just before, the tail copy) after the
// load. Every product calls it once its operands are written, before its first tile load.
inline void amx_operands_written() { __asm__ volatile("" ::: "memory"); }

// Loaded at each product, and the configuration the thread had before loaded back after (or the
// tiles released where it had none): torch's oneDNN micro-kernel keeps its own loaded between
// calls on the same pool threads and loads it again only when it thinks another kernel ran, so
// a product of ours must not leave its shapes behind (prefill_attention.cpp also resets torch's
// belief before each use: without that, its sums came out wrong now and then in a process that
// had run our products). ~100 cycles each against a product's thousands.
struct AmxScope {
  AmxConfig before;
  explicit AmxScope(int64_t M) {
    _tile_storeconfig(&before);
    _tile_loadconfig(&kAmxConfigs.c[std::min<int64_t>(M, 16)]);
  }
  ~AmxScope() {
    if (before.palette) _tile_loadconfig(&before);
    else _tile_release();
  }
  AmxScope(const AmxScope&) = delete;
  AmxScope& operator=(const AmxScope&) = delete;
};

// x's rows in tiles of 16 (M rows below 16): the rows as given up to the last whole tile, then
// from 16 rows on the last M % 16 rows copied into a buffer of 16 rows (the rest zero), so no
// tile reads past x.
template <typename T>
struct AmxRows {
  const T* x;
  int64_t ldx, full;
  const T* tail;
  AmxRows(const T* x_, int64_t ldx_, int64_t M, std::vector<T>& buf)
      : x(x_), ldx(ldx_), full(M < 16 ? M : M / 16 * 16) {
    tail = x + full * ldx;
    if (full < M) {
      buf.assign(16 * ldx, T(0));
      std::memcpy(buf.data(), x + full * ldx, (M - full) * ldx * sizeof(T));
      tail = buf.data();
    }
  }
  const T* tile(int64_t m) const { return m < full ? x + m * ldx : tail; }  // m: a multiple of 16
};

// The sums of one block out: 16 x 16 floats per tile (c), valid rows and `cols` columns,
// * scale + bias (either null: 1 and 0), as the avx512 tiles store theirs.
template <typename Y>
inline void amx_store(const float (*c)[16], int valid, int cols, const float* scale, const float* bias, Y* y,
                      int64_t ldy) {
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  const __m512 sv = scale ? _mm512_maskz_loadu_ps(mask, scale) : _mm512_set1_ps(1.0f);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int i = 0; i < valid; ++i) store16(y + i * ldy, mask, _mm512_fmadd_ps(_mm512_load_ps(c[i]), sv, bv));
}

// ---- bf16 panels by tdpbf16ps --------------------------------------------------------------
// How far ahead of its tile loads each panel's stream is fetched into L2 when the panels come
// from memory with two row tiles of x (`stream`). Why: a tile load waits for all of its 16 lines
// before the tdpbf16ps after it can start, and with two row tiles the products between loads
// leave the hardware prefetcher too little ahead: at 32 rows the weights streamed at ~15 GB/s
// against ~20 at one row (each tile load of the lm_head, and of the decode step's products,
// stalled on memory in `perf annotate`). Measured on 2 cores of the Xeon with AMX, the default
// model's decode step at 32 streams: in-process rounds alternated (12, a slow spell of the host)
// 39.80 -> 37.57 ms, the product phases 15.28 -> 14.31; processes alternated (4 pairs, each
// faster) 25.2 -> 24.6 ms; a 64-token prefill 27.7 -> 26.2. 2 KiB ahead, or into L1, no better.
// At one row the stream keeps up without it.
constexpr int64_t kAmxStreamAhead = 8192;

// The sums of MT (1 or 2) row tiles of x (a0, a1: 16 rows each, stride ldx, bf16) by NT (1 or 2)
// panels (w0, w1: 16 * kp values each), over every k, into c[t * 2 + j] (16 x 16 floats each).
template <int MT, int NT>
inline void amx_tiles_bf16(const uint16_t* a0, const uint16_t* a1, int64_t ldx, const uint16_t* w0,
                           const uint16_t* w1, int64_t kp, float (*c)[16][16], bool stream = false) {
  const int64_t stride = ldx * 2;
  _tile_zero(0);
  if constexpr (NT > 1) _tile_zero(1);
  if constexpr (MT > 1) _tile_zero(2);
  if constexpr (MT > 1 && NT > 1) _tile_zero(3);
  for (int64_t k = 0; k < kp; k += 32) {
    if (MT > 1 && stream) {  // this k-step's 1 KiB of each panel, kAmxStreamAhead on
      const char* p0 = reinterpret_cast<const char*>(w0 + k * kPanel) + kAmxStreamAhead;
      const char* p1 = reinterpret_cast<const char*>(w1 + k * kPanel) + kAmxStreamAhead;
      for (int l = 0; l < 1024; l += 64) {
        _mm_prefetch(p0 + l, _MM_HINT_T1);
        if constexpr (NT > 1) _mm_prefetch(p1 + l, _MM_HINT_T1);
      }
    }
    _tile_loadd(6, w0 + k * kPanel, 64);
    _tile_loadd(4, a0 + k, stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT > 1) {
      _tile_loadd(7, w1 + k * kPanel, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (MT > 1) {
      _tile_loadd(5, a1 + k, stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NT > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c[0], 64);
  if constexpr (NT > 1) _tile_stored(1, c[1], 64);
  if constexpr (MT > 1) _tile_stored(2, c[2], 64);
  if constexpr (MT > 1 && NT > 1) _tile_stored(3, c[3], 64);
}

// MT row tiles by NT panels from w on (adjacent), stored: y rows valid0 / valid1 of each row
// tile, the last panel `last` <= 16 columns.
template <int MT, int NT, typename Y>
inline void amx_block_bf16(const uint16_t* a0, const uint16_t* a1, int64_t ldx, const uint16_t* w, int64_t kp,
                           int valid0, int valid1, int last, const float* scale, const float* bias, Y* y,
                           int64_t ldy, bool stream) {
  alignas(64) float c[4][16][16];
  amx_tiles_bf16<MT, NT>(a0, a1, ldx, w, NT > 1 ? w + kPanel * kp : w, kp, c, stream);
  for (int t = 0; t < MT; ++t)
    for (int j = 0; j < NT; ++j)
      amx_store(c[t * 2 + j], t ? valid1 : valid0, j == NT - 1 ? last : 16, scale ? scale + j * kPanel : nullptr,
                bias ? bias + j * kPanel : nullptr, y + t * 16 * ldy + j * kPanel, ldy);
}

// panel_products_bf16's contract (x in bf16, M rows of stride ldx, K rounded up to a multiple
// of 32 by the caller's check: kp % 32 == 0; w at panel r0 / 16; `rows` columns; scale and
// bias from column r0 on) by tiles: pairs of panels, each multiplied by every pair of row tiles
// while it is in cache. cold: the panels come from memory (kAmxStreamAhead: the first pair of
// row tiles fetches them ahead).
template <typename Y>
inline void amx_products_bf16(const uint16_t* xb, int64_t ldx, int64_t M, int64_t kp, const uint16_t* w,
                              int64_t rows, const float* scale, const float* bias, Y* y, int64_t ldy, bool cold) {
  thread_local std::vector<uint16_t> tail_buf;
  const AmxRows<uint16_t> xr(xb, ldx, M, tail_buf);
  const AmxScope tiles(M);
  amx_operands_written();
  const int64_t np = (rows + kPanel - 1) / kPanel;
  const int last = static_cast<int>(rows - (np - 1) * kPanel);
  for (int64_t j = 0; j < np; j += 2) {
    const bool two = j + 1 < np;
    const int lj = j + (two ? 2 : 1) == np ? last : 16;
    const uint16_t* wj = w + j * kPanel * kp;
    const float* sc = scale ? scale + j * kPanel : nullptr;
    const float* bs = bias ? bias + j * kPanel : nullptr;
    for (int64_t m = 0; m < M; m += 32) {
      const int v0 = static_cast<int>(std::min<int64_t>(16, M - m)), v1 = static_cast<int>(std::min<int64_t>(16, M - m - 16));
      const uint16_t* a0 = xr.tile(m);
      Y* yt = y + m * ldy + j * kPanel;
      const bool stream = cold && m == 0;
      if (v1 > 0) {
        const uint16_t* a1 = xr.tile(m + 16);
        if (two) amx_block_bf16<2, 2>(a0, a1, ldx, wj, kp, v0, v1, lj, sc, bs, yt, ldy, stream);
        else amx_block_bf16<2, 1>(a0, a1, ldx, wj, kp, v0, v1, lj, sc, bs, yt, ldy, stream);
      } else {
        if (two) amx_block_bf16<1, 2>(a0, a0, ldx, wj, kp, v0, 0, lj, sc, bs, yt, ldy, stream);
        else amx_block_bf16<1, 1>(a0, a0, ldx, wj, kp, v0, 0, lj, sc, bs, yt, ldy, stream);
      }
    }
  }
}

// ---- w8a8 panels by tdpbssd ----------------------------------------------------------------
// x's codes as the tiles take them: q = u - 128, the signed value each stored code u stands for
// (quantize_row_u8 stores q + 128, vpdpbusd's unsigned operand), so that a group's sums start
// from zero instead of from the panel's corrections (-128 x each column's code sum): flipping the
// sign bit of u gives q's byte. Why: loading the corrections into the C tile before each
// tdpbusd cost as much as the product itself; tdpbssd on q starts from tilezero (no memory), and
// its integer sum is the same number, so the same bits come out. Measured (2 cores of the Xeon,
// one row tile by one panel by every group, as amx_tile_i8 runs, GOP/s, best of 7): K 576 x N
// 3,072 at 512 rows 945 -> 1,286, K 1,536 x N 576 1,036 -> 1,564, 32 rows of K 576 x N 3,072
// 1,194 -> 1,855. The copy is made once for all of an operator's calls (linear.cpp tile_codes)
// or, in the decode step, once per thread and quantization (panel_products_i8).

// Rows [r0, r1) of x's codes (stride ldx) into q's bytes at dst (same stride).
inline void flip_code_rows(const uint8_t* xq, int64_t ldx, int64_t r0, int64_t r1, int8_t* dst) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t n = (r1 - r0) * ldx;  // ldx: a multiple of 64
  xq += r0 * ldx, dst += r0 * ldx;
  for (int64_t i = 0; i < n; i += 64)
    _mm512_storeu_si512(dst + i, _mm512_xor_si512(_mm512_loadu_si512(xq + i), flip));
}

// The M rows' q bytes in buf, zero rows after them up to a whole 16-row tile (so no tile reads
// past them); returns buf's data.
inline const int8_t* amx_signed_codes(const uint8_t* xq, int64_t ldx, int64_t M, std::vector<int8_t>& buf) {
  const int64_t rows = (M + 15) / 16 * 16;
  if (static_cast<int64_t>(buf.size()) < rows * ldx) buf.resize(rows * ldx);
  flip_code_rows(xq, ldx, 0, M, buf.data());
  std::memset(buf.data() + M * ldx, 0, (rows - M) * ldx);
  return buf.data();
}

// One row tile (16 rows of signed codes a, stride ldx; their scales s, stride ls) by one panel
// (w), every group: the sums of a scale's groups (kI8GroupsPerScale tdpbssd, A and B tiles 4 / 6
// and 5 / 7 by turns) go to C tile 0 or 1 by turns, so that the tiles multiply the next scale's
// groups while the vector units take this one's out (converted, times the rows' scales, into 16
// float32 sums held in registers: panel_tile_i8's instructions, in its order). A scale per 3
// groups instead of per group (matvec.h quantize_row_u8), the default model's w8a8 engine,
// processes alternated with the previous commit (3 pairs): a 512-token prefill 107.0 / 96.0 /
// 102.8 -> 87.9 / 87.5 / 87.5 ms, the 32-stream decode step 19.9 / 20.1 / 20.9 -> 18.9 / 19.4 /
// 20.3. Two C tiles by turns, why: with the
// sums taken out of four C tiles through memory after each group, the tiles waited on the vector
// units and int8 ran no faster than bf16 on tdpbf16ps (2 cores of a Xeon, SmolLM2's layer
// shapes, GOP/s: 32 rows 1,045-1,120 -> 1,149-1,285, 512 rows 1,183-1,307 -> 1,497-1,597,
// alternated runs).
inline void amx_tile_i8(const int8_t* a, int64_t ldx, const float* s, int64_t ls, int64_t groups, const int8_t* w,
                        int valid, int cols, const float* scale, const float* bias, float* y, int64_t ldy,
                        const int8_t* ahead = nullptr) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  alignas(64) int32_t c[16][16];
// (GCC's tile intrinsics take literal tile numbers: one statement per A / B / C choice.)
#define INFERLAB_I8_GROUP(C, A, B)                                                       \
  do {                                                                                    \
    _tile_loadd(A, a + g * kI8Group, ldx);                                                \
    _tile_loadd(B, w + g * kI8Group * kPanel, 64);                                        \
    _tile_dpbssd(C, A, B);                                                                \
  } while (0)
  const int64_t scales = (groups + kI8GroupsPerScale - 1) / kI8GroupsPerScale;
  auto issue = [&](int64_t sg) {  // scale sg's groups' sums into C tile sg % 2
    const int64_t g0 = sg * kI8GroupsPerScale, g1 = i8_scale_end(g0, groups);
    if (sg % 2 == 0) _tile_zero(0);
    else _tile_zero(1);
    for (int64_t g = g0; g < g1; ++g) {
      if (sg % 2 == 0) {
        if (g % 2 == 0) INFERLAB_I8_GROUP(0, 4, 6);
        else INFERLAB_I8_GROUP(0, 5, 7);
      } else {
        if (g % 2 == 0) INFERLAB_I8_GROUP(1, 4, 6);
        else INFERLAB_I8_GROUP(1, 5, 7);
      }
    }
  };
#undef INFERLAB_I8_GROUP
  issue(0);
  for (int64_t sg = 0; sg < scales; ++sg) {
    if (sg + 1 < scales) issue(sg + 1);
    if (ahead) {  // the next panel's groups of this scale, 1 KiB each (amx_products_i8)
      const char* p = reinterpret_cast<const char*>(ahead + sg * kI8ScaleGroup * kPanel);
      const int64_t bytes = (i8_scale_end(sg * kI8GroupsPerScale, groups) - sg * kI8GroupsPerScale) * 1024;
      for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch(p + l, _MM_HINT_T1);
    }
    if (sg % 2 == 0) _tile_stored(0, c, 64);
    else _tile_stored(1, c, 64);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i)
      if (i < valid)
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[i])), _mm512_set1_ps(s[i * ls + sg]), acc[i]);
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  const __m512 sv = _mm512_maskz_loadu_ps(mask, scale);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i)
    if (i < valid) _mm512_mask_storeu_ps(y + i * ldy, mask, _mm512_fmadd_ps(acc[i], sv, bv));
}

// panel_products_i8's contract (xs: M rows of x's signed codes, stride groups * 64, readable
// to a whole 16-row tile (amx_signed_codes); sx: their scales, M x i8_scale_groups; w at panel r0 / 16;
// `rows` columns; scale and bias from r0 on). The panels' corrections are not needed.
// The first row tile of each panel fetches the next panel into L2 as it goes (amx_tile_i8's
// `ahead`, one group's 1 KiB per group): a tile load stalls until its 16 lines are in, so
// with the panels from memory the tiles and the vector units' per-group work waited on the
// stream in turn. Measured on 2 cores of the Xeon with AMX, the default model's w8a8 decode
// step, in-process rounds alternated: 32 streams 23.30 -> 21.90 ms (6 rounds; the product
// phases 8.34 -> 7.48), again 22.17 -> 20.71 (6); 8 streams 9.40 -> 8.41 (6). Two panels ahead
// or four: no better; into L1 (T0) slightly worse, T2 as T1; a 512-token prefill unchanged
// (118.9 / 117.8 ms, 8 rounds: its panels stay in cache for 32 row tiles).
inline void amx_products_i8(const int8_t* xs, const float* sx, int64_t M, int64_t groups, const int8_t* w,
                            int64_t rows, const float* scale, const float* bias, float* y, int64_t ldy) {
  thread_local std::vector<float> tail_sx;
  const int64_t ldx = groups * kI8Group, ls = i8_scale_groups(ldx);
  const AmxRows<float> sr(sx, ls, M, tail_sx);
  const AmxScope tiles(M);
  amx_operands_written();
  const int64_t np = (rows + kPanel - 1) / kPanel;
  const int last = static_cast<int>(rows - (np - 1) * kPanel);
  for (int64_t j = 0; j < np; ++j)  // a panel (9-24 KiB at SmolLM2's K) stays in L1 for every row tile
    for (int64_t m = 0; m < M; m += 16)
      amx_tile_i8(xs + m * ldx, ldx, sr.tile(m), ls, groups, w + j * kPanel * ldx,
                  static_cast<int>(std::min<int64_t>(16, M - m)), j == np - 1 ? last : 16, scale + j * kPanel,
                  bias ? bias + j * kPanel : nullptr, y + m * ldy + j * kPanel, ldy,
                  m == 0 && j + 1 < np ? w + (j + 1) * kPanel * ldx : nullptr);
}

// The decode step's x of a product phase (decoder_step.cpp SharedX) as the tiles take it: the
// rows' signed codes, made once a phase by the threads a share each (interleave_x_i8, as the
// AVX2 variant's tile copy), rather than by each thread at each of its products
// (panel_products_i8's own copy, 10 calls a layer). The default model's w8a8 decode at 32
// streams, 2 cores of the Xeon with AMX, in-process rounds alternated (6): the step 22.24 ->
// 21.70 ms, the product phases 0.89-0.95x.
struct TiledX {
  std::vector<int8_t> codes;  // M rows of the phase's stride, zero rows after them to a whole 16-row tile
};
inline void size_tiled_x(int64_t M, int64_t ldx, TiledX& out) {
  const size_t n = (M + 15) / 16 * 16 * ldx;
  if (out.codes.size() < n) out.codes.resize(n);
}
// Row tiles [t0, t1) of kPanelRowsXI8 rows of the M rows xq (stride ldx) into out; the share
// with the last row zeroes the rows after it.
inline void interleave_x_i8(const uint8_t* xq, const float* /*sx*/, int64_t M, int64_t ldx, TiledX& out, int64_t t0,
                            int64_t t1) {
  const int64_t r1 = std::min(M, t1 * kPanelRowsXI8);
  flip_code_rows(xq, ldx, t0 * kPanelRowsXI8, r1, out.codes.data());
  if (r1 == M) std::memset(out.codes.data() + M * ldx, 0, ((M + 15) / 16 * 16 - M) * ldx);
}
inline void panel_products_i8_tiled(const uint8_t* xq, const float* sx, const TiledX& tx, int64_t M, int64_t K,
                                    const int8_t* panels, const int32_t* corr, int64_t r0, int64_t rows,
                                    const float* scale, const float* bias, float* y, int64_t ldy,
                                    const int8_t* /*after*/ = nullptr) {
  panel_products_i8(xq, sx, M, K, panels, corr, r0, rows, scale, bias, y, ldy, /*cold=*/true, 0,
                    M >= kAmxMinRowsI8 ? tx.codes.data() : nullptr);
}

#endif  // AMX

}  // namespace inferlab_matvec
