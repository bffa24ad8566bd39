// A whole decode step of the decoder stack in one call: every layer, one parallel region.
//
// Why: at one decode token a layer is ~9 operators (fused.cpp, linear.cpp, attention.cpp), each
// a dispatch from Python (~10-20 us) and a fork/join of the thread pool, and the small matrices
// (o-proj is 576 x 576) cannot amortise either: at batch 1 that overhead was ~5 ms of a ~19 ms
// step. Here the threads start once per step and meet at 5 barriers per layer (7 from 4 rows on,
// where the two norms are split by rows too); inside a phase they take their work in pieces
// (take_units, below), so a thread that loses its core to another process for a while simply
// does less of the phase.
//
// The phases of a layer, with what each fuses:
//   norm        h = rms_norm(x) * w (every thread for itself when M is tiny, else split by rows)
//   qkv         one task per run of whole heads: their D rows each of the qkv product, then bias,
//               (Qwen3's q/k norm,) RoPE, and K and V written into the paged cache by the thread
//               that made them
//   attention   one task per (sequence, partition of 512 positions, KV head), the paged decode
//               kernel of attention.h; a context of several partitions merged after
//   o           x += attn @ Wo^T: each task owns a range of columns of x, so the residual add is in place
//   norm        h = rms_norm(x) * w
//   gate/up     each task: the same range of columns of gate and up, then silu(gate) * up
//   down        x += act @ Wd^T
// and after the last layer the final norm. The arithmetic is the per-operator path's (the same
// micro-kernel from matvec.h, the same row helpers from rows.h, the same attention task), in the
// same order, so the two paths agree to float32 rounding.
//
// torch.classes.inferlab.DecoderStep(layer_tensors, final_norm, cos, sin, k_caches, v_caches,
//                                    [H, kvH, D, block_size(, int8_activations(, bf16_attention))],
//                                    eps, attn_scale)
//   int8_activations (default 0): int8 weights multiply x quantized per group by the integer
//     dot product (w8a8: codes in panels, matvec.h's panel_products_i8: by vpdpbusd on AVX-512,
//     vpmaddubsw on AVX2), else float32 products of the codes.
//   bf16_attention (default 0): attention over bfloat16 caches with q and P rounded to bf16, by
//     vdpbf16ps (attention.h decode_task_dot; the avx512 variant), else float32 arithmetic.
//   layer_tensors: 13 per layer, in order: input_norm, qkv_w, qkv_scale, qkv_bias, q_norm, k_norm,
//     o_w, o_scale, post_norm, gate_up_w, gate_up_scale, down_w, down_scale; an empty tensor
//     (numel 0) for one the model does not have. Weights: one dtype for all (float32, float16,
//     bfloat16, int8 with float32 per-row scales, or 4-bit: uint8 codes [N, K / 2] with float16
//     (d, m) pairs [N, K / 32, 2] as the "scale", q4.h's format and integer products; or bf16 in
//     panels, [N / 16, K / 2, 16, 2] (kernels/linear.py pack_panels, the AVX-512 BF16 variant,
//     head_dim and the intermediate size multiples of 16), multiplied by vdpbf16ps). Caches:
//     float32, float16, bfloat16 or int8 [kvH, slots, D]; int8 caches also need .set_kv_scales(k_scales,
//     v_scales) (one [kvH, slots] float32 tensor per layer each: models/kv_cache.py's format,
//     quantized per row on write, rows.h).
// .forward(x [M, hidden] float32 (the token embeddings; used as the residual stream and
//          overwritten), positions [M] int64, slots [M] int64, block_tables [M, max_blocks] int32,
//          context_lens [M] int32) -> [M, hidden], the final norm's output.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "attention.h"
#include "matvec.h"
#include "q4.h"
#include "rows.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <memory>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using namespace inferlab_matvec;  // row_products, kRowsW
using namespace inferlab_rows;    // rms_norm_row, rope_row, silu_mul_row, store_kv_row

// Tasks per thread in a phase of column chunks: few, so that each task streams one long run of
// weight rows (the prefetch restarts at every task), but more than one, so that a thread that
// loses its core for a while leaves work for the others to take. (At batch 1, 1 to 16 tasks per
// thread measured within 5% of each other; fixed 16-column tasks took 10.7 ms against 9.6.)
constexpr int64_t kTasksPerThread = 2;
constexpr int64_t kColAlign = 16;  // task widths are multiples of 16 columns: whole 64-byte lines of x
constexpr int64_t kTensorsPerLayer = 13;
constexpr int64_t kSharedNormRows = 4;  // from this many rows on, a norm is split (and ends in a barrier)
constexpr int64_t kAheadBytes = 16384;   // a coming phase's weights fetched per thread (prefetch_run)
constexpr int64_t kTaskAhead = 16;       // positions of the next attention task fetched during this one

// A product phase's units of work (16 or 48 output columns, or whole heads), shared out.
// Up to kPanelRowsX rows (one row tile: a decode step of a few streams, bound by the weight
// stream), each thread streams one contiguous run of weights and the threads end the phase
// together: thread t owns the units [t * n / nt, (t + 1) * n / nt) and takes them from the front,
// at most `cap` (a task's width) and half of what it has left at a time; a thread with none left
// takes one unit at a time from the back of the run with the most left. Why: with a fixed set of
// tasks taken first come, first served (OpenMP's dynamic schedule), the thread that ends first
// waits at the barrier for up to a whole task: at batch 1 on a Zen 4 the two threads waited 0.5
// and 1.2 ms of an ~11 ms step (with matvec.h's panel_rows_bf16, the step 10.6 -> 10.1 ms with
// these runs, 20 alternated rounds in one process; at 4 rows even). From more rows on, the
// tasks stay whole and in one queue, taken first come, first served: there a product's later
// column tiles are fetched while its earlier ones run (matvec.h NextTile), which smaller pieces
// cut short (the step at 32 rows measured 2-12% slower with per-thread runs). Either way a thread
// that loses its core for a while leaves the rest of its work to the others.
struct alignas(64) Run {
  std::atomic<uint64_t> v{0};  // the units not yet taken: first in the high half, end in the low
};

inline uint64_t pack_run(int64_t lo, int64_t hi) { return static_cast<uint64_t>(lo) << 32 | static_cast<uint64_t>(hi); }

// Before the parallel region: n units, one run per thread (`split`), else all in the first.
inline void share_out(Run* runs, int64_t nt, int64_t n, bool split) {
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t lo = split ? t * n / nt : 0, hi = split ? (t + 1) * n / nt : t == 0 ? n : 0;
    runs[t].v.store(pack_run(lo, hi), std::memory_order_relaxed);
  }
}

// Thread t's next units [u0, u1): `split`, as described above, else a whole task of `cap` units
// (the last may be shorter). False once every run is empty. Relaxed: what a unit's work reads
// and writes is ordered by the barriers between phases, not by the claims.
inline bool take_units(Run* runs, int64_t nt, int64_t t, int64_t cap, bool split, int64_t& u0, int64_t& u1) {
  uint64_t v = runs[t].v.load(std::memory_order_relaxed);
  for (;;) {
    const int64_t lo = static_cast<int64_t>(v >> 32), hi = static_cast<int64_t>(v & 0xffffffffu);
    if (lo >= hi) break;
    const int64_t n = split ? std::min(cap, (hi - lo + 1) / 2) : std::min(cap, hi - lo);
    if (runs[t].v.compare_exchange_weak(v, pack_run(lo + n, hi), std::memory_order_relaxed)) {
      u0 = lo, u1 = lo + n;
      return true;
    }
  }
  for (;;) {  // from the back of the run with the most left
    int64_t victim = -1, most = 0;
    for (int64_t o = 0; o < nt; ++o) {
      const uint64_t w = runs[o].v.load(std::memory_order_relaxed);
      const int64_t left = static_cast<int64_t>(w & 0xffffffffu) - static_cast<int64_t>(w >> 32);
      if (left > most) most = left, victim = o, v = w;
    }
    if (victim < 0) return false;
    const int64_t lo = static_cast<int64_t>(v >> 32), hi = static_cast<int64_t>(v & 0xffffffffu);
    const int64_t n = split ? 1 : std::min(cap, hi - lo);  // else a whole task, cap-aligned from the end
    if (runs[victim].v.compare_exchange_weak(v, pack_run(lo, hi - n), std::memory_order_relaxed)) {
      u0 = hi - n, u1 = hi;
      return true;
    }
  }
}

struct Linear {
  at::Tensor w, scale_t, bias_t;          // scale / bias undefined when absent
  at::Tensor panels;                      // bf16 weights packed in panels (matvec.h), where the step uses them
  at::Tensor i8_panels, corr_t;           // w8a8 codes in panels and their group corrections (panel_products_i8)
  const int32_t* corr = nullptr;
  const float* scale = nullptr;
  const float* bias = nullptr;
  const uint16_t* dm = nullptr;   // 4-bit weights' float16 (d, m) pairs (w is then uint8 codes)
  int64_t n = 0, k = 0;
};

struct Layer {
  at::Tensor input_norm, post_norm, q_norm, k_norm;  // q/k norm undefined unless the model has them
  Linear qkv, o, gate_up, down;
};

// The phases of a layer, for `phase_seconds` (each one's time runs from its start to the next's,
// as the first thread sees it: its own work plus the wait at the barrier that ends the phase).
enum Phase { kQkv, kAttention, kO, kNorm, kGateUp, kDown, kFinalNorm, kPhases };

// Adds the time since the last mark to the phase that was running; nothing when `acc` is null.
struct PhaseClock {
  double* acc;
  double last = 0.0;
  int phase = kPhases;
  explicit PhaseClock(double* a) : acc(a), last(a ? omp_get_wtime() : 0.0) {}
  void mark(int next) {
    if (!acc) return;
    const double now = omp_get_wtime();
    if (phase < kPhases) acc[phase] += now - last;
    last = now;
    phase = next;
  }
};

// Per-thread buffers, grown once (OpenMP's threads are torch's pool threads and live on).
struct Work {
  std::vector<float> buf;    // kRowsW * K: a weight block converted to float32 (M > 3)
  std::vector<float> dots;   // M * kRowsW: one block's products
  std::vector<float> head;   // M * D: one head of the qkv product
  std::vector<float> rot;    // D: a rotated K row on its way into the cache
  std::vector<float> h;      // M * hidden: a tiny batch's norm, computed by every thread
  std::vector<float> cols;   // M * task width: one task's columns of a product
  std::vector<float> cols2;  // M * task width: the up half of gate/up
  inferlab_attention::Scratch attn;
  inferlab_q4::Q4X q4x;      // x quantized for 4-bit weights
  // x rounded to bf16 for bf16 panels (xb), or quantized per group for w8a8 panels (xq, sx),
  // once per phase and thread: a phase's tasks (15 heads of qkv, gate and up) all multiply the
  // same x, and converting it per task cost ~2 ms of a 32-row step. `phase` counts the phases
  // this thread entered; xb / xq hold `x_src` as of `x_phase`.
  std::vector<uint16_t> xb;
  std::vector<uint8_t> xq;
  std::vector<float> sx;
  uint64_t xq_epoch = 0;  // next_x_epoch() of xq's codes (panel_products_i8 prepares them once)
  const float* x_src = nullptr;
  int64_t x_phase = -1, phase = 0;
};

// w8a8 from kSharedNormRows rows on: a product phase's x quantized (and on AVX2 tiled) once, by
// every thread a share of its row tiles, rather than whole by each thread for itself. Why: at 32
// rows each thread spent ~9 us a phase (24 at the down product's 1,536 values a row) making the
// same copy, 6-11% of the qkv, o and down phases. The norms before qkv and gate/up make it as they
// go (their barrier was there already); o and down gain one. In-process A/B, the default model's
// w8a8 decode at 32 streams, Zen 3, 8 alternated rounds: the step 48.77 -> 48.03 ms (qkv 4.98 ->
// 4.77, gate/up 12.93 -> 12.24, down 7.21 -> 6.95, the norm 0.24 -> 0.40). Grown once (forward
// runs one step at a time).
struct SharedX {
  std::vector<uint8_t> xq;  // quantize_row_u8's codes, rows of the largest K's stride
  std::vector<float> sx;    // and scales
  TiledX tiles;             // interleave_x_i8's (the AVX2 and amx variants'; empty on avx512)
};

at::Tensor present(const at::Tensor& t) { return t.numel() > 0 ? t : at::Tensor(); }

class DecoderStep : public torch::CustomClassHolder {
 public:
  DecoderStep(std::vector<at::Tensor> layer_tensors, at::Tensor final_norm, at::Tensor cos, at::Tensor sin,
              std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches, std::vector<int64_t> dims,
              double eps, double attn_scale)
      : final_norm_(final_norm), cos_(cos), sin_(sin), k_caches_(k_caches), v_caches_(v_caches),
        eps_(static_cast<float>(eps)), attn_scale_(static_cast<float>(attn_scale)) {
    TORCH_CHECK_VALUE(dims.size() >= 4 && dims.size() <= 6,
                      "DecoderStep: dims must be [num_heads, num_kv_heads, head_dim, block_size(, int8_activations"
                      "(, bf16_attention))]");
    heads_ = dims[0], kv_heads_ = dims[1], head_dim_ = dims[2], block_size_ = dims[3];
    const bool int8_x = dims.size() >= 5 && dims[4] != 0;
    bf16_dot_ = dims.size() == 6 && dims[5] != 0;
    TORCH_CHECK_VALUE(heads_ >= 1 && kv_heads_ >= 1 && heads_ % kv_heads_ == 0, "DecoderStep: ", heads_,
                      " query heads are not a multiple of ", kv_heads_, " KV heads");
    TORCH_CHECK_VALUE(head_dim_ >= 2 && head_dim_ % kRowsW == 0, "DecoderStep: head_dim ", head_dim_,
                      " must be a positive multiple of ", kRowsW);
    TORCH_CHECK_VALUE(block_size_ >= 1, "DecoderStep: block_size must be positive");
    TORCH_CHECK_VALUE(layer_tensors.size() % kTensorsPerLayer == 0 && !layer_tensors.empty(),
                      "DecoderStep: layer_tensors must hold ", kTensorsPerLayer, " tensors per layer");
    const int64_t num_layers = static_cast<int64_t>(layer_tensors.size()) / kTensorsPerLayer;
    TORCH_CHECK_VALUE(static_cast<int64_t>(k_caches.size()) == num_layers &&
                          static_cast<int64_t>(v_caches.size()) == num_layers,
                      "DecoderStep: one K and one V cache per layer");
    check_f32(final_norm_, "final_norm");
    hidden_ = final_norm_.numel();
    check_f32(cos_, "cos");
    check_f32(sin_, "sin");
    TORCH_CHECK_VALUE(cos_.dim() == 2 && cos_.size(1) == head_dim_ && sin_.sizes() == cos_.sizes(),
                      "DecoderStep: cos/sin must be [positions, head_dim]");
    const int64_t qkv_rows = (heads_ + 2 * kv_heads_) * head_dim_;
    weight_dtype_ = layer_tensors[1].scalar_type();  // every layer's every linear must match these
    cache_dtype_ = k_caches_[0].scalar_type();
    TORCH_CHECK_VALUE(!bf16_dot_ || inferlab_attention::can_dot(cache_dtype_), "DecoderStep: bf16_attention needs ",
                      "bfloat16 caches and the kernels' avx512 variant (AVX512_BF16); here ", cache_dtype_, " caches");
    for (int64_t l = 0; l < num_layers; ++l) {
      const at::Tensor* t = layer_tensors.data() + l * kTensorsPerLayer;
      Layer ly;
      ly.input_norm = t[0];
      ly.qkv = linear(t[1], t[2], t[3], qkv_rows, hidden_, "qkv", int8_x);
      ly.q_norm = present(t[4]);
      ly.k_norm = present(t[5]);
      ly.o = linear(t[6], t[7], at::Tensor(), hidden_, heads_ * head_dim_, "o", int8_x);
      ly.post_norm = t[8];
      // 2 x the intermediate size: gate_up's rows, or for panels 16 x its panels (a size not of
      // 16, whose last panel is partly padding, is refused below).
      const int64_t two_i = t[9].dim() == 2 ? t[9].size(0) : t[9].dim() == 4 ? kPanel * t[9].size(0) : 0;
      TORCH_CHECK_VALUE(two_i > 0 && two_i % 2 == 0, "DecoderStep: gate_up must have an even number of rows");
      ly.gate_up = linear(t[9], t[10], at::Tensor(), two_i, hidden_, "gate_up", int8_x);
      ly.down = linear(t[11], t[12], at::Tensor(), hidden_, two_i / 2, "down", int8_x);
      for (const Linear* lin : {&ly.qkv, &ly.o, &ly.gate_up, &ly.down})
        TORCH_CHECK_VALUE((!lin->panels.defined() && !lin->i8_panels.defined()) || panel_layout(two_i / 2),
                          "DecoderStep: weights in panels need head_dim and the intermediate size to be multiples "
                          "of ", kPanel);
      check_f32(ly.input_norm, "input_norm");
      check_f32(ly.post_norm, "post_norm");
      TORCH_CHECK_VALUE(ly.input_norm.numel() == hidden_ && ly.post_norm.numel() == hidden_,
                        "DecoderStep: norm weights must have ", hidden_, " elements");
      for (const at::Tensor* qk : {&ly.q_norm, &ly.k_norm}) {
        if (!qk->defined()) continue;
        check_f32(*qk, "q_norm / k_norm");
        TORCH_CHECK_VALUE(qk->numel() == head_dim_, "DecoderStep: q/k norm weights must have head_dim elements");
      }
      TORCH_CHECK_VALUE(ly.q_norm.defined() == ly.k_norm.defined(), "DecoderStep: q_norm and k_norm come together");
      TORCH_CHECK_VALUE(ly.qkv.w.scalar_type() == weight_dtype_ && ly.o.w.scalar_type() == weight_dtype_ &&
                            ly.gate_up.w.scalar_type() == weight_dtype_ && ly.down.w.scalar_type() == weight_dtype_,
                        "DecoderStep: every linear weight must have the same dtype");
      const at::Tensor& kc = k_caches_[l];
      const at::Tensor& vc = v_caches_[l];
      TORCH_CHECK_VALUE((kc.scalar_type() == at::kFloat || kc.scalar_type() == at::kHalf ||
                         kc.scalar_type() == at::kBFloat16 || kc.scalar_type() == at::kChar) &&
                            vc.scalar_type() == kc.scalar_type() && kc.scalar_type() == cache_dtype_ &&
                            kc.is_contiguous() && vc.is_contiguous() && kc.device().is_cpu() && vc.device().is_cpu(),
                        "DecoderStep: caches must be contiguous float32, float16, bfloat16 or int8 CPU tensors, all of one dtype");
      TORCH_CHECK_VALUE(kc.dim() == 3 && kc.size(0) == kv_heads_ && kc.size(2) == head_dim_ &&
                            vc.sizes() == kc.sizes() && kc.size(1) % block_size_ == 0,
                        "DecoderStep: caches must be [kvH, slots, D] with slots a multiple of block_size");
      layers_.push_back(std::move(ly));
    }
  }

  at::Tensor forward(at::Tensor x, at::Tensor positions, at::Tensor slots, at::Tensor block_tables,
                     at::Tensor context_lens) {
    check_f32(x, "x");
    TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == hidden_ && x.size(0) >= 1, "DecoderStep: x must be [M, ",
                      hidden_, "] with M >= 1, got ", x.sizes());
    const int64_t m = x.size(0);
    TORCH_CHECK_VALUE(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == m,
                      "DecoderStep: positions must be a contiguous [M] int64 tensor");
    TORCH_CHECK_VALUE(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == m,
                      "DecoderStep: slots must be a contiguous [M] int64 tensor");
    TORCH_CHECK_VALUE(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                          block_tables.dim() == 2 && block_tables.size(0) == m,
                      "DecoderStep: block_tables must be a contiguous [M, max_blocks] int32 tensor");
    TORCH_CHECK_VALUE(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous() &&
                          context_lens.numel() == m,
                      "DecoderStep: context_lens must be a contiguous [M] int32 tensor");
    const int64_t num_slots = k_caches_[0].size(1);
    const int64_t* pp = positions.data_ptr<int64_t>();
    const int64_t* sp = slots.data_ptr<int64_t>();
    for (int64_t i = 0; i < m; ++i) {
      TORCH_CHECK_VALUE(pp[i] >= 0 && pp[i] < cos_.size(0), "DecoderStep: position ", pp[i],
                        " outside the rope table (", cos_.size(0), ")");
      TORCH_CHECK_VALUE(sp[i] >= 0 && sp[i] < num_slots, "DecoderStep: slot ", sp[i], " outside the cache (",
                        num_slots, ")");
    }
    inferlab_attention::check_tables<int32_t>(block_tables, context_lens, block_size_, num_slots, "DecoderStep");
    TORCH_CHECK_VALUE(cache_dtype_ != at::kChar || !k_scales_.empty(),
                      "DecoderStep: an int8 K/V cache needs its scales (set_kv_scales) before forward");
    at::Tensor out = at::empty_like(x);
    switch (weight_dtype_) {
      case at::kFloat: run_cache<float>(x, positions, slots, block_tables, context_lens, out); break;
      case at::kHalf: run_cache<at::Half>(x, positions, slots, block_tables, context_lens, out); break;
      case at::kBFloat16: run_cache<at::BFloat16>(x, positions, slots, block_tables, context_lens, out); break;
      case at::kChar: run_cache<int8_t>(x, positions, slots, block_tables, context_lens, out); break;
      case at::kByte: run_cache<uint8_t>(x, positions, slots, block_tables, context_lens, out); break;
      default: TORCH_CHECK_VALUE(false, "DecoderStep: unsupported weight dtype ", weight_dtype_);
    }
    return out;
  }

  // An int8 cache's scales, one [kvH, slots] float32 tensor per layer for K and for V (held, not copied).
  void set_kv_scales(std::vector<at::Tensor> k_scales, std::vector<at::Tensor> v_scales) {
    TORCH_CHECK_VALUE(cache_dtype_ == at::kChar, "DecoderStep: only an int8 K/V cache has scales");
    TORCH_CHECK_VALUE(k_scales.size() == k_caches_.size() && v_scales.size() == k_caches_.size(),
                      "DecoderStep: one K and one V scale tensor per layer");
    for (size_t l = 0; l < k_scales.size(); ++l)
      for (const at::Tensor& t : {k_scales[l], v_scales[l]})
        TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu() &&
                              t.dim() == 2 && t.size(0) == kv_heads_ && t.size(1) == k_caches_[l].size(1),
                          "DecoderStep: scales must be contiguous float32 [kvH, slots] CPU tensors");
    k_scales_ = std::move(k_scales);
    v_scales_ = std::move(v_scales);
  }

  // Per-phase seconds summed over the steps run since profiling was turned on (benchmarks/
  // profile_step.py): [qkv (with the norm before it, RoPE, KV write), attention, o (+ residual),
  // post-attention norm, gate/up (+ SiLU), down (+ residual), final norm].
  void set_profiling(bool on) {
    profiling_ = on;
    phase_seconds_.fill(0.0);
  }
  std::vector<double> phase_seconds() const { return {phase_seconds_.begin(), phase_seconds_.end()}; }

 private:
  static void check_f32(const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.defined() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(),
                      "DecoderStep: ", name, " must be a contiguous float32 CPU tensor");
  }

  // int8_x: int8 weights multiply x quantized per group, integer products (weight_dtype w8a8).
  static Linear linear(const at::Tensor& w, const at::Tensor& scale, const at::Tensor& bias, int64_t n, int64_t k,
                       const char* name, bool int8_x) {
    const auto dt = w.scalar_type();
    if (dt == at::kByte) return linear_q4(w, scale, bias, n, k, name);
    if (w.dim() == 4 && dt == at::kChar) return linear_panels_i8(w, scale, bias, n, k, name, int8_x);
    if (w.dim() == 4) return linear_panels(w, bias, n, k, name);
    TORCH_CHECK_VALUE(w.dim() == 2 && w.is_contiguous() && w.size(0) == n && w.size(1) == k, "DecoderStep: ",
                      name, " weight must be a contiguous [", n, ", ", k, "] matrix, got ", w.sizes());
    TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16 || dt == at::kChar,
                      "DecoderStep: ", name, " weight dtype ", dt, " is not float32, float16, bfloat16 or int8");
    Linear lin;
    lin.w = w;
    lin.n = n;
    lin.k = k;
    lin.scale_t = present(scale);
    lin.bias_t = present(bias);
    TORCH_CHECK_VALUE((dt == at::kChar) == lin.scale_t.defined(), "DecoderStep: ", name,
                      " needs per-row scales exactly when its weight is int8");
    for (at::Tensor* v : {&lin.scale_t, &lin.bias_t}) {
      if (!v->defined()) continue;
      check_f32(*v, name);
      TORCH_CHECK_VALUE(v->numel() == n, "DecoderStep: ", name, " scale/bias must have ", n, " elements");
    }
    lin.scale = lin.scale_t.defined() ? lin.scale_t.data_ptr<float>() : nullptr;
    lin.bias = lin.bias_t.defined() ? lin.bias_t.data_ptr<float>() : nullptr;
    TORCH_CHECK_VALUE(dt != at::kChar || !int8_x, "DecoderStep: ", name, " w8a8 codes come in panels "
                      "(kernels/linear.py pack_panels_i8), not as an [n, k] matrix");
    return lin;
  }

  // Whether weights in panels can go through panel_products_bf16 / _i8: every task's first
  // column is a panel's (heads of D columns, gate and up halves of `inter` each, column ranges
  // of 16). bf16 panels come only where the variant has vdpbf16ps (kernels/linear.py packs them).
  bool panel_layout(int64_t inter) const { return head_dim_ % kPanel == 0 && inter % kPanel == 0; }

  // A float32 bias of n values, or none (an empty tensor): checked and held by lin.
  static void set_bias(Linear& lin, const at::Tensor& bias, int64_t n, const char* name) {
    lin.bias_t = present(bias);
    if (!lin.bias_t.defined()) return;
    check_f32(lin.bias_t, name);
    TORCH_CHECK_VALUE(lin.bias_t.numel() == n, "DecoderStep: ", name, " bias must have ", n, " elements");
    lin.bias = lin.bias_t.data_ptr<float>();
  }

  // bf16 weights already in panels (kernels/linear.py pack_panels of [n, k]), bias float32 or absent.
  static Linear linear_panels(const at::Tensor& w, const at::Tensor& bias, int64_t n, int64_t k, const char* name) {
    const int64_t panels = (n + kPanel - 1) / kPanel;
    TORCH_CHECK_VALUE(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.size(0) == panels &&
                          w.size(1) == (k + 1) / 2 && w.size(2) == kPanel && w.size(3) == 2,
                      "DecoderStep: ", name, " panels must be contiguous bf16 [", panels, ", ", (k + 1) / 2, ", ",
                      kPanel, ", 2], got ", w.sizes());
    Linear lin;
    lin.w = w, lin.panels = w, lin.n = n, lin.k = k;
    set_bias(lin, bias, n, name);
    return lin;
  }

  // w8a8 codes in panels (kernels/linear.py pack_panels_i8 of [n, k]), per-column float32 scales,
  // bias float32 or absent; the group corrections (AVX-512) computed here, once.
  static Linear linear_panels_i8(const at::Tensor& w, const at::Tensor& scale, const at::Tensor& bias, int64_t n,
                                 int64_t k, const char* name, bool int8_x) {
    TORCH_CHECK_VALUE(int8_x, "DecoderStep: ", name, " int8 codes in panels are w8a8's (int8_activations)");
    const int64_t panels = (n + kPanel - 1) / kPanel, quads = i8_groups(k) * kI8Group / 4;
    TORCH_CHECK_VALUE(w.is_contiguous() && w.size(0) == panels && w.size(1) == quads && w.size(2) == kPanel &&
                          w.size(3) == 4,
                      "DecoderStep: ", name, " int8 panels must be contiguous [", panels, ", ", quads, ", ", kPanel,
                      ", 4], got ", w.sizes());
    Linear lin;
    lin.w = w, lin.i8_panels = w, lin.n = n, lin.k = k;
    lin.scale_t = present(scale);
    TORCH_CHECK_VALUE(lin.scale_t.defined() && lin.scale_t.scalar_type() == at::kFloat &&
                          lin.scale_t.is_contiguous() && lin.scale_t.numel() == n,
                      "DecoderStep: ", name, " int8 panels need float32 scales of ", n, " columns");
    lin.scale = lin.scale_t.data_ptr<float>();
    set_bias(lin, bias, n, name);
    // kernels/linear.py panel_corrections_i8: -128 x each column's code sums per group (the
    // AVX-512 variant's; the AVX2 one reads none)
    if constexpr (kI8ColumnSums) {
      lin.corr_t = w.view({panels, quads * 4 / kI8Group, kI8Group / 4, kPanel, 4})
                       .sum({2, 4}, false, at::kInt).mul_(-128).contiguous();
      lin.corr = lin.corr_t.data_ptr<int32_t>();
    }
    return lin;
  }

  // A 4-bit linear: codes [n, k / 2], (d, m) pairs float16 [n, k / 32, 2], bias float32 or absent.
  static Linear linear_q4(const at::Tensor& w, const at::Tensor& dm, const at::Tensor& bias, int64_t n, int64_t k,
                          const char* name) {
    TORCH_CHECK_VALUE(k % inferlab_q4::kQ4Group == 0 && w.dim() == 2 && w.is_contiguous() && w.size(0) == n &&
                          w.size(1) * 2 == k,
                      "DecoderStep: ", name, " 4-bit codes must be a contiguous [", n, ", ", k / 2, "] matrix");
    TORCH_CHECK_VALUE(dm.scalar_type() == at::kHalf && dm.is_contiguous() && dm.numel() == n * (k / 16),
                      "DecoderStep: ", name, " 4-bit weights need float16 (d, m) pairs [", n, ", ", k / 32, ", 2]");
    Linear lin;
    lin.w = w, lin.n = n, lin.k = k, lin.scale_t = dm;
    set_bias(lin, bias, n, name);
    lin.dm = reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>());
    return lin;
  }

  // h = rms_norm(x) * w for every row. A tiny batch: each thread computes it into its own buffer
  // (cheaper than a barrier); otherwise split by rows into `shared`, ending in a barrier.
  const float* norm_rows(const float* x, const at::Tensor& w, int64_t m, float* shared, Work& wk) const {
    const float* wp = w.data_ptr<float>();
    if (m < kSharedNormRows) {
      for (int64_t i = 0; i < m; ++i) rms_norm_row(x + i * hidden_, wp, hidden_, eps_, wk.h.data() + i * hidden_);
      return wk.h.data();
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < m; ++i) rms_norm_row(x + i * hidden_, wp, hidden_, eps_, shared + i * hidden_);
    return shared;
  }

  // Rows r0 .. r0 + rows of lin's product for every row of `in` (M x lin.k): y[i * ldy + r].
  // after_r / after_n: where this thread's next product in lin likely starts (-1: none), and how
  // many rows of it: bf16 panels fetch its first column tile while their last one runs (matvec.h
  // panel_products_bf16 `after`). At 32 rows on a Zen 4 the decode step 41.68 -> 39.22 ms (qkv,
  // o, gate/up and down each 3-7% faster; in-process A/B, 12 rounds; two more sets of 10 and 14
  // rounds 43.80 -> 41.47 and 43.68 -> 42.51). Guessing the preceding task for the threads that
  // take from the back of a queue (take_units) measured no better.
  // shx: x made already for every thread (make_shared_x), where the phase has one.
  template <typename T>
  void products(const float* in, int64_t m, const Linear& lin, int64_t r0, int64_t rows, float* y, int64_t ldy,
                Work& wk, int64_t after_r = -1, int64_t after_n = 0, const SharedX* shx = nullptr) const {
    if constexpr (std::is_same_v<T, uint8_t>) {  // 4-bit codes: x quantized per call (q4.h)
      inferlab_q4::quantize_x(in, m, lin.k, wk.q4x);
      inferlab_q4::row_products_q4(wk.q4x, lin.w.data_ptr<uint8_t>(), lin.dm, r0, rows, lin.bias, y, ldy);
    } else {
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (lin.panels.defined()) {
          const int64_t kp = panel_k(lin.k);
          if (wk.x_src != in || wk.x_phase != wk.phase) {
            wk.xb.resize(std::max<size_t>(wk.xb.size(), m * kp));
            x_to_bf16_rows(in, m, lin.k, wk.xb.data());
            wk.x_src = in, wk.x_phase = wk.phase;
          }
          const bool aft = after_r >= 0 && after_r < lin.n;
          panel_products_bf16(wk.xb.data(), kp, m, lin.k, lin.panels.data_ptr<at::BFloat16>(), r0, rows, lin.scale,
                              lin.bias, y, ldy, /*cold=*/true,  // a step reads every weight once
                              aft ? lin.panels.data_ptr<at::BFloat16>() + after_r * kp : nullptr,
                              aft ? std::min(after_n, lin.n - after_r) : 0);
          return;
        }
      }
#endif
      if constexpr (std::is_same_v<T, int8_t>) {
        if (lin.i8_panels.defined() && shx) {
          const int8_t* panels = lin.i8_panels.data_ptr<int8_t>();
          // the next task's first panel, fetched during this one's last (as bf16 panels' `after`):
          // at 32 rows each product phase 0.97-0.99x (8 alternated rounds, the step's products 0.985x)
          const bool aft = after_r >= 0 && after_r < lin.n;
          const int8_t* after = aft ? panels + after_r * i8_groups(lin.k) * kI8Group : nullptr;
          panel_products_i8_tiled(shx->xq.data(), shx->sx.data(), shx->tiles, m, lin.k, panels, lin.corr, r0, rows,
                                  lin.scale, lin.bias, y, ldy, after);
          return;
        }
        if (lin.i8_panels.defined()) {
          const int64_t groups = i8_groups(lin.k);
          if (wk.x_src != in || wk.x_phase != wk.phase) {
            wk.xq.resize(std::max<size_t>(wk.xq.size(), m * groups * kI8Group));
            wk.sx.resize(std::max<size_t>(wk.sx.size(), m * i8_scale_groups(lin.k)));
            quantize_rows_u8(in, m, lin.k, wk.xq.data(), wk.sx.data());
            wk.x_src = in, wk.x_phase = wk.phase, wk.xq_epoch = next_x_epoch();
          }
          panel_products_i8(wk.xq.data(), wk.sx.data(), m, lin.k, lin.i8_panels.data_ptr<int8_t>(), lin.corr, r0, rows,
                            lin.scale, lin.bias, y, ldy, /*cold=*/true, wk.xq_epoch);
          return;
        }
      }
      row_products(in, m, lin.k, lin.w.data_ptr<T>(), r0, rows, lin.scale, lin.bias, wk.buf.data(), wk.dots.data(),
                   y, ldy);
    }
  }

  // x[:, n0 .. n0 + nn] += in @ W^T for those columns (o and down: the residual add).
  template <typename T>
  void add_product(const float* in, int64_t m, const Linear& lin, int64_t n0, int64_t nn, float* x,
                   Work& wk, int64_t after_r = -1, int64_t after_n = 0, const SharedX* shx = nullptr) const {
    products<T>(in, m, lin, n0, nn, wk.cols.data(), nn, wk, after_r, after_n, shx);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < nn; ++j) x[i * hidden_ + n0 + j] += wk.cols[i * nn + j];
  }

  // shared_x_ made from the m rows of `in` (k values each), each thread whole row tiles, ending
  // in a barrier; with norm_w, the rows are rms_norm(in) * norm_w first (written to hbuf too: k is
  // then the hidden size).
  const SharedX* make_shared_x(const float* in, int64_t m, int64_t k, const float* norm_w, float* hbuf) const {
    const int64_t ldx = i8_groups(k) * kI8Group, ls = i8_scale_groups(k);
    uint8_t* xq = shared_x_.xq.data();
    float* sx = shared_x_.sx.data();
#pragma omp for schedule(static)
    for (int64_t t = 0; t < (m + kPanelRowsXI8 - 1) / kPanelRowsXI8; ++t) {
      for (int64_t i = t * kPanelRowsXI8; i < std::min(m, (t + 1) * kPanelRowsXI8); ++i) {
        const float* row = in + i * k;
        if (norm_w) {
          rms_norm_row(row, norm_w, k, eps_, hbuf + i * k);
          row = hbuf + i * k;
        }
        quantize_row_u8(row, k, xq + i * ldx, sx + i * ls);
      }
      interleave_x_i8(xq, sx, m, ldx, shared_x_.tiles, t, t + 1);
    }
    return &shared_x_;
  }

  // Where column c's weights start, and the bytes from there to the end of lin's weights: the
  // layouts are laid out by column (a row, or a 16-column panel, per column group).
  static const char* weights_at(const Linear& lin, int64_t c, int64_t& left) {
    const at::Tensor& t = lin.i8_panels.defined() ? lin.i8_panels : lin.panels.defined() ? lin.panels : lin.w;
    const int64_t per_col = t.nbytes() / (lin.panels.defined() || lin.i8_panels.defined()
                                              ? (lin.n + kPanel - 1) / kPanel * kPanel : lin.n);
    left = t.nbytes() - c * per_col;
    return static_cast<const char*>(t.data_ptr()) + c * per_col;
  }

  // The first kAheadBytes of the weights this thread streams first in a coming product phase (its
  // run's first unit, `cols` columns a unit: per-thread runs, take_units), into L2, before the
  // barrier it waits at: its stream then starts from L2 rather than from memory, and during the
  // attention phase (where one of 3 KV heads leaves a thread idle) o's start arrives meanwhile.
  // The default model's w8a8 decode at one stream, Zen 3, in-process A/B (16 steps a round): the
  // step 0.963x (8 of 10 rounds faster); 4 KiB 1.03x of 16's time, 32 KiB 1.05x, 64 KiB 1.04x. At
  // 8 rows 1.03x (2 of 6), float16 weights at one row even: those go without.
  static void prefetch_run(const Linear& lin, const Run* runs, int64_t tid, int64_t cols) {
    const int64_t lo = static_cast<int64_t>(runs[tid].v.load(std::memory_order_relaxed) >> 32);
    if (lo * cols >= lin.n) return;
    int64_t left = 0;
    const char* p = weights_at(lin, lo * cols, left);
    for (int64_t b = 0; b < std::min(kAheadBytes, left); b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
  }

  // The lines of the K and V rows this step writes into layer cache kc / vc (the rows of m
  // sequences at `slots`, every KV head), thread tid of nt a share, fetched for writing at the
  // start of the qkv phase: the qkv tasks that write them (the last heads) otherwise stalled on
  // each store's read-for-ownership, scattered lines from memory, ~2 x 3 x 32 rows a layer at 32
  // streams, and made the other thread wait at the phase's barrier. The default model's w8a8
  // decode at 32 streams, 2 cores of the Xeon with AMX, in-process rounds alternated (6): the
  // qkv phase 1.36 -> 1.27 ms, the step 20.43 -> 20.01. From kSharedNormRows rows (a step of a
  // few streams writes a few rows; not measured there).
  template <typename C>
  void prefetch_kv_rows(C* kc, C* vc, const int64_t* slots, int64_t m, int64_t num_slots, int64_t tid,
                        int64_t nt) const {
    const int64_t bytes = head_dim_ * static_cast<int64_t>(sizeof(C));
    for (int64_t i = tid; i < m; i += nt)
      for (int64_t hh = 0; hh < kv_heads_; ++hh) {
        char* k = reinterpret_cast<char*>(kc + (hh * num_slots + slots[i]) * head_dim_);
        char* v = reinterpret_cast<char*>(vc + (hh * num_slots + slots[i]) * head_dim_);
        for (int64_t b = 0; b < bytes; b += 64) _m_prefetchw(k + b), _m_prefetchw(v + b);
      }
  }

  // Columns per task when n columns are shared by nt threads.
  static int64_t task_width(int64_t n, int64_t nt) {
    const int64_t w = (n + kTasksPerThread * nt - 1) / (kTasksPerThread * nt);
    return (w + kColAlign - 1) / kColAlign * kColAlign;
  }

  template <typename T>
  void run_cache(at::Tensor& x, const at::Tensor& pos, const at::Tensor& slots, const at::Tensor& tables,
                 const at::Tensor& lens, at::Tensor& out) const {
    if (cache_dtype_ == at::kHalf) run<T, at::Half>(x, pos, slots, tables, lens, out);
    else if (cache_dtype_ == at::kBFloat16) run<T, at::BFloat16>(x, pos, slots, tables, lens, out);
    else if (cache_dtype_ == at::kChar) run<T, int8_t>(x, pos, slots, tables, lens, out);
    else run<T, float>(x, pos, slots, tables, lens, out);
  }

  // T: the weights' storage type, C: the K/V cache's.
  template <typename T, typename C>
  void run(at::Tensor& x_t, const at::Tensor& pos_t, const at::Tensor& slots_t, const at::Tensor& tables_t,
           const at::Tensor& lens_t, at::Tensor& out_t) const {
    const int64_t m = x_t.size(0), h = heads_, kvh = kv_heads_, d = head_dim_, g = h / kvh;
    const int64_t inter = layers_[0].gate_up.n / 2;
    const int64_t max_k = std::max({hidden_, h * d, inter});
    const int64_t num_slots = k_caches_[0].size(1), max_blocks = tables_t.size(1);
    float* x = x_t.data_ptr<float>();
    const int64_t* pos = pos_t.data_ptr<int64_t>();
    const int64_t* slots = slots_t.data_ptr<int64_t>();
    const int32_t* tables = tables_t.data_ptr<int32_t>();
    const int32_t* lens = lens_t.data_ptr<int32_t>();
    const auto opts = x_t.options();
    at::Tensor q_t = at::empty({m, h * d}, opts), attn_t = at::empty({m, h * d}, opts);
    at::Tensor act_t = at::empty({m, inter}, opts), hbuf_t = at::empty({m, hidden_}, opts);
    float* q = q_t.data_ptr<float>();
    float* attn = attn_t.data_ptr<float>();
    float* act = act_t.data_ptr<float>();
    float* hbuf = hbuf_t.data_ptr<float>();
    float* out = out_t.data_ptr<float>();
    const float* cos = cos_.data_ptr<float>();
    const float* sin = sin_.data_ptr<float>();
    const int64_t nt = at::get_num_threads();
    // The product phases' units (take_units above): columns of o, gate/up and down, 16 at one
    // row and else 48 (a column tile of 3 panels: a run is cut only between tiles; at 2-8 rows,
    // streamed panel by panel as at one row (matvec.h panel_rows_bf16), 16 measured no better:
    // 4 / 5 / 8 rows 12.32 / 10.36 / 14.30 ms against 11.56 / 10.63 / 15.09, 10 rounds); heads
    // of qkv. A task is at most the width it always was.
    const bool split = m <= kPanelRowsX;  // one row tile: per-thread runs (take_units)
    const int64_t unit = m == 1 ? kColAlign : 3 * kColAlign;
    const int64_t hidden_units = (hidden_ + unit - 1) / unit, inter_units = (inter + unit - 1) / unit;
    const int64_t hidden_cap = std::max<int64_t>(1, task_width(hidden_, nt) / unit);
    const int64_t inter_cap = std::max<int64_t>(1, task_width(inter, nt) / unit);
    // qkv: tasks of whole heads, kTasksPerThread per thread as the other phases, so that a task's
    // product spans several column tiles, the later ones fetched ahead (matvec.h NextTile). The
    // qkv phase at 32 rows: 5.32 ms with one head per task, 4.66 so (Zen 4, 8 alternated rounds).
    const int64_t qkv_heads = h + 2 * kvh;
    const int64_t qkv_hpt = (qkv_heads + kTasksPerThread * nt - 1) / (kTasksPerThread * nt);  // heads per task
    // Attention's tasks: (sequence, partition) pairs for every KV head (attention.h Partitions),
    // and each pair's visiting order (visit_order): the same for every layer and KV head, so
    // computed once a step rather than in each of their tasks.
    inferlab_attention::Partitions parts(m, lens, kvh, g, d);
    int64_t max_len = 1;
    for (int64_t i = 0; i < m; ++i) max_len = std::max<int64_t>(max_len, lens[i]);
    const int64_t vstride = inferlab_attention::visit_len(std::min(max_len, inferlab_attention::kPartition));
    const std::unique_ptr<int64_t[]> visit(new int64_t[parts.pairs() * vstride]);
    const std::unique_ptr<std::atomic<int64_t>[]> attn_next(new std::atomic<int64_t>[layers_.size()]);
    for (size_t l = 0; l < layers_.size(); ++l) attn_next[l].store(0, std::memory_order_relaxed);
    constexpr int64_t kShared = 4;  // product phases a layer: qkv, o, gate/up, down
    const std::unique_ptr<Run[]> shares(new Run[layers_.size() * kShared * nt]);
    for (size_t l = 0; l < layers_.size(); ++l) {
      Run* runs = shares.get() + l * kShared * nt;
      share_out(runs, nt, qkv_heads, split);
      share_out(runs + nt, nt, hidden_units, split);
      share_out(runs + 2 * nt, nt, inter_units, split);
      share_out(runs + 3 * nt, nt, hidden_units, split);
    }

    const bool ahead = std::is_same_v<T, int8_t> && m <= 2;  // each phase's weights started early (prefetch_run)
    // w8a8 from kSharedNormRows rows on: each product phase's x made once (SharedX)
    const bool share_x = std::is_same_v<T, int8_t> && layers_[0].qkv.i8_panels.defined() && m >= kSharedNormRows;
    if (share_x) {
      const int64_t ldx = i8_groups(max_k) * kI8Group, rows = (m + kPanelRowsXI8 - 1) / kPanelRowsXI8 * kPanelRowsXI8;
      shared_x_.xq.resize(std::max<size_t>(shared_x_.xq.size(), rows * ldx));
      shared_x_.sx.resize(std::max<size_t>(shared_x_.sx.size(), rows * i8_scale_groups(max_k)));
      size_tiled_x(m, ldx, shared_x_.tiles);
    }

#pragma omp parallel num_threads(nt)
    {
      thread_local Work wk;
      wk.buf.resize(std::max<size_t>(wk.buf.size(), kRowsW * max_k));
      wk.dots.resize(std::max<size_t>(wk.dots.size(), kRowsW * m));
      wk.head.resize(std::max<size_t>(wk.head.size(), m * qkv_hpt * d));
      wk.rot.resize(std::max<size_t>(wk.rot.size(), d));
      wk.h.resize(std::max<size_t>(wk.h.size(), m * hidden_));
      wk.cols.resize(std::max<size_t>(wk.cols.size(), m * std::max(hidden_cap, inter_cap) * unit));
      wk.cols2.resize(std::max<size_t>(wk.cols2.size(), m * inter_cap * unit));
      const int64_t tid = omp_get_thread_num();

#pragma omp for schedule(static)
      for (int64_t u = 0; u < parts.pairs(); ++u) {
        const inferlab_attention::Partitions::Task t = parts.task(u, 0);
        wk.attn.lin.resize(std::max<size_t>(wk.attn.lin.size(), t.len));
        inferlab_attention::visit_order(tables + t.seq * max_blocks, t.start, t.len, block_size_, d,
                                        wk.attn.lin.data(), visit.get() + u * vstride);
      }

      PhaseClock clock(profiling_ && omp_get_thread_num() == 0 ? phase_seconds_.data() : nullptr);
      // A phase starts: its clock, and (a product phase: its x is new) the bf16 copy of x is stale.
      auto enter = [&](int phase) {
        clock.mark(phase);
        ++wk.phase;
      };
      for (size_t l = 0; l < layers_.size(); ++l) {
        const Layer& ly = layers_[l];
        C* kc = k_caches_[l].data_ptr<C>();
        C* vc = v_caches_[l].data_ptr<C>();
        float* ksc = k_scales_.empty() ? nullptr : k_scales_[l].data_ptr<float>();  // int8 caches only
        float* vsc = v_scales_.empty() ? nullptr : v_scales_[l].data_ptr<float>();
        Run* runs = shares.get() + l * kShared * nt;  // this layer's qkv, o, gate/up and down
        enter(kQkv);
        if (m >= kSharedNormRows) prefetch_kv_rows(kc, vc, slots, m, num_slots, tid, nt);
        const SharedX* shx = share_x ? make_shared_x(x, m, hidden_, ly.input_norm.data_ptr<float>(), hbuf) : nullptr;
        const float* hn = share_x ? hbuf : norm_rows(x, ly.input_norm, m, hbuf, wk);

        for (int64_t h0, h1; take_units(runs, nt, tid, qkv_hpt, split, h0, h1);) {
          const int64_t w = (h1 - h0) * d;
          products<T>(hn, m, ly.qkv, h0 * d, w, wk.head.data(), w, wk, h1 * d, d, shx);
          for (int64_t hh = h0; hh < h1; ++hh)
            for (int64_t i = 0; i < m; ++i) {
              float* row = wk.head.data() + i * w + (hh - h0) * d;
              const float* c = cos + pos[i] * d;
              const float* s = sin + pos[i] * d;
              if (hh < h + kvh && ly.q_norm.defined()) {
                const at::Tensor& nw = hh < h ? ly.q_norm : ly.k_norm;
                rms_norm_row(row, nw.data_ptr<float>(), d, eps_, row);
              }
              if (hh < h) {
                rope_row(row, c, s, q + (i * h + hh) * d, d);
              } else if (hh < h + kvh) {
                rope_row(row, c, s, wk.rot.data(), d);
                const int64_t srow = (hh - h) * num_slots + slots[i];
                store_kv_row(wk.rot.data(), kc + srow * d, ksc ? ksc + srow : nullptr, d);
              } else {
                const int64_t srow = (hh - h - kvh) * num_slots + slots[i];
                store_kv_row(row, vc + srow * d, vsc ? vsc + srow : nullptr, d);
              }
            }
        }
#pragma omp barrier

        clock.mark(kAttention);
        // Tasks taken first come, first served; each thread claims its next task as it starts one
        // and fetches that task's first kTaskAhead positions' K and V rows meanwhile: a task's own
        // prefetch (attention.h prefetch_keys) runs 16 positions ahead from its first on, so its
        // first rows were read cold. The default model's w8a8 decode at 32 streams, Zen 3, in-process
        // A/B: the step 0.975x (8 of 10 rounds faster), the attention phase 10.64 -> 9.86 ms (8 rounds).
        const int64_t attn_tasks = parts.pairs() * kvh;
        std::atomic<int64_t>& next_task = attn_next[l];
        for (int64_t task = next_task.fetch_add(1, std::memory_order_relaxed), after; task < attn_tasks; task = after) {
          after = next_task.fetch_add(1, std::memory_order_relaxed);
          if (after < attn_tasks) {
            const int64_t au = after / kvh, akh = after % kvh;
            const int64_t* av = visit.get() + au * vstride;
            const int64_t n = std::min<int64_t>(kTaskAhead, parts.task(au, akh).len);
            for (int64_t j = 0; j < n; ++j) {
              inferlab_attention::prefetch_row(kc + akh * num_slots * d + av[j], d);
              inferlab_attention::prefetch_row(vc + akh * num_slots * d + av[j], d);
            }
          }
          const int64_t u = task / kvh, kh = task % kvh;
          const inferlab_attention::Partitions::Task t = parts.task(u, kh);
          const int64_t off = (t.seq * h + kh * g) * d;
          inferlab_attention::decode_heads<C, float>(q + off, kc + kh * num_slots * d, vc + kh * num_slots * d,
                                                     ksc ? ksc + kh * num_slots : nullptr,
                                                     vsc ? vsc + kh * num_slots : nullptr,
                                                     tables + t.seq * max_blocks, t.start, t.len, block_size_, d,
                                                     g, attn_scale_, attn + off, wk.attn, visit.get() + u * vstride,
                                                     bf16_dot_, t.partial ? &t.part : nullptr);
        }
        if (ahead) prefetch_run(ly.o, runs + nt, tid, unit);
#pragma omp barrier
        if (parts.split()) {  // a long context's partitions, merged (the loop above ended in a barrier)
#pragma omp for schedule(static)
          for (int64_t task = 0; task < m * kvh; ++task)
            parts.merge(task / kvh, task % kvh, d, attn + (task / kvh * h + task % kvh * g) * d);
        }

        enter(kO);
        if (share_x) shx = make_shared_x(attn, m, h * d, nullptr, nullptr);
        for (int64_t u0, u1; take_units(runs + nt, nt, tid, hidden_cap, split, u0, u1);)
          add_product<T>(attn, m, ly.o, u0 * unit, std::min(u1 * unit, hidden_) - u0 * unit, x, wk,
                         u1 * unit, unit, shx);
        if (ahead) prefetch_run(ly.gate_up, runs + 2 * nt, tid, unit);
#pragma omp barrier

        clock.mark(kNorm);
        if (share_x) shx = make_shared_x(x, m, hidden_, ly.post_norm.data_ptr<float>(), hbuf);
        hn = share_x ? hbuf : norm_rows(x, ly.post_norm, m, hbuf, wk);

        enter(kGateUp);
        for (int64_t u0, u1; take_units(runs + 2 * nt, nt, tid, inter_cap, split, u0, u1);) {
          const int64_t j0 = u0 * unit, nn = std::min(u1 * unit, inter) - j0;
          products<T>(hn, m, ly.gate_up, j0, nn, wk.cols.data(), nn, wk, inter + j0, nn, shx);           // gate
          products<T>(hn, m, ly.gate_up, inter + j0, nn, wk.cols2.data(), nn, wk,
                      j0 + nn < inter ? j0 + nn : -1, unit, shx);  // up
          for (int64_t i = 0; i < m; ++i)
            silu_mul_row(wk.cols.data() + i * nn, wk.cols2.data() + i * nn, nn, act + i * inter + j0);
        }
        if (ahead) prefetch_run(ly.down, runs + 3 * nt, tid, unit);
#pragma omp barrier

        enter(kDown);
        if (share_x) shx = make_shared_x(act, m, inter, nullptr, nullptr);
        for (int64_t u0, u1; take_units(runs + 3 * nt, nt, tid, hidden_cap, split, u0, u1);)
          add_product<T>(act, m, ly.down, u0 * unit, std::min(u1 * unit, hidden_) - u0 * unit, x, wk,
                         u1 * unit, unit, shx);
        if (ahead && l + 1 < layers_.size())
          prefetch_run(layers_[l + 1].qkv, runs + kShared * nt, tid, d);
#pragma omp barrier
      }

      clock.mark(kFinalNorm);
#pragma omp for schedule(static)
      for (int64_t i = 0; i < m; ++i)
        rms_norm_row(x + i * hidden_, final_norm_.data_ptr<float>(), hidden_, eps_, out + i * hidden_);
      clock.mark(kPhases);
    }
  }

  std::vector<Layer> layers_;
  bool profiling_ = false;
  bool bf16_dot_ = false;  // attention over the bf16 caches by vdpbf16ps (attention.h decode_task_dot)
  mutable std::array<double, kPhases> phase_seconds_{};  // written by run() when profiling_
  mutable SharedX shared_x_;  // run()'s, from kSharedNormRows rows on (w8a8)
  at::Tensor final_norm_, cos_, sin_;
  std::vector<at::Tensor> k_caches_, v_caches_;
  std::vector<at::Tensor> k_scales_, v_scales_;  // int8 caches only (set_kv_scales)
  int64_t heads_ = 0, kv_heads_ = 0, head_dim_ = 0, block_size_ = 0, hidden_ = 0;
  float eps_, attn_scale_;
  at::ScalarType weight_dtype_ = at::kFloat, cache_dtype_ = at::kFloat;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferlab, m) {
  m.class_<DecoderStep>("DecoderStep")
      .def(torch::init<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<int64_t>, double, double>())
      .def("set_profiling", &DecoderStep::set_profiling)
      .def("set_kv_scales", &DecoderStep::set_kv_scales)
      .def("phase_seconds", &DecoderStep::phase_seconds)
      .def("forward", &DecoderStep::forward, "",
           {torch::arg("x"), torch::arg("positions"), torch::arg("slots"), torch::arg("block_tables"),
            torch::arg("context_lens")});
}
