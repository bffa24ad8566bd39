// Weight-only linear layers: y[M, N] (float32) = x[M, K] (float32) @ W[N, K]^T, with W stored
// in 16 bits (float16 or bfloat16) or in int8 with one float32 scale per output row.
//
// Why: a decode step multiplies a handful of rows by every weight of the model, so its time is
// the time to read the weights. Stored in 16 bits they are half the bytes of float32, in int8 a
// quarter; the products still run in float32 (this CPU has no fast 16-bit arithmetic), after a
// conversion in registers that costs less than the bytes it saves.
//
// Two paths, picked by the number of rows M:
//  - M < mkl_min_rows (decode, short prefill chunks): our kernel (matvec.h: each block of 4 weight
//    rows read once per call and re-used for every row of x), blocks split over threads
//    (at::parallel_for). At these skinny shapes it keeps up with or beats torch's float32 GEMM
//    in arithmetic too (measured up to M ~ 128 on one core here).
//  - M >= mkl_min_rows (prefill): compute-bound, where torch's GEMM is faster than our
//    micro-kernel; float32 tiles of W (16 MB at most, L3-resident) go to at::mm. Converting is one
//    pass over the weights: measured at M = 256..512, within 1-5% of float32 F.linear.
//
// Operators (torch.ops.inferlab.*):
//   linear_w16(Tensor x, Tensor w, Tensor? bias=None, int mkl_min_rows=128) -> Tensor
//       w: float16 or bfloat16 [N, K]
//   linear_w8(Tensor x, Tensor w, Tensor scale, Tensor? bias=None, int mkl_min_rows=128) -> Tensor
//       w: int8 [N, K], codes in [-127, 127], scale: float32 [N]; y = (x @ w^T) * scale (+ bias),
//       float32 products (weight-only int8; w8a8 keeps its codes in panels: linear_panels_i8).
//   linear_w4(Tensor x, Tensor codes, Tensor dm, Tensor? bias=None, int mkl_min_rows=128) -> Tensor
//       4-bit group-wise weights (q4.h's format): codes uint8 [N, K / 2], dm float16 [N, K / 32, 2].
//       Below mkl_min_rows rows x is quantized per group of 32 to int8 and the integer dot
//       product runs on the codes (vpdpbusd on AVX-512, vpmaddubsw on AVX2); from there, the
//       weight dequantized in tiles to bf16 for oneDNN's GEMM (AVX-512) or float32 for at::mm.
//   linear_panels(Tensor x, Tensor panels, int n, Tensor? bias=None, bool out_bf16=False) -> Tensor
//       (AVX-512 BF16 variant only) bf16 weights as kernels/linear.py's pack_panels stores them
//       there ([ceil(n / 16), ceil(K / 2), 16, 2], matvec.h's panel layout), every row count by
//       vdpbf16ps: x (float32 or bf16) rounded to bf16, float32 sums, the output float32 or
//       rounded to bf16. Many rows go 64 at a time over the weights (kPanelRowBlock); against
//       oneDNN's bf16 GEMM on the [N, K] matrix: 0.9-1.0x at 512 rows, and one copy of the weights.
//   linear_panels_rope_kv(Tensor x, Tensor panels, Tensor? bias, Tensor positions, Tensor cos, Tensor sin,
//                         Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, int H, int kvH, int D,
//                         Tensor? k_scale=None, Tensor? v_scale=None) -> (Tensor q, Tensor k, Tensor v)
//       (AVX-512 BF16 variant only) a qkv weight's linear_panels (float32 out) with fused.cpp's
//       rope_write_kv as its epilogue, chunk by chunk of whole heads (D a multiple of 16): q, k
//       rotated, v, each float32 [T, heads, D], k and v written into the caches at `slots`; the
//       same bits as the two operators one after the other (csrc/rope_kv.h holds the shared code).
//   linear_panels_silu(Tensor x, Tensor panels, int n) -> Tensor
//       (AVX-512 BF16 variants) a gate/up weight [gate; up] of n rows (n a multiple of 32) in panels:
//       silu(x W_gate^T) * (x W_up^T), bf16 [..., n / 2], the bits of silu_mul(linear_panels(x,
//       panels, n, out_bf16=True)), the SiLU taken from the gate and up sums while they are in
//       cache (the amx variant's tiles, each gate panel beside its up panel; elsewhere a pass's
//       columns into a buffer: products_silu_bf16): the [M, n] product is never written (a
//       1,024-token prefill of SmolLM2 wrote and read back 6 MB a layer, and the separate
//       silu_mul was ~7% of its time on the Xeon).
//   linear_panels_i8_silu_q(Tensor xq, Tensor sx, int k, Tensor panels, Tensor corr, Tensor scale, int n)
//       -> (Tensor, Tensor)
//       w8a8's the same: a [gate; up] weight of n rows (n a multiple of 128) in panels, x as codes
//       (linear_panels_i8_q's xq, sx): the down product's codes and scales, the bits of
//       silu_mul_q8(linear_panels_i8_q(...)), never the [M, n] float32 product. On the amx
//       variant from its tiles, 4 gate and 4 up panels at a time (1,024-token prefill of SmolLM2
//       296-323 -> 261-274 ms, 8 x 256 528-551 -> 438-450, alternated, Xeon); elsewhere a group
//       of outputs' gate and up columns by the panel products into a buffer in cache (panel_silu_q8).
//   linear_panels_i8(Tensor x, Tensor panels, Tensor corr, Tensor scale, int n, Tensor? bias=None) -> Tensor
//       w8a8: int8 codes as kernels/linear.py's pack_panels_i8 stores them ([ceil(n / 16),
//       ceil(K / 64) * 16, 16, 4]; on AVX2 with the sign bit flipped, u = w + 128), corr their
//       group corrections (panel_corrections_i8, int32 [ceil(n / 16), ceil(K / 64), 16] on
//       AVX-512; empty on AVX2), scale float32 [n]: x quantized per group (matvec.h: 8 bits per
//       64 values by vpdpbusd on AVX-512, 7 bits per 16 by vpmaddubsw on AVX2) and the exact
//       integer group sums at every row count, 64 rows a pass over the weights.
//   linear_panels_i8_argmax(Tensor x, Tensor panels, Tensor corr, Tensor scale, int n, Tensor? bias=None)
//                           -> Tensor
//       each row of x [M, K]'s argmax over linear_panels_i8's n outputs (int64 [M], the first index
//       of the largest: a greedy decode step's tokens), the product never written whole.
//   linear_panels_argmax(Tensor x, Tensor panels, int n, Tensor? bias=None) -> Tensor
//       (avx512 variants) the same over linear_panels' float32 outputs (bf16 panels).
//   linear_panels_i8_q(Tensor xq, Tensor sx, int k, Tensor panels, Tensor corr, Tensor scale, int n,
//                      Tensor? bias=None) -> Tensor
//       the same product from x already quantized: xq uint8 [M, ceil(k / 64) * 64]
//       (q + 128, padded with 128), sx float32 [M, ceil(k / 64) * 64 / group] (fused.cpp's *_q8
//       operators).
//   linear_panels_i8_q_rope_kv(Tensor xq, Tensor sx, int k, Tensor panels, Tensor corr, Tensor scale, Tensor? bias,
//                              <linear_panels_rope_kv's arguments from positions on>) -> (Tensor, Tensor, Tensor)
//       w8a8's the same: linear_panels_i8_q with rope_write_kv as its epilogue.
//   w8a8_numerics() -> int[]
//       what this build's w8a8 does, for kernels/build.py to check against what it reports:
//       [x values per scale, x's largest code, the panels' xor on the codes (0 or 128), values
//       sharing a power of two in the scales (0: float32 scales; matvec.h kI8ScaleBlock)].
//   panel_rows(Tensor panels, Tensor ids, int k, Tensor? scale=None) -> Tensor
//       rows `ids` of a matrix in either panel layout, float32 [len(ids), k] (an embedding lookup),
//       each times its scale[id] where given (int8 codes' per-row scales: the N real rows).
// x may have any leading dimensions ([..., K] -> [..., N]).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "matvec.h"
#include "q4.h"
#include "rope_kv.h"
#include "rows.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include <unistd.h>

namespace {

using namespace inferlab_matvec;  // row_products, convert_rows, kRowsW

// How many bytes of x's rows the passes of a group may span: half of a core's L2 (the other half
// for the weights' chunk, for_pass_chunks), read once.
inline int64_t x_group_bytes() {
  static const int64_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return static_cast<int64_t>(l2 > 0 ? l2 : 1 << 20) / 2;
  }();
  return bytes;
}

// Runs fn(p, b0, b1) for every pass p in [0, passes) and chunk [b0, b1) of [0, blocks) on torch's
// threads, in one parallel region: the passes in groups of `group`, within a group chunk by
// chunk, each chunk's passes one after the other (for_row_passes: the chunk's weights stay in
// cache for them). The tasks are taken from one shared counter rather than a fixed share each,
// so a thread that starts late (another process holds its core: this machine is shared) finds
// less left to do; the call still waits for it at the end, but not
// between passes, which are independent (a region per pass joined its threads 16 times a product
// at 1,024 rows, ~1,900 times a prefill step of SmolLM2, libgomp's barrier ~9% of the step's
// samples). About 8 chunks per thread: long enough runs that the weights stream linearly (a
// chunk's start is not prefetched), enough of them to even out a late thread; a multiple of
// `align` blocks, so two threads never write the same 64-byte line of y (false sharing). With
// several passes the tasks are passes x chunks, so the chunks widen until about 8 tasks a thread
// are left over all the passes, at most x_group_bytes of weights (block_bytes a block; 0: keep
// the one-pass width). Why: every task pays a start (the tiles' configuration, its first
// weights, x's rows into L1) that narrow chunks paid many times: a 1,024-row product of
// SmolLM2's shapes, 2 cores of the Xeon with AMX, GOP/s in-process alternated, w8a8 / bf16:
// 576 x 576 1,736 -> 2,265 / 1,345 -> 1,828, 960 x 576 1,634 -> 2,631 / 1,517 -> 1,951, 576 x
// 1,536 1,933 -> 2,169 / 1,624 -> 1,815, gate/up 3,072 x 576 1,744 -> 1,878 / 1,417 -> 1,607
// (all of the weights as one chunk: no faster; at 128 and 2,048 rows alike or faster).
template <typename F>
void for_pass_chunks(int64_t passes, int64_t blocks, const F& fn, int64_t align = 4, int64_t group = 1,
                     int64_t block_bytes = 0) {
  const int64_t threads = at::get_num_threads();
  auto align_up = [&](int64_t v) { return (v + align - 1) / align * align; };
  int64_t chunk = align_up(std::max<int64_t>(1, blocks / (8 * threads)));
  if (passes > 1 && block_bytes > 0) {
    const int64_t per_pass_min = (8 * threads + passes - 1) / passes;
    const int64_t wide = std::min((blocks + per_pass_min - 1) / per_pass_min,
                                  std::max(align, x_group_bytes() / block_bytes));
    if (wide > chunk) {
      const int64_t n = (blocks + wide - 1) / wide;
      chunk = align_up((blocks + n - 1) / n);
    }
  }
  const int64_t per_pass = (blocks + chunk - 1) / chunk, tasks = passes * per_pass;
  const int64_t per_group = group * per_pass;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, tasks), 1, [&](int64_t, int64_t) {
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const int64_t p0 = t / per_group * group, in = std::min(group, passes - p0), r = t % per_group;
      const int64_t b0 = r / in * chunk;
      fn(p0 + r % in, b0, std::min(blocks, b0 + chunk));
    }
  });
}

// fn(b0, b1) over [0, blocks): one pass.
template <typename F>
void for_block_chunks(int64_t blocks, const F& fn, int64_t align = 4) {
  for_pass_chunks(1, blocks, [&](int64_t, int64_t b0, int64_t b1) { fn(b0, b1); }, align);
}

// An optional float32 vector of n values (a scale or a bias), checked: its data, or null.
const float* vector_or_null(const std::optional<at::Tensor>& v, int64_t n, const char* op, const char* what) {
  if (!v.has_value()) return nullptr;
  TORCH_CHECK(v->scalar_type() == at::kFloat && v->is_contiguous() && v->numel() == n, "inferlab ", op, ": ", what,
              " must be a contiguous float32 vector of ", n, " values");
  return v->data_ptr<float>();
}

// The decode path: y = x @ w^T (* scale) (+ bias) with our micro-kernel.
template <typename T>
void small_m(const float* x, int64_t M, int64_t K, const T* w, int64_t N, const float* scale, const float* bias,
             float* y) {
  const int64_t blocks = (N + kRowsW - 1) / kRowsW;
  auto run = [&](int64_t b0, int64_t b1, std::vector<float>& buf, std::vector<float>& out) {
    const int64_t n0 = b0 * kRowsW, n1 = std::min(N, b1 * kRowsW);
    row_products(x, M, K, w, n0, n1 - n0, scale, bias, buf.data(), out.data(), y + n0, N);
  };
  for_block_chunks(blocks, [&](int64_t b0, int64_t b1) {
    thread_local std::vector<float> buf, out;  // per pool thread, grown once; filled before use
    if (buf.size() < static_cast<size_t>(kRowsW * K)) buf.resize(kRowsW * K);
    if (out.size() < static_cast<size_t>(kRowsW * M)) out.resize(kRowsW * M);
    run(b0, b1, buf, out);
  });
}

// The decode path for 4-bit weights: x quantized once (q4.h), then blocks of rows over threads.
void small_m_q4(const float* x, int64_t M, int64_t K, const uint8_t* codes, const uint16_t* dm, int64_t N,
                const float* bias, float* y) {
  // The calling thread's, grown once. The pool threads read it through this reference: the name
  // of a thread_local in the lambda would be each pool thread's own (empty) one.
  thread_local inferlab_q4::Q4X mine;
  inferlab_q4::Q4X& xq = mine;
  inferlab_q4::quantize_x(x, M, K, xq);
  for_block_chunks((N + kRowsW - 1) / kRowsW, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * kRowsW, n1 = std::min(N, b1 * kRowsW);
    inferlab_q4::row_products_q4(xq, codes, dm, n0, n1 - n0, bias, y + n0, N);
  });
}

// The prefill path for 4-bit weights: tiles dequantized to float32, then oneDNN's bf16 GEMM on
// the AVX-512 variant (as int8's) or at::mm on AVX2 (as 16-bit weights').
void large_m_q4(const at::Tensor& x2, const uint8_t* codes, const uint16_t* dm, int64_t N, int64_t K,
                const std::optional<at::Tensor>& bias, at::Tensor& y) {
  const int64_t tile = std::min<int64_t>(N, std::max<int64_t>(64, (int64_t{4} << 20) / K));
  at::Tensor wt = at::empty({tile, K}, x2.options());
  float* wt_p = wt.data_ptr<float>();
#if defined(__AVX512BF16__)
  const at::Tensor xb = x2.to(at::kBFloat16);
#endif
  for (int64_t n0 = 0; n0 < N; n0 += tile) {
    const int64_t nn = std::min(tile, N - n0);
    at::parallel_for(0, nn, 16, [&](int64_t r0, int64_t r1) {
      inferlab_q4::dequantize_rows_q4(codes + (n0 + r0) * (K / 2), dm + (n0 + r0) * (K / 16), r1 - r0, K,
                                      wt_p + r0 * K);
    });
    at::Tensor wn = wt.narrow(0, 0, nn);
    at::Tensor yn = y.narrow(1, n0, nn);
#if defined(__AVX512BF16__)
    yn.copy_(at::linear(xb, wn.to(at::kBFloat16)));
#else
    at::mm_out(yn, x2, wn.t());
#endif
  }
  if (bias.has_value()) y.add_(*bias);
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
  const float* scale_p = vector_or_null(scale, N, "linear", "scale");
  const float* bias_p = vector_or_null(bias, N, "linear", "bias");
  at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  std::vector<int64_t> out_sizes(x.sizes().begin(), x.sizes().end());
  out_sizes.back() = N;
  const bool big = M >= mkl_min_rows;
#if defined(__AVX512BF16__)
  // int8 weights, many rows: oneDNN's bf16 GEMM on x rounded to bf16 and bf16 tiles of codes x
  // scales (bf16's 8 bits hold a 7-bit code; the product's rounding, 2^-9, is well under the int8
  // step). Measured 2.2x faster than float32 tiles through at::mm at a 1,024-token prefill of
  // SmolLM2, one thread. (bf16 weights on this variant are in panels: linear_panels.)
  if (big && M > 0 && N > 0 && w.scalar_type() == at::kChar) {
    at::Tensor xb = x2.to(at::kBFloat16);
    at::Tensor y = at::empty({M, N}, x.options());
    const int64_t tile = std::min<int64_t>(N, std::max<int64_t>(64, (int64_t{4} << 20) / K));
    for (int64_t n0 = 0; n0 < N; n0 += tile) {
      const int64_t nn = std::min(tile, N - n0);
      at::Tensor wt = (w.narrow(0, n0, nn).to(at::kFloat) * scale->narrow(0, n0, nn).unsqueeze(1)).to(at::kBFloat16);
      y.narrow(1, n0, nn).copy_(at::linear(xb, wt));
    }
    if (bias.has_value()) y.add_(*bias);
    return y.view(out_sizes);
  }
#endif
  at::Tensor y = at::empty({M, N}, x.options());
  if (M > 0 && N > 0) {
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

// Rows of x per pass over the weights when x has many: 64 bf16 rows of SmolLM2's K stay in L2
// beside a column tile's panels (at 512 rows, one pass over all of them ran 5-15% slower). The
// first pass reads the panels from memory (`cold` to panel_products_*), the later ones from L3.
constexpr int64_t kPanelRowBlock = 64;

// for_pass_chunks over the passes of kPanelRowBlock rows of M: fn(m0, rows, b0, b1), the passes
// in groups whose rows of x (x_row_bytes each) fit in x_group_bytes: a chunk of the weights is
// multiplied by every pass of a group while it is in L2, rather than all the weights streamed
// from L3 once a pass (gate_up's 3.5 MB 16 times at 1,024 rows). Measured on 2 cores of a Xeon
// with AMX, SmolLM2's four products a layer, in-process alternated (medians of 7): 512 rows
// 2.96 -> 2.54 ms, 1,024 5.67 -> 4.79, 2,048 11.47 -> 9.43; engine prefill steps 512 tokens
// 224 -> 205 ms, 8 x 256 718 -> 688 (w8a8 228 -> 208, 764 -> 751).
template <typename F>
void for_row_passes(int64_t M, int64_t blocks, const F& fn, int64_t align, int64_t x_row_bytes,
                    int64_t block_bytes = 0) {
  const int64_t group = std::max<int64_t>(1, x_group_bytes() / (kPanelRowBlock * x_row_bytes));
  for_pass_chunks((M + kPanelRowBlock - 1) / kPanelRowBlock, blocks, [&](int64_t p, int64_t b0, int64_t b1) {
    const int64_t m0 = p * kPanelRowBlock;
    fn(m0, std::min(kPanelRowBlock, M - m0), b0, b1);
  }, align, group, block_bytes);
}

// The qkv product with RoPE and the cache write as its epilogue (linear_panels_rope_kv and w8a8's
// linear_panels_i8_q_rope_kv): each task's chunk of whole heads is multiplied into a buffer of
// its own (float32 sums, as the plain product gives them) by product(m0, rows, c0, cols, buf) and
// its heads rotated and written from there (rope_kv.h, rope_write_kv's code) while they are in
// this core's cache. Why: rope_write_kv read the finished [T, (H + 2 kvH) * D] product back from
// L3 and the other core's L2 (the product's column chunks are shared out, rope's tokens too):
// 0.8-0.9 ms a layer at 1,024 tokens in a prefill against 0.25 with the same arguments in cache.
template <typename Product>
void products_rope_kv(const inferlab_rope_kv::RopeKv& a, at::Tensor& k_cache, at::Tensor& v_cache, int64_t blocks,
                      int64_t align, int64_t x_row_bytes, int64_t block_bytes, const Product& product) {
  const int64_t n = (a.heads + 2 * a.kv_heads) * a.d, head_panels = a.d / kPanel;
  inferlab_rope_kv::dispatch_cache(k_cache, v_cache, [&](auto* kc, auto* vc) {
    for_row_passes(a.t, blocks, [&](int64_t m0, int64_t mm, int64_t p0, int64_t p1) {
      thread_local std::vector<float> buf;
      const int64_t c0 = p0 * kPanel, cols = std::min(n, p1 * kPanel) - c0;  // whole heads (the chunks' align)
      buf.resize(mm * cols);
      product(m0, mm, c0, cols, buf.data());
      for (int64_t i = 0; i < mm; ++i)
        for (int64_t h = c0 / a.d; h < (c0 + cols) / a.d; ++h)
          inferlab_rope_kv::rope_kv_head(a, kc, vc, m0 + i, h, buf.data() + i * cols + h * a.d - c0);
    }, std::lcm(align, head_panels), x_row_bytes, block_bytes);
  });
}

void check_rope_head_dim(const char* op, int64_t head_dim) {
  TORCH_CHECK(head_dim > 0 && head_dim % kPanel == 0, "inferlab ", op, ": head_dim (", head_dim,
              ") must be a multiple of ", kPanel);
}

#if defined(__AVX512BF16__)
// A task's panels come in multiples of this: the avx512 kernel's column tiles of 3 panels, the amx
// variant's 2 x 2 blocks of 2 panels (in 4s: whole 64-byte lines of y). In 3s, a third of the
// panels of SmolLM2's 576-column products went through 2 x 1 blocks (one B tile a k-step).
#ifdef INFERLAB_AMX
constexpr int64_t kPanelsPerChunk = 4;
#else
constexpr int64_t kPanelsPerChunk = kPanelsPerTile;
#endif

// x [M, K] (float32 or bf16) in bf16, rows of kp values (a zero past an odd K): as given when it
// already is.
at::Tensor x_in_bf16(const at::Tensor& x2, int64_t kp) {
  const int64_t M = x2.size(0), K = x2.size(1);
  if (x2.scalar_type() == at::kBFloat16 && kp == K) return x2.contiguous();
  if (x2.scalar_type() == at::kBFloat16) return at::constant_pad_nd(x2, {0, 1}, 0).contiguous();
  at::Tensor xb = at::empty({M, kp}, x2.options().dtype(at::kBFloat16));
  const at::Tensor xf = x2.contiguous();
  const float* xp = xf.data_ptr<float>();
  uint16_t* dp = reinterpret_cast<uint16_t*>(xb.data_ptr<at::BFloat16>());
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) { x_to_bf16_rows(xp + m0 * K, m1 - m0, K, dp + m0 * kp); });
  return xb;
}

void check_bf16_panels(const char* name, const at::Tensor& x, const at::Tensor& panels, int64_t n) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "inferlab ", name, ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16 && panels.dim() == 4 && panels.is_contiguous() &&
                  panels.size(2) == kPanel && panels.size(3) == 2,
              "inferlab ", name, ": panels must be contiguous bf16 [N / 16, K / 2, 16, 2] (pack_panels)");
  TORCH_CHECK(x.dim() >= 1, "inferlab ", name, ": x must have at least one dimension");
  const int64_t K = x.size(-1), kp = panel_k(K);
  TORCH_CHECK(panels.size(1) * 2 == kp && n > 0 && (n + kPanel - 1) / kPanel == panels.size(0),
              "inferlab ", name, ": panels ", panels.sizes(), " do not hold ", n, " x ", K, " weights");
}

at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                         const std::optional<at::Tensor>& bias, bool out_bf16) {
  check_bf16_panels("linear_panels", x, panels, n);
  const int64_t K = x.size(-1), kp = panel_k(K);
  const float* bias_p = vector_or_null(bias, n, "linear_panels", "bias");
  at::Tensor x2 = x.reshape({-1, K});
  const int64_t M = x2.size(0);
  std::vector<int64_t> out_sizes(x.sizes().begin(), x.sizes().end());
  out_sizes.back() = n;
  at::Tensor y = at::empty({M, n}, x.options().dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
  if (M == 0) return y.view(out_sizes);
  const at::Tensor xb = x_in_bf16(x2, kp);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  const at::BFloat16* wp = panels.data_ptr<at::BFloat16>();
  auto run = [&](auto* yp) {
    for_row_passes(M, panels.size(0), [&](int64_t m0, int64_t mm, int64_t p0, int64_t p1) {
      const int64_t c0 = p0 * kPanel, c1 = std::min(n, p1 * kPanel);
      panel_products_bf16(xp + m0 * kp, kp, mm, K, wp, c0, c1 - c0, nullptr, bias_p, yp + m0 * n + c0, n, m0 == 0);
    }, kPanelsPerChunk, kp * 2, kPanel * kp * 2);
  };
  if (out_bf16) run(y.data_ptr<at::BFloat16>());
  else run(y.data_ptr<float>());
  return y.view(out_sizes);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_panels_rope_kv(
    const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias, const at::Tensor& positions,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale) {
  const char* op = "linear_panels_rope_kv";
  const int64_t n = (num_heads + 2 * num_kv_heads) * head_dim;
  check_bf16_panels(op, x, panels, n);
  TORCH_CHECK(x.dim() == 2, "inferlab ", op, ": x must be [T, K]");
  check_rope_head_dim(op, head_dim);
  const int64_t K = x.size(1), kp = panel_k(K);
  const float* bias_p = vector_or_null(bias, n, op, "bias");
  const inferlab_rope_kv::RopeKv a = inferlab_rope_kv::check_rope_kv(
      op, x.size(0), positions, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads, head_dim, k_scale, v_scale,
      /*with_v=*/true);
  if (a.t == 0) return {a.q_t, a.k_t, a.v_t};
  const at::Tensor xb = x_in_bf16(x, kp);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  const at::BFloat16* wp = panels.data_ptr<at::BFloat16>();
  products_rope_kv(a, k_cache, v_cache, panels.size(0), kPanelsPerChunk, kp * 2, kPanel * kp * 2,
                   [&](int64_t m0, int64_t mm, int64_t c0, int64_t cols, float* buf) {
                     panel_products_bf16(xp + m0 * kp, kp, mm, K, wp, c0, cols, nullptr, bias_p, buf, cols, m0 == 0);
                   });
  return {a.q_t, a.k_t, a.v_t};
}

// A product's float32 sums as linear_panels(out_bf16) stores them and silu_mul widens them again.
inline __m512 bf16_rounded(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

#ifdef INFERLAB_AMX
// silu(gate) * up from the gate/up panels' tiles, for M rows of x (bf16, stride ldx) and the
// `np` panels from gate panel g0 on (up panel g0 + half with each): the 2 x 2 blocks multiply a
// gate panel and its up panel, and their sums go out as the product then silu_mul would take
// them (each rounded to bf16, widened, silu_mul16, rounded), so y's bits are those of
// silu_mul(linear_panels(x, out_bf16)) without the [M, 2I] product written and read back.
void products_silu_bf16(const uint16_t* xb, int64_t ldx, int64_t M, int64_t kp, int64_t /*K*/, const uint16_t* gate,
                        const uint16_t* up, int64_t np, at::BFloat16* y, int64_t ldy, bool /*cold*/) {
  thread_local std::vector<uint16_t> tail_buf;
  const AmxRows<uint16_t> xr(xb, ldx, M, tail_buf);
  const AmxScope tiles(M);
  amx_operands_written();
  for (int64_t j = 0; j < np; ++j) {
    const uint16_t *wg = gate + j * kPanel * kp, *wu = up + j * kPanel * kp;
    for (int64_t m = 0; m < M; m += 32) {
      const int v0 = static_cast<int>(std::min<int64_t>(16, M - m)), v1 = static_cast<int>(std::min<int64_t>(16, M - m - 16));
      alignas(64) float c[4][16][16];
      if (v1 > 0) amx_tiles_bf16<2, 2>(xr.tile(m), xr.tile(m + 16), ldx, wg, wu, kp, c);
      else amx_tiles_bf16<1, 2>(xr.tile(m), xr.tile(m), ldx, wg, wu, kp, c);
      for (int t = 0; t < (v1 > 0 ? 2 : 1); ++t)
        for (int i = 0, valid = t ? v1 : v0; i < valid; ++i)
          store16(y + (m + t * 16 + i) * ldy + j * kPanel, __mmask16(0xffff),
                  inferlab_rows::silu_mul16(bf16_rounded(_mm512_load_ps(c[t * 2][i])),
                                            bf16_rounded(_mm512_load_ps(c[t * 2 + 1][i]))));
    }
  }
}
#else
// The same from the panel products (vdpbf16ps): the np gate panels' columns for the M rows (a
// pass, <= kPanelRowBlock), then their up panels', into buffers of this thread's (in L2), then
// silu_mul16 of the rounded sums, as the amx variant does from its tiles. Why: the [M, 2I]
// product (bf16) went to memory and back for silu_mul.
void products_silu_bf16(const uint16_t* xb, int64_t ldx, int64_t M, int64_t /*kp*/, int64_t K, const uint16_t* gate,
                        const uint16_t* up, int64_t np, at::BFloat16* y, int64_t ldy, bool cold) {
  thread_local std::vector<float> g, u;
  const int64_t cols = np * kPanel;
  g.resize(M * cols), u.resize(M * cols);
  const auto* wg = reinterpret_cast<const at::BFloat16*>(gate);
  const auto* wu = reinterpret_cast<const at::BFloat16*>(up);
  panel_products_bf16(xb, ldx, M, K, wg, 0, cols, nullptr, nullptr, g.data(), cols, cold);
  panel_products_bf16(xb, ldx, M, K, wu, 0, cols, nullptr, nullptr, u.data(), cols, cold);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t c = 0; c < cols; c += kPanel)
      store16(y + i * ldy + c, __mmask16(0xffff),
              inferlab_rows::silu_mul16(bf16_rounded(_mm512_loadu_ps(g.data() + i * cols + c)),
                                        bf16_rounded(_mm512_loadu_ps(u.data() + i * cols + c))));
}
#endif

// linear_panels_silu(x, panels, n): silu(x W_gate^T) * (x W_up^T), bf16 [..., n / 2], for a gate/up
// weight [gate; up] of n rows in panels, n a multiple of 32 (each half whole panels).
at::Tensor linear_panels_silu(const at::Tensor& x, const at::Tensor& panels, int64_t n) {
  check_bf16_panels("linear_panels_silu", x, panels, n);
  TORCH_CHECK(n % (2 * kPanel) == 0, "inferlab linear_panels_silu: n (", n, ") must be a multiple of ", 2 * kPanel);
  const int64_t K = x.size(-1), kp = panel_k(K), half = n / 2;
  TORCH_CHECK(kp % 32 == 0, "inferlab linear_panels_silu: K (", K, ") must round up to a multiple of 32");
  at::Tensor x2 = x.reshape({-1, K});
  const int64_t M = x2.size(0);
  std::vector<int64_t> out_sizes(x.sizes().begin(), x.sizes().end());
  out_sizes.back() = half;
  at::Tensor y = at::empty({M, half}, x.options().dtype(at::kBFloat16));
  if (M == 0) return y.view(out_sizes);
  const at::Tensor xb = x_in_bf16(x2, kp);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t gate_panels = half / kPanel;
  for_row_passes(M, gate_panels, [&](int64_t m0, int64_t mm, int64_t p0, int64_t p1) {  // as linear_panels
    products_silu_bf16(xp + m0 * kp, kp, mm, kp, K, wp + p0 * kPanel * kp, wp + (gate_panels + p0) * kPanel * kp,
                       p1 - p0, yp + m0 * half + p0 * kPanel, half, m0 == 0);
  }, kPanelsPerTile, kp * 2, 2 * kPanel * kp * 2);
  return y.view(out_sizes);
}

#endif

// The checks both w8a8 operators share: panels, corrections and scales of an [n, K] matrix.
void check_i8_panels(const char* name, int64_t K, const at::Tensor& panels, const at::Tensor& corr,
                     const at::Tensor& scale, int64_t n) {
  const int64_t groups = i8_groups(K), np = (n + kPanel - 1) / kPanel;
  TORCH_CHECK(panels.scalar_type() == at::kChar && panels.dim() == 4 && panels.is_contiguous() && n > 0 &&
                  panels.size(0) == np && panels.size(1) == groups * kI8Group / 4 && panels.size(2) == kPanel &&
                  panels.size(3) == 4,
              "inferlab ", name, ": panels must be contiguous int8 [", np, ", ", groups * kI8Group / 4, ", ",
              kPanel, ", 4] (pack_panels_i8 of ", n, " x ", K, " codes), got ", panels.sizes());
  const int64_t corr_n = kI8ColumnSums ? np * groups * kPanel : 0;  // the AVX2 variant reads none
  TORCH_CHECK(corr.scalar_type() == at::kInt && corr.is_contiguous() && corr.numel() == corr_n,
              "inferlab ", name, ": corr must be contiguous int32 [", kI8ColumnSums ? np : 0, ", ", groups, ", ", kPanel,
              "] (panel_corrections_i8)");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n,
              "inferlab ", name, ": scale must be a contiguous float32 vector of ", n, " values");
}

// x's signed codes for the amx variant's tiles (amx.h), made once for every call of an operator
// (its passes and column chunks all read them) in a buffer of the calling thread's, the rows
// shared out over the threads: M rows of stride ldx, zero rows after them to a whole 16-row
// tile. Null on the other variants, and where no call reaches the tiles: panel_products_i8
// multiplies by tiles from kAmxMinRowsI8 rows, amx_silu_q8 at every row count (`any_rows`).
const int8_t* tile_codes(const uint8_t* xq, int64_t M, int64_t ldx, bool any_rows = false) {
#ifdef INFERLAB_AMX
  if (!any_rows && M < kAmxMinRowsI8) return nullptr;
  thread_local std::vector<int8_t> mine;  // grown, never shrunk: no zero-fill of what is written anyway
  const int64_t tiles = (M + 15) / 16;
  if (static_cast<int64_t>(mine.size()) < tiles * 16 * ldx) mine.resize(tiles * 16 * ldx);
  int8_t* codes = mine.data();
  at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {
    flip_code_rows(xq, ldx, t0 * 16, std::min(M, t1 * 16), codes);
    if (t1 * 16 > M) std::memset(codes + M * ldx, 0, (t1 * 16 - M) * ldx);
  });
  return codes;
#else
  (void)xq, (void)M, (void)ldx, (void)any_rows;
  return nullptr;
#endif
}

// Row m0's signed codes in tile_codes' result (null where it made none).
inline const int8_t* codes_at(const int8_t* codes, int64_t m0, int64_t ldx) {
  return codes ? codes + m0 * ldx : nullptr;
}

// y [M, n] from x's codes (u8, rows of i8_groups(K) * 64) and scales [M, i8_scale_groups(K)]: 64 rows
// a pass over the weights, each pass's panels shared out over the threads; or, on the AVX2
// variant from 2 passes a thread on, the rows shared out, each thread's over every panel.
void products_i8(const uint8_t* qp, const float* sp, int64_t M, int64_t K, const at::Tensor& panels,
                 const at::Tensor& corr, const at::Tensor& scale, int64_t n, const float* bias_p, float* yp) {
  const int64_t ldx = i8_groups(K) * kI8Group, ls = i8_scale_groups(K), np = (n + kPanel - 1) / kPanel;
  const uint64_t epoch = next_x_epoch();  // these codes, for every call below
  const int8_t* wp = panels.data_ptr<int8_t>();
  const int32_t* cp = corr.data_ptr<int32_t>();
  const float* scp = scale.data_ptr<float>();
  const int8_t* xs = tile_codes(qp, M, ldx);
  const int64_t row_blocks = (M + kPanelRowBlock - 1) / kPanelRowBlock, threads = at::get_num_threads();
  if (kI8SplitRows && row_blocks >= 2 * threads) {
    // Each thread whole blocks of rows over every panel: one fork and join a product, and x's
    // tile copy made by the one thread that reads it (matvec.h kI8SplitRows). Blocks of equal
    // size, a multiple of 4 rows, as many as the 64-row passes rounded up to whole rounds of threads.
    const int64_t blocks = (row_blocks + threads - 1) / threads * threads;
    const int64_t per = ((M + blocks - 1) / blocks + kPanelRowsXI8 - 1) / kPanelRowsXI8 * kPanelRowsXI8;
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t b; (b = next.fetch_add(1, std::memory_order_relaxed)) * per < M;) {
        const int64_t m0 = b * per, mm = std::min(per, M - m0);
        panel_products_i8(qp + m0 * ldx, sp + m0 * ls, mm, K, wp, cp, 0, n, scp, bias_p, yp + m0 * n, n, true, epoch,
                          codes_at(xs, m0, ldx));
      }
    });
    return;
  }
  for_row_passes(M, np, [&](int64_t m0, int64_t mm, int64_t p0, int64_t p1) {
    const int64_t c0 = p0 * kPanel, c1 = std::min(n, p1 * kPanel);
    panel_products_i8(qp + m0 * ldx, sp + m0 * ls, mm, K, wp, cp, c0, c1 - c0, scp, bias_p, yp + m0 * n + c0, n,
                      m0 == 0, epoch, codes_at(xs, m0, ldx));
  }, kPanelsPerTileI8, ldx, kPanel * ldx);
}

// The M rows of x2 (float32 [M, K], contiguous) quantized for the w8a8 products: codes uint8
// [M, i8_groups(K) * 64] and scales float32 [M, i8_scale_groups(K)] (quantize_rows_u8).
std::pair<at::Tensor, at::Tensor> quantize_x_i8(const at::Tensor& x2) {
  const int64_t M = x2.size(0), K = x2.size(1), ldx = i8_groups(K) * kI8Group, ls = i8_scale_groups(K);
  at::Tensor xq = at::empty({M, ldx}, x2.options().dtype(at::kByte));
  at::Tensor sx = at::empty({M, ls}, x2.options());
  const float* xp = x2.data_ptr<float>();
  uint8_t* qp = xq.data_ptr<uint8_t>();
  float* sp = sx.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    quantize_rows_u8(xp + m0 * K, m1 - m0, K, qp + m0 * ldx, sp + m0 * ls);
  });
  return {xq, sx};
}

at::Tensor linear_panels_i8(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& corr,
                            const at::Tensor& scale, int64_t n, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "inferlab linear_panels_i8: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, "inferlab linear_panels_i8: x must have at least one dimension");
  const int64_t K = x.size(-1);
  check_i8_panels("linear_panels_i8", K, panels, corr, scale, n);
  const float* bias_p = vector_or_null(bias, n, "linear_panels_i8", "bias");
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  std::vector<int64_t> out_sizes(x.sizes().begin(), x.sizes().end());
  out_sizes.back() = n;
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0) return y.view(out_sizes);
  const auto [xq, sx] = quantize_x_i8(x2);
  products_i8(xq.data_ptr<uint8_t>(), sx.data_ptr<float>(), M, K, panels, corr, scale, n, bias_p,
              y.data_ptr<float>());
  return y.view(out_sizes);
}

// Each row's argmax over a product's n outputs (the first index of the largest, as the
// sampler's greedy token: simd.h row_argmax), int64 [M], without the [M, n] product: the
// columns in chunks of kArgmaxChunk, each thread a run of chunks, each chunk multiplied into a
// buffer of the thread's (product(col, cols, buf): the bits the whole product gives those
// columns) and reduced there while it is in cache. Why: a greedy decode step otherwise writes
// the whole logits out and the sampler reads them back (SmolLM2's 49,152 columns: 6.3 MB at 32
// streams). 2,048 columns a chunk (256 KB of sums at 32 rows, in L2): each chunk's first
// panels come cold, and 32 rows of SmolLM2's w8a8 lm_head took 1.78 ms a call in chunks of 256
// against 1.67. Measured in the engine (w8a8, 32 streams, rounds alternated with the logits and
// the sampler, 10 pairs, each faster): the step 22.02 -> 21.35 ms.
constexpr int64_t kArgmaxChunk = 2048;

template <typename F>
at::Tensor chunked_argmax(int64_t M, int64_t n, const at::TensorOptions& opts, const F& product) {
  const int64_t chunks = (n + kArgmaxChunk - 1) / kArgmaxChunk;
  at::Tensor out = at::empty({M}, opts.dtype(at::kLong));
  if (M == 0) return out;
  std::vector<float> best(chunks * M);  // [chunk][row]: the chunk's largest value and its column
  std::vector<int64_t> where(chunks * M);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    thread_local std::vector<float> buf;
    buf.resize(std::max<size_t>(buf.size(), M * kArgmaxChunk));
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t col = c * kArgmaxChunk, cols = std::min(kArgmaxChunk, n - col);
      product(col, cols, buf.data());
      for (int64_t i = 0; i < M; ++i) {
        const int64_t j = row_argmax(buf.data() + i * cols, cols);
        best[c * M + i] = buf[i * cols + j];
        where[c * M + i] = col + j;
      }
    }
  });
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < M; ++i) {  // chunk by chunk: a later chunk wins only when larger (the first index)
    int64_t c_best = 0;
    for (int64_t c = 1; c < chunks; ++c)
      if (best[c * M + i] > best[c_best * M + i]) c_best = c;
    op[i] = where[c_best * M + i];
  }
  return out;
}

at::Tensor linear_panels_i8_argmax(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& corr,
                                   const at::Tensor& scale, int64_t n, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2,
              "inferlab linear_panels_i8_argmax: x must be a float32 matrix, got ", x.scalar_type(), " ", x.sizes());
  const int64_t K = x.size(1);
  check_i8_panels("linear_panels_i8_argmax", K, panels, corr, scale, n);
  TORCH_CHECK(n > 0, "inferlab linear_panels_i8_argmax: no columns to take the argmax of");
  const float* bias_p = vector_or_null(bias, n, "linear_panels_i8_argmax", "bias");
  const at::Tensor x2 = x.contiguous();
  const int64_t M = x2.size(0);
  if (M == 0) return at::empty({0}, x.options().dtype(at::kLong));
  const auto [xq, sx] = quantize_x_i8(x2);
  const uint8_t* qp = xq.data_ptr<uint8_t>();
  const float* sp = sx.data_ptr<float>();
  const uint64_t epoch = next_x_epoch();  // these codes, for every chunk
  const int8_t* xs = tile_codes(qp, M, i8_groups(K) * kI8Group);
  const int8_t* wp = panels.data_ptr<int8_t>();
  const int32_t* cp = corr.data_ptr<int32_t>();
  const float* scp = scale.data_ptr<float>();
  return chunked_argmax(M, n, x.options(), [&](int64_t col, int64_t cols, float* buf) {
    panel_products_i8(qp, sp, M, K, wp, cp, col, cols, scp, bias_p, buf, cols, /*cold=*/true, epoch, xs);
  });
}

#if defined(__AVX512BF16__)
// The same for bf16 panels (linear_panels' float32 outputs).
at::Tensor linear_panels_argmax(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                                const std::optional<at::Tensor>& bias) {
  check_bf16_panels("linear_panels_argmax", x, panels, n);
  TORCH_CHECK(x.dim() == 2, "inferlab linear_panels_argmax: x must be a matrix, got ", x.sizes());
  TORCH_CHECK(n > 0, "inferlab linear_panels_argmax: no columns to take the argmax of");
  const int64_t M = x.size(0), K = x.size(1), kp = panel_k(K);
  const float* bias_p = vector_or_null(bias, n, "linear_panels_argmax", "bias");
  if (M == 0) return at::empty({0}, x.options().dtype(at::kLong));
  const at::Tensor xb = x_in_bf16(x, kp);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  const at::BFloat16* wp = panels.data_ptr<at::BFloat16>();
  return chunked_argmax(M, n, x.options(), [&](int64_t col, int64_t cols, float* buf) {
    panel_products_bf16(xp, kp, M, K, wp, col, cols, nullptr, bias_p, buf, cols, /*cold=*/true);
  });
}
#endif

// The same product from x already quantized (fused.cpp's add_rms_norm_q8_ / silu_mul_q8 hand
// their rows over as codes): the same codes give the same bits as linear_panels_i8 of the
// float32 rows they were made from.
// x's codes and scales for a product of k features (fused.cpp's *_q8 make them): xq uint8
// [M, i8_groups(k) * 64], sx float32 [M, i8_scale_groups(k)], both contiguous.
void check_i8_codes(const char* op, const at::Tensor& xq, const at::Tensor& sx, int64_t k) {
  const int64_t width = i8_groups(k) * kI8Group, ls = i8_scale_groups(k);
  TORCH_CHECK(k > 0 && xq.scalar_type() == at::kByte && xq.dim() == 2 && xq.is_contiguous() && xq.size(1) == width,
              "inferlab ", op, ": xq must be contiguous uint8 [M, ", width, "] (codes of ", k, " features), got ",
              xq.scalar_type(), " ", xq.sizes());
  TORCH_CHECK(sx.scalar_type() == at::kFloat && sx.is_contiguous() && sx.dim() == 2 && sx.size(0) == xq.size(0) &&
                  sx.size(1) == ls,
              "inferlab ", op, ": sx must be contiguous float32 [", xq.size(0), ", ", ls, "]");
}

at::Tensor linear_panels_i8_q(const at::Tensor& xq, const at::Tensor& sx, int64_t k, const at::Tensor& panels,
                              const at::Tensor& corr, const at::Tensor& scale, int64_t n,
                              const std::optional<at::Tensor>& bias) {
  check_i8_codes("linear_panels_i8_q", xq, sx, k);
  check_i8_panels("linear_panels_i8_q", k, panels, corr, scale, n);
  const float* bias_p = vector_or_null(bias, n, "linear_panels_i8_q", "bias");
  const int64_t M = xq.size(0);
  at::Tensor y = at::empty({M, n}, sx.options());
  if (M > 0) products_i8(xq.data_ptr<uint8_t>(), sx.data_ptr<float>(), M, k, panels, corr, scale, n, bias_p,
                         y.data_ptr<float>());
  return y;
}

// w8a8's the same from x's codes (as linear_panels_i8_q takes them).
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_panels_i8_q_rope_kv(
    const at::Tensor& xq, const at::Tensor& sx, int64_t k, const at::Tensor& panels, const at::Tensor& corr,
    const at::Tensor& scale, const std::optional<at::Tensor>& bias, const at::Tensor& positions, const at::Tensor& cos,
    const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale) {
  const char* op = "linear_panels_i8_q_rope_kv";
  const int64_t ls = i8_scale_groups(k), ldx = i8_groups(k) * kI8Group;
  const int64_t n = (num_heads + 2 * num_kv_heads) * head_dim;
  check_i8_codes(op, xq, sx, k);
  check_i8_panels(op, k, panels, corr, scale, n);
  check_rope_head_dim(op, head_dim);
  const float* bias_p = vector_or_null(bias, n, op, "bias");
  const inferlab_rope_kv::RopeKv a = inferlab_rope_kv::check_rope_kv(
      op, xq.size(0), positions, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads, head_dim, k_scale,
      v_scale, /*with_v=*/true);
  if (a.t == 0) return {a.q_t, a.k_t, a.v_t};
  const uint64_t epoch = next_x_epoch();  // these codes, for every call below
  const uint8_t* qp = xq.data_ptr<uint8_t>();
  const float* sp = sx.data_ptr<float>();
  const int8_t* wp = panels.data_ptr<int8_t>();
  const int32_t* cp = corr.data_ptr<int32_t>();
  const float* scp = scale.data_ptr<float>();
  const int8_t* xs = tile_codes(qp, a.t, ldx);
  products_rope_kv(a, k_cache, v_cache, (n + kPanel - 1) / kPanel, kPanelsPerTileI8, ldx, kPanel * ldx,
                   [&](int64_t m0, int64_t mm, int64_t c0, int64_t cols, float* buf) {
                     panel_products_i8(qp + m0 * ldx, sp + m0 * ls, mm, k, wp, cp, c0, cols, scp, bias_p, buf, cols,
                                       m0 == 0, epoch, codes_at(xs, m0, ldx));
                   });
  return {a.q_t, a.k_t, a.v_t};
}

#ifdef INFERLAB_AMX
// w8a8's SiLU(gate) * up as the down product's codes, from the gate/up panels' tiles: for the M
// rows of x's signed codes (xs, stride ldx, tile_codes; scales sx, stride ls) and the output
// groups [o0, o1) (each the kI8ScaleGroup columns of one of the down product's scales, the last
// what is left of `half`, a multiple of 64: up to 12 gate panels, their up panels `half`
// columns on), the products' float32 sums of one row tile (amx_tile_i8, as linear_panels_i8_q
// stores them), silu_mul_row, then quantize_row_u8 of each row's values of the group: the bits
// of silu_mul_q8(linear_panels_i8_q(...)), whose last scale covers as many.
void amx_silu_q8(const int8_t* xs, const float* sx, int64_t M, int64_t groups, const int8_t* w,
                 const float* scale, int64_t half, int64_t o0, int64_t o1, uint8_t* codes, float* scales,
                 int64_t ldc, int64_t lds) {
  thread_local std::vector<float> tail_sx;
  const int64_t ldx = groups * kI8Group, ls = i8_scale_groups(ldx), pb = kPanel * ldx;  // a panel's bytes
  const AmxRows<float> sr(sx, ls, M, tail_sx);
  const AmxScope tiles(M);
  amx_operands_written();
  constexpr int64_t kOut = kI8ScaleGroup;  // columns an output group
  alignas(64) float g[16][kOut], u[16][kOut], act[kOut];
  for (int64_t m = 0; m < M; m += 16) {
    const int valid = static_cast<int>(std::min<int64_t>(16, M - m));
    for (int64_t o = o0; o < o1; ++o) {
      const int64_t cols = std::min(kOut, half - o * kOut);
      for (int64_t q = 0; q < cols / kPanel; ++q) {
        const int64_t gp = o * kOut / kPanel + q, up = gp + half / kPanel;  // gate panel, its up panel
        amx_tile_i8(xs + m * ldx, ldx, sr.tile(m), ls, groups, w + gp * pb, valid, 16, scale + gp * kPanel,
                    nullptr, &g[0][q * kPanel], kOut);
        amx_tile_i8(xs + m * ldx, ldx, sr.tile(m), ls, groups, w + up * pb, valid, 16, scale + up * kPanel,
                    nullptr, &u[0][q * kPanel], kOut);
      }
      for (int i = 0; i < valid; ++i) {
        inferlab_rows::silu_mul_row(g[i], u[i], cols, act);
        quantize_row_u8(act, cols, codes + (m + i) * ldc + o * kOut, scales + (m + i) * lds + o);
      }
    }
  }
}

#endif

#ifndef INFERLAB_AMX
// Columns of SiLU(gate) * up a panel_silu_q8 group takes at a time: whole runs of quantize_row_u8's
// scales (the AVX2 variant's shared powers of two: its blocks of 256), so a group's codes are the
// bits of the whole row's.
constexpr int64_t kSiluOutGroup = kI8ScaleBlock > 0 ? kI8ScaleBlock : kI8ScaleGroup;

// The same as amx_silu_q8 on the panel variants: for the M (<= kPanelRowBlock) rows of x's codes
// (xq, stride ldx, scales sx; x_epoch: their quantization, next_x_epoch) and the output groups
// [o0, o1) of kSiluOutGroup columns, the group's gate columns and then its up columns by
// panel_products_i8 (each column tile streamed once across the row tiles) into buffers of this
// thread's (L2, ~100 KB at 64 rows), then silu_mul_row and quantize_row_u8 of each row's group.
// Why: the [M, 2I] float32 product went to memory and came back for silu_mul_q8 (a prefill of
// 2,048 tokens of SmolLM2: 25 MB a layer each way).
void panel_silu_q8(const uint8_t* xq, const float* sx, int64_t M, int64_t K, const int8_t* w, const int32_t* corr,
                   const float* scale, int64_t half, int64_t o0, int64_t o1, uint8_t* codes, float* scales,
                   int64_t ldc, int64_t lds, bool cold, uint64_t x_epoch) {
  constexpr int64_t kOut = kSiluOutGroup;
  thread_local std::vector<float> g, u, act;
  g.resize(M * kOut), u.resize(M * kOut), act.resize(kOut);
  for (int64_t o = o0; o < o1; ++o) {
    const int64_t c0 = o * kOut, cols = std::min(kOut, half - c0);
    panel_products_i8(xq, sx, M, K, w, corr, c0, cols, scale, nullptr, g.data(), kOut, cold, x_epoch);
    panel_products_i8(xq, sx, M, K, w, corr, half + c0, cols, scale, nullptr, u.data(), kOut, cold, x_epoch);
    for (int64_t i = 0; i < M; ++i) {
      inferlab_rows::silu_mul_row(g.data() + i * kOut, u.data() + i * kOut, cols, act.data());
      quantize_row_u8(act.data(), cols, codes + i * ldc + c0, scales + i * lds + c0 / kI8ScaleGroup);
    }
  }
}
#endif

// linear_panels_i8_silu_q(xq, sx, k, panels, corr, scale, n) -> (codes, scales): the down
// product's x from a w8a8 gate/up weight [gate; up] of n rows (n a multiple of 2 x 64), as
// silu_mul_q8 would make them of linear_panels_i8_q's output, without that [M, n] float32
// product written and read back.
std::tuple<at::Tensor, at::Tensor> linear_panels_i8_silu_q(const at::Tensor& xq, const at::Tensor& sx, int64_t k,
                                                           const at::Tensor& panels, const at::Tensor& corr,
                                                           const at::Tensor& scale, int64_t n) {
  const int64_t groups = i8_groups(k), ldx = groups * kI8Group, ls = i8_scale_groups(k);  // a row of codes' bytes
  check_i8_codes("linear_panels_i8_silu_q", xq, sx, k);
  check_i8_panels("linear_panels_i8_silu_q", k, panels, corr, scale, n);
  TORCH_CHECK(n % (2 * kI8Group) == 0, "inferlab linear_panels_i8_silu_q: n (", n, ") must be a multiple of ",
              2 * kI8Group);
  const int64_t M = xq.size(0), half = n / 2, out_groups = i8_scale_groups(half);
  at::Tensor codes = at::empty({M, half}, xq.options());
  at::Tensor scales = at::empty({M, out_groups}, sx.options());
  const uint8_t* qp = xq.data_ptr<uint8_t>();
  const float* sp = sx.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  float* op = scales.data_ptr<float>();
#ifdef INFERLAB_AMX
  const int8_t* xs = tile_codes(qp, M, ldx, /*any_rows=*/true);
  for_row_passes(M, out_groups, [&](int64_t m0, int64_t mm, int64_t o0, int64_t o1) {
    amx_silu_q8(xs + m0 * ldx, sp + m0 * ls, mm, groups, panels.data_ptr<int8_t>(),
                scale.data_ptr<float>(), half, o0, o1, cp + m0 * half, op + m0 * out_groups, half, out_groups);
  }, 1, ldx, 2 * kI8ScaleGroup * ldx);  // an output group: up to 12 gate and 12 up panels
#else
  const uint64_t epoch = next_x_epoch();  // these codes, for every call below
  for_row_passes(M, (half + kSiluOutGroup - 1) / kSiluOutGroup, [&](int64_t m0, int64_t mm, int64_t o0, int64_t o1) {
    panel_silu_q8(qp + m0 * ldx, sp + m0 * ls, mm, k, panels.data_ptr<int8_t>(), corr.data_ptr<int32_t>(),
                  scale.data_ptr<float>(), half, o0, o1, cp + m0 * half, op + m0 * out_groups, half, out_groups,
                  m0 == 0, epoch);
  }, 1, ldx, 2 * kSiluOutGroup * ldx);
#endif
  return {codes, scales};
}

at::Tensor linear_w8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                     const std::optional<at::Tensor>& bias, int64_t mkl_min_rows) {
  TORCH_CHECK(w.scalar_type() == at::kChar, "inferlab linear_w8: w must be int8, got ", w.scalar_type());
  return linear_impl(x, w, scale, bias, mkl_min_rows);
}

at::Tensor linear_w4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& dm,
                     const std::optional<at::Tensor>& bias, int64_t mkl_min_rows) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "inferlab linear_w4: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous(),
              "inferlab linear_w4: codes must be a contiguous uint8 [N, K / 2] matrix");
  const int64_t N = codes.size(0), K = codes.size(1) * 2;
  TORCH_CHECK(K % inferlab_q4::kQ4Group == 0, "inferlab linear_w4: K (", K, ") must be a multiple of 32");
  TORCH_CHECK(dm.scalar_type() == at::kHalf && dm.is_contiguous() && dm.numel() == N * (K / 16),
              "inferlab linear_w4: dm must be contiguous float16 [", N, ", ", K / 32, ", 2]");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "inferlab linear_w4: x must have ", K, " features");
  const float* bias_p = vector_or_null(bias, N, "linear_w4", "bias");
  at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  std::vector<int64_t> out_sizes(x.sizes().begin(), x.sizes().end());
  out_sizes.back() = N;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M > 0 && N > 0) {
    const uint8_t* cp = codes.data_ptr<uint8_t>();
    const uint16_t* dp = reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>());
    if (M >= mkl_min_rows) large_m_q4(x2, cp, dp, N, K, bias, y);
    else small_m_q4(x2.data_ptr<float>(), M, K, cp, dp, N, bias_p, y.data_ptr<float>());
  }
  return y.view(out_sizes);
}

// Rows `ids` of a matrix kept in panels (kernels/linear.py pack_panels: bf16 pairs;
// pack_panels_i8: int8 quads) as float32 [len(ids), k], exactly (bf16 and int8 widen exactly):
// a tied lm_head's embedding lookup. Why: done by torch indexing on the 4-d panels it took five
// operators, 0.15 ms of a ~11 ms one-row decode step and 0.3 ms at 32 rows (Zen 4).
std::vector<int64_t> w8a8_numerics() { return {kI8ScaleGroup, kI8QMax, kI8PanelXor, kI8ScaleBlock}; }

at::Tensor panel_rows(const at::Tensor& panels, const at::Tensor& ids, int64_t k,
                      const std::optional<at::Tensor>& scale) {
  const bool bf16 = panels.scalar_type() == at::kBFloat16, i8 = panels.scalar_type() == at::kChar;
  TORCH_CHECK(panels.dim() == 4 && panels.is_contiguous() && panels.size(2) == kPanel &&
                  ((bf16 && panels.size(3) == 2) || (i8 && panels.size(3) == 4)),
              "inferlab panel_rows: panels must be contiguous bf16 [P, K / 2, 16, 2] or int8 [P, K / 4, 16, 4], got ",
              panels.scalar_type(), " ", panels.sizes());
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "inferlab panel_rows: ids must be an int64 vector");
  const int64_t steps = panels.size(1), per = panels.size(3), padded = panels.size(0) * kPanel;
  // A scale per real row: the rows past them (the last panel's padding) are not rows.
  const int64_t rows = scale.has_value() ? scale->numel() : padded;
  TORCH_CHECK(rows <= padded && rows > padded - kPanel, "inferlab panel_rows: ", rows, " scales for panels of ",
              padded, " rows");
  const float* sp = vector_or_null(scale, rows, "panel_rows", "scale");
  TORCH_CHECK(k >= 0 && k <= steps * per, "inferlab panel_rows: k = ", k, " is more than the panels hold (",
              steps * per, ")");
  const at::Tensor idc = ids.contiguous();
  const int64_t* ip = idc.data_ptr<int64_t>();
  const int64_t n = idc.numel();
  at::Tensor out = at::empty({n, k}, panels.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  auto gather = [&](const auto* base, auto value) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = ip[i];
      TORCH_CHECK_INDEX(r >= 0 && r < rows, "inferlab panel_rows: row ", r, " is outside the ", rows, " rows");
      const auto* w = base + ((r / kPanel) * steps * kPanel + r % kPanel) * per;  // panel r / 16, its lane
      float* o = op + i * k;
      for (int64_t j = 0, c = 0; c < k; ++j)
        for (int64_t e = 0; e < per && c < k; ++e, ++c) o[c] = value(w[j * kPanel * per + e]);
      if (sp)  // as the per-call path's r * scale[ids]: one float32 product a value
        for (int64_t c = 0; c < k; ++c) o[c] *= sp[r];
    }
  };
  if (bf16) gather(panels.data_ptr<at::BFloat16>(), [](at::BFloat16 v) { return static_cast<float>(v); });
  else  // the AVX2 variant's panels hold w + 128: the sign bit flipped (kI8PanelXor)
    gather(panels.data_ptr<int8_t>(),
           [](int8_t v) { return static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(v) ^ kI8PanelXor)); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferlab, m) {
  m.def("panel_rows(Tensor panels, Tensor ids, int k, Tensor? scale=None) -> Tensor");
  m.def("linear_w16(Tensor x, Tensor w, Tensor? bias=None, int mkl_min_rows=128) -> Tensor");
  m.def("linear_w8(Tensor x, Tensor w, Tensor scale, Tensor? bias=None, int mkl_min_rows=128) -> Tensor");
  m.def("linear_w4(Tensor x, Tensor codes, Tensor dm, Tensor? bias=None, int mkl_min_rows=128) -> Tensor");
#if defined(__AVX512BF16__)
  m.def("linear_panels(Tensor x, Tensor panels, int n, Tensor? bias=None, bool out_bf16=False) -> Tensor");
  m.def("linear_panels_argmax(Tensor x, Tensor panels, int n, Tensor? bias=None) -> Tensor");
  m.def("linear_panels_rope_kv(Tensor x, Tensor panels, Tensor? bias, Tensor positions, Tensor cos, Tensor sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, int H, int kvH, int D, Tensor? k_scale=None, "
        "Tensor? v_scale=None) -> (Tensor, Tensor, Tensor)");
  m.def("linear_panels_silu(Tensor x, Tensor panels, int n) -> Tensor");
#endif
  m.def("linear_panels_i8_silu_q(Tensor xq, Tensor sx, int k, Tensor panels, Tensor corr, Tensor scale, int n) "
        "-> (Tensor, Tensor)");
  m.def("linear_panels_i8(Tensor x, Tensor panels, Tensor corr, Tensor scale, int n, Tensor? bias=None) -> Tensor");
  m.def("linear_panels_i8_argmax(Tensor x, Tensor panels, Tensor corr, Tensor scale, int n, Tensor? bias=None) "
        "-> Tensor");
  m.def("linear_panels_i8_q(Tensor xq, Tensor sx, int k, Tensor panels, Tensor corr, Tensor scale, int n, "
        "Tensor? bias=None) -> Tensor");
  m.def("linear_panels_i8_q_rope_kv(Tensor xq, Tensor sx, int k, Tensor panels, Tensor corr, Tensor scale, "
        "Tensor? bias, Tensor positions, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slots, int H, int kvH, int D, Tensor? k_scale=None, Tensor? v_scale=None) -> (Tensor, Tensor, Tensor)");
  m.def("w8a8_numerics", &w8a8_numerics);
}

TORCH_LIBRARY_IMPL(inferlab, CPU, m) {
  m.impl("panel_rows", &panel_rows);
  m.impl("linear_w16", &linear_w16);
  m.impl("linear_w8", &linear_w8);
  m.impl("linear_w4", &linear_w4);
#if defined(__AVX512BF16__)
  m.impl("linear_panels", &linear_panels);
  m.impl("linear_panels_argmax", &linear_panels_argmax);
  m.impl("linear_panels_rope_kv", &linear_panels_rope_kv);
  m.impl("linear_panels_silu", &linear_panels_silu);
#endif
  m.impl("linear_panels_i8_silu_q", &linear_panels_i8_silu_q);
  m.impl("linear_panels_i8", &linear_panels_i8);
  m.impl("linear_panels_i8_argmax", &linear_panels_i8_argmax);
  m.impl("linear_panels_i8_q", &linear_panels_i8_q);
  m.impl("linear_panels_i8_q_rope_kv", &linear_panels_i8_q_rope_kv);
}
