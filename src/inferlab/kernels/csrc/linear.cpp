// Weight-only linear layers: y[M, N] (float32) = x[M, K] (float32) @ W[N, K]^T, with W stored
// in 16 bits (float16 or bfloat16) or in int8 with one float32 scale per output row.
//
// Why: a decode step multiplies a handful of rows by every weight of the model, so its time is
// the time to read the weights. Stored in 16 bits they are half the bytes of float32, in int8 a
// quarter; the products still run in float32 (this CPU has no fast 16-bit arithmetic), after a
// conversion in registers that costs less than the bytes it saves.
//
// Two paths, picked by the number of rows M:
//  - M < mkl_min_rows (decode, short prefill chunks): our kernel. Blocks of 4 weight rows are split
//    over threads (at::parallel_for); each block is read from memory once per call, prefetched as
//    one linear stream, and re-used for every row of x: converted in registers when M <= 3, else
//    converted once into a small float32 buffer in L1 that an fp32 micro-kernel (3 rows of x by
//    4 rows of W, 12 accumulators) re-reads. At these skinny shapes it keeps up with or beats
//    torch's float32 GEMM in arithmetic too (measured up to M ~ 128 on one core here).
//  - M >= mkl_min_rows (prefill): compute-bound, where torch's GEMM is faster than our
//    micro-kernel; float32 tiles of W (16 MB at most, L3-resident) go to at::mm. Converting is one
//    pass over the weights: measured at M = 256..512, within 1-5% of float32 F.linear.
//
// Operators (torch.ops.inferlab.*):
//   linear_w16(Tensor x, Tensor w, Tensor? bias=None, int mkl_min_rows=128) -> Tensor
//       w: float16 or bfloat16 [N, K]
//   linear_w8(Tensor x, Tensor w, Tensor scale, Tensor? bias=None, int mkl_min_rows=128) -> Tensor
//       w: int8 [N, K], scale: float32 [N]; y = (x @ w^T) * scale (+ bias)
// x may have any leading dimensions ([..., K] -> [..., N]).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int kRowsW = 4;  // weight rows per block (one horizontal reduction handles 4 sums)
constexpr int kRowsX = 3;  // rows of x per micro-kernel call: 3 x 4 = 12 of the 16 ymm registers
// How far ahead of the reads the weight stream is prefetched. A block's rows are contiguous and
// consecutive blocks too, so the stream is linear: measured on one core of this EPYC, it takes
// int8 from 6.4 to 14 GB/s and float16 from 11 to 13 GB/s (the hardware prefetcher alone does not
// keep enough lines in flight for 4 interleaved row streams).
constexpr int64_t kPrefetchBytes = 4096;

using namespace inferlab_simd;  // load8, to_float, hsum

// The four sums of a0..a3, in one register: fewer shuffles than four hsum calls.
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// out[i][j] = dot(x row i, w row j) over K, for MB rows of x and NB (4 or 1) rows of w.
// Weights read from memory (not float32: those come from our L1 buffer) are prefetched
// kPrefetchBytes ahead, as one linear stream over the block (w .. w + NB * K).
template <int MB, int NB, typename T>
inline void dot_tile(const float* x, int64_t ldx, const T* w, int64_t ldw, int64_t K, float out[][kRowsW]) {
  constexpr bool kStream = !std::is_same_v<T, float>;
  constexpr int kStepBytes = NB * 8 * sizeof(T);  // weight bytes one k-step consumes
  const char* pf = reinterpret_cast<const char*>(w) + kPrefetchBytes;
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

// Rows m0 .. m0+MB of y, columns n0 .. n0+nb (nb <= 4): the products, then scale and bias.
template <int MB, typename T>
inline void tile_rows(const float* x, int64_t M, int64_t K, const T* w, int64_t ldw, int64_t n0, int nb,
                      const float* scale, const float* bias, float* y, int64_t N, int64_t m0) {
  float out[MB][kRowsW];
  const float* xm = x + m0 * K;
  if (nb == kRowsW) {
    dot_tile<MB, kRowsW>(xm, K, w, ldw, K, out);
  } else {
    for (int j = 0; j < nb; ++j) {
      float one[MB][kRowsW];
      dot_tile<MB, 1>(xm, K, w + j * ldw, ldw, K, one);
      for (int i = 0; i < MB; ++i) out[i][j] = one[i][0];
    }
  }
  for (int i = 0; i < MB; ++i) {
    float* yr = y + (m0 + i) * N + n0;
    for (int j = 0; j < nb; ++j) {
      float v = out[i][j];
      if (scale) v *= scale[n0 + j];
      if (bias) v += bias[n0 + j];
      yr[j] = v;
    }
  }
}

// Every row of x against one block of nb weight rows starting at w (row n0 of W).
template <typename T>
inline void block_all_rows(const float* x, int64_t M, int64_t K, const T* w, int64_t ldw, int64_t n0, int nb,
                           const float* scale, const float* bias, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + kRowsX <= M; m += kRowsX) tile_rows<kRowsX>(x, M, K, w, ldw, n0, nb, scale, bias, y, N, m);
  if (M - m == 2) tile_rows<2>(x, M, K, w, ldw, n0, nb, scale, bias, y, N, m);
  if (M - m == 1) tile_rows<1>(x, M, K, w, ldw, n0, nb, scale, bias, y, N, m);
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

// The decode path: y = x @ w^T (* scale) (+ bias) with our micro-kernel.
template <typename T>
void small_m(const float* x, int64_t M, int64_t K, const T* w, int64_t N, const float* scale, const float* bias,
             float* y) {
  const int64_t blocks = (N + kRowsW - 1) / kRowsW;
  auto run = [&](int64_t b0, int64_t b1, std::vector<float>& buf) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kRowsW;
      const int nb = static_cast<int>(std::min<int64_t>(kRowsW, N - n0));
      const T* wb = w + n0 * K;
      if (M > kRowsX) {
        convert_rows(wb, nb, K, nullptr, buf.data());
        block_all_rows(x, M, K, buf.data(), K, n0, nb, scale, bias, y, N);
      } else {
        block_all_rows(x, M, K, wb, K, n0, nb, scale, bias, y, N);
      }
    }
  };
  // Threads take chunks of blocks from a shared counter rather than a fixed share each, so a
  // thread that starts late (another process holds its core: this machine is shared) finds less
  // left to do; the call still waits for it to arrive at the end of the parallel region.
  // About 8 chunks per thread: long enough runs that the weights stream linearly (a chunk's
  // start is not prefetched), enough of them to even out a late thread; a multiple of 4 blocks
  // (16 columns), so two threads never write the same 64-byte line of y (false sharing).
  const int64_t threads = at::get_num_threads();
  const int64_t chunk = (std::max<int64_t>(1, blocks / (8 * threads)) + 3) / 4 * 4;
  const int64_t tasks = std::min<int64_t>(threads, (blocks + chunk - 1) / chunk);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    thread_local std::vector<float> buf;  // per pool thread, grown once; convert_rows fills it before use
    if (M > kRowsX && buf.size() < static_cast<size_t>(kRowsW * K)) buf.resize(kRowsW * K);
    for (int64_t b0; (b0 = next.fetch_add(chunk, std::memory_order_relaxed)) < blocks;)
      run(b0, std::min(blocks, b0 + chunk), buf);
  });
}

// The prefill path: float32 tiles of W (scale folded in) through torch's GEMM.
template <typename T>
void large_m(const at::Tensor& x2, const T* w, int64_t N, int64_t K, const float* scale,
             const std::optional<at::Tensor>& bias, at::Tensor& y) {
  // Up to 16 MB of float32 per tile: a layer's matrix is one tile (one GEMM over all of N, at its
  // full rate), an lm_head a few; a tile stays in the 32 MB L3 between its conversion and the GEMM.
  const int64_t tile = std::min<int64_t>(N, std::max<int64_t>(64, (int64_t{4} << 20) / K));
  at::Tensor wt = at::empty({tile, K}, x2.options());
  float* wt_p = wt.data_ptr<float>();
  for (int64_t n0 = 0; n0 < N; n0 += tile) {
    const int64_t nn = std::min(tile, N - n0);
    at::parallel_for(0, nn, 16, [&](int64_t r0, int64_t r1) {
      convert_rows(w + (n0 + r0) * K, r1 - r0, K, scale ? scale + n0 + r0 : nullptr, wt_p + r0 * K);
    });
    at::Tensor wn = wt.narrow(0, 0, nn);
    at::Tensor yn = y.narrow(1, n0, nn);  // columns of y: a BLAS-compatible strided output
    if (bias.has_value()) at::addmm_out(yn, bias->narrow(0, n0, nn), x2, wn.t());
    else at::mm_out(yn, x2, wn.t());
  }
}

at::Tensor linear_impl(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scale,
                       const std::optional<at::Tensor>& bias, int64_t mkl_min_rows) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "inferlab linear: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "inferlab linear: w must be a contiguous [N, K] matrix");
  TORCH_CHECK(x.dim() >= 1, "inferlab linear: x must have at least one dimension");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.size(-1) == K, "inferlab linear: x has ", x.size(-1), " features, w expects ", K);
  const float* scale_p = nullptr;
  if (scale.has_value()) {
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->numel() == N,
                "inferlab linear: scale must be a contiguous float32 vector of ", N, " values");
    scale_p = scale->data_ptr<float>();
  }
  const float* bias_p = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "inferlab linear: bias must be a contiguous float32 vector of ", N, " values");
    bias_p = bias->data_ptr<float>();
  }
  at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  std::vector<int64_t> out_sizes(x.sizes().begin(), x.sizes().end());
  out_sizes.back() = N;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M > 0 && N > 0) {
    const bool big = M >= mkl_min_rows;
    AT_DISPATCH_SWITCH(w.scalar_type(), "inferlab_linear",
      AT_DISPATCH_CASE(at::kHalf, [&] {
        if (big) large_m(x2, w.data_ptr<at::Half>(), N, K, scale_p, bias, y);
        else small_m(x2.data_ptr<float>(), M, K, w.data_ptr<at::Half>(), N, scale_p, bias_p, y.data_ptr<float>());
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        if (big) large_m(x2, w.data_ptr<at::BFloat16>(), N, K, scale_p, bias, y);
        else small_m(x2.data_ptr<float>(), M, K, w.data_ptr<at::BFloat16>(), N, scale_p, bias_p, y.data_ptr<float>());
      })
      AT_DISPATCH_CASE(at::kChar, [&] {
        if (big) large_m(x2, w.data_ptr<int8_t>(), N, K, scale_p, bias, y);
        else small_m(x2.data_ptr<float>(), M, K, w.data_ptr<int8_t>(), N, scale_p, bias_p, y.data_ptr<float>());
      })
    );
  }
  return y.view(out_sizes);
}

at::Tensor linear_w16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                      int64_t mkl_min_rows) {
  TORCH_CHECK(w.scalar_type() == at::kHalf || w.scalar_type() == at::kBFloat16,
              "inferlab linear_w16: w must be float16 or bfloat16, got ", w.scalar_type());
  return linear_impl(x, w, std::nullopt, bias, mkl_min_rows);
}

at::Tensor linear_w8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                     const std::optional<at::Tensor>& bias, int64_t mkl_min_rows) {
  TORCH_CHECK(w.scalar_type() == at::kChar, "inferlab linear_w8: w must be int8, got ", w.scalar_type());
  return linear_impl(x, w, scale, bias, mkl_min_rows);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferlab, m) {
  m.def("linear_w16(Tensor x, Tensor w, Tensor? bias=None, int mkl_min_rows=128) -> Tensor");
  m.def("linear_w8(Tensor x, Tensor w, Tensor scale, Tensor? bias=None, int mkl_min_rows=128) -> Tensor");
}

TORCH_LIBRARY_IMPL(inferlab, CPU, m) {
  m.impl("linear_w16", &linear_w16);
  m.impl("linear_w8", &linear_w8);
}
