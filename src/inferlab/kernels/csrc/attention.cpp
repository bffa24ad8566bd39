// Paged attention for decode: one query token per sequence, K/V read straight from the blocks.
//
// Why: the torch path copies every sequence's whole context out of the paged cache
// (index_select per layer for K and V) and then runs one padded SDPA call; at batch 32 the copy
// alone is a third of the step. Here each (sequence, KV head) task walks its block table and
// reads each K and V row once from the cache, for all the query heads that share that KV head
// (GQA), so the memory traffic is the context itself and nothing more.
//
//   q            [B, H, D]          float32, or the cache's dtype
//   k/v_cache    [kvH, slots, D]    float32 / bfloat16 / float16 / int8 codes, head-major;
//                                   slot = block_id * block_size + offset
//   k/v_scale    [kvH, slots]       float32, exactly when the caches are int8 (one scale per
//                                   token and KV head, models/kv_cache.py); q then float32
//   block_tables [B, max_blocks]    int32 or int64; row b lists sequence b's blocks in order
//   context_lens [B]                int32 or int64; positions 0 .. len-1 are attended
//   bf16_dot     bool               a bfloat16 cache with q and P rounded to bf16, multiplied by
//                                   vdpbf16ps (the avx512 variant; attention.h decode_task_dot),
//                                   as prefill attention's bf16 flavour multiplies; else float32
//   -> out       [B, H, D]          q's dtype
//
// A task is one (sequence, KV head, partition of at most 512 positions): a longer context's
// partitions run on every thread and are merged after (attention.h Partitions, merge_parts).
// Per task: pass 1 computes the G = H / kvH rows of scores (8 K rows at a time, one horizontal
// reduction per 8 dot products) into a small buffer, then softmax in fp32 with a vectorised
// exp; pass 2 accumulates the probability-weighted V rows, tile by tile so that each V tile is
// loaded from memory once and reused from L1 for all G heads. Two passes rather than an online
// softmax: the buffer is G x context floats (tiny), and the normalisation stays exact.
// Without bf16_dot all arithmetic is fp32 whatever the storage (16-bit rows and int8 codes are widened in
// registers; an int8 row's scale multiplies its score and its probability, attention.h).
// Fast paths for head_dim 64 and 128 (loops unrolled at compile time); any other head_dim works.
// Every cache dtype at those head dims takes grouped passes that widen each K / V row
// once for up to 3 query heads (attention.h, scores_group / accumulate_group): measured at batch
// 32 of 280-token contexts, SmolLM2's 9 over 3 heads, one core, float16 K/V: 0.30 -> 0.19 ms a
// layer on the avx512 variant (512-bit), 0.29 -> 0.23 ms on the avx2 variant (same CPU).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention.h"

#include <cstdint>
#include <optional>

namespace {

using namespace inferlab_attention;  // decode_heads, Scratch, check_tables

// ks / vs: an int8 cache's scales ([kvH, slots] float32), else undefined.
template <typename T, typename Q>
void decode_all(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& tables,
                const at::Tensor& lens, int64_t bs, double scale, at::Tensor& out, const at::Tensor& ks = {},
                const at::Tensor& vs = {}, bool dot = false) {
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t kvh = kc.size(0), slots = kc.size(1), maxb = tables.size(1);
  const int64_t g_heads = h / kvh;
  const Q* qp = q.data_ptr<Q>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const float* ksp = ks.defined() ? ks.data_ptr<float>() : nullptr;
  const float* vsp = vs.defined() ? vs.data_ptr<float>() : nullptr;
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  Q* op = out.data_ptr<Q>();
  int64_t total = 0;
  for (int64_t i = 0; i < b; ++i) total += lp[i];
  // Tasks: (sequence, partition) pairs (attention.h kPartition), each for every KV head; a
  // sequence of several partitions leaves unnormalised results in `parts`, merged after.
  Partitions parts(b, lp, kvh, g_heads, d);
  // Small work (a few short contexts) is cheaper on one thread than a fork/join.
  const int64_t tasks = parts.pairs() * kvh;
  const int64_t grain = total * g_heads * kvh * d < (1 << 15) ? tasks : 1;
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    thread_local Scratch s;  // torch's pool threads live on: buffers grow once, then are reused
    for (int64_t task = begin; task < end; ++task) {
      const int64_t u = task / kvh, kh = task % kvh;
      const Partitions::Task t = parts.task(u, kh);
      const int64_t i = t.seq;
      const T* kbase = kp + kh * slots * d;
      const T* vbase = vp + kh * slots * d;
      const Q* qi = qp + (i * h + kh * g_heads) * d;
      Q* oi = op + (i * h + kh * g_heads) * d;
      const float* khs = ksp ? ksp + kh * slots : nullptr;
      const float* vhs = vsp ? vsp + kh * slots : nullptr;
      decode_heads<T, Q>(qi, kbase, vbase, khs, vhs, tp + i * maxb, t.start, t.len, bs, d, g_heads,
                         static_cast<float>(scale), oi, s, nullptr, dot, t.partial ? &t.part : nullptr);
    }
  });
  if (parts.split())
    at::parallel_for(0, b * kvh, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task)
        parts.merge(task / kvh, task % kvh, d, op + (task / kvh * h + task % kvh * g_heads) * d);
    });
}

template <typename T>
void decode_dispatch_q(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& tables,
                       const at::Tensor& lens, int64_t bs, double scale, at::Tensor& out, bool dot) {
  if (q.scalar_type() == at::kFloat)
    decode_all<T, float>(q, kc, vc, tables, lens, bs, scale, out, {}, {}, dot);
  else
    decode_all<T, T>(q, kc, vc, tables, lens, bs, scale, out, {}, {}, dot);
}

// An int8 cache's scales: both present, float32, contiguous, [kvH, slots] like the cache's rows.
void check_scales(const at::Tensor& cache, const std::optional<at::Tensor>& ks, const std::optional<at::Tensor>& vs) {
  const bool quant = cache.scalar_type() == at::kChar;
  TORCH_CHECK_VALUE(quant == (ks.has_value() && ks->defined()) && quant == (vs.has_value() && vs->defined()),
                    "paged_attention_decode: k_scale and v_scale are given exactly when the caches are int8");
  if (!quant) return;
  for (const at::Tensor& t : {*ks, *vs})
    TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu() && t.dim() == 2 &&
                          t.size(0) == cache.size(0) && t.size(1) == cache.size(1),
                      "paged_attention_decode: the scales must be contiguous float32 [kvH, slots] = ",
                      cache.sizes().slice(0, 2), ", got ", t.scalar_type(), " ", t.sizes());
}

at::Tensor paged_attention_decode(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables_in, const at::Tensor& context_lens_in,
                                  int64_t block_size, double scale, const std::optional<at::Tensor>& k_scale,
                                  const std::optional<at::Tensor>& v_scale, bool bf16_dot) {
  TORCH_CHECK_VALUE(q_in.dim() == 3, "paged_attention_decode: q must be [B, H, D], got ", q_in.sizes());
  TORCH_CHECK_VALUE(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
                    "paged_attention_decode: k_cache and v_cache must both be [kvH, slots, D]; got ",
                    k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(),
                    "paged_attention_decode: the caches must be contiguous");
  TORCH_CHECK_VALUE(q_in.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
                    "paged_attention_decode: CPU tensors only");
  const auto dt = k_cache.scalar_type();
  TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf || dt == at::kChar,
                    "paged_attention_decode: cache dtype ", dt, " is not float32, bfloat16, float16 or int8");
  TORCH_CHECK_VALUE(v_cache.scalar_type() == dt, "paged_attention_decode: k_cache and v_cache must share one dtype");
  TORCH_CHECK_VALUE(q_in.scalar_type() == at::kFloat || (q_in.scalar_type() == dt && dt != at::kChar),
                    "paged_attention_decode: q must be float32 or the cache's dtype (", dt,
                    "; float32 for an int8 cache), got ",
                    q_in.scalar_type());
  check_scales(k_cache, k_scale, v_scale);
  TORCH_CHECK_VALUE(!bf16_dot || can_dot(dt), "paged_attention_decode: bf16_dot needs a bfloat16 cache and the ",
                    "kernels' avx512 variant (AVX512_BF16); here a ", dt, " cache");
  const int64_t b = q_in.size(0), h = q_in.size(1), d = q_in.size(2), kvh = k_cache.size(0);
  TORCH_CHECK_VALUE(k_cache.size(2) == d, "paged_attention_decode: head_dim of q (", d, ") and the cache (",
                    k_cache.size(2), ") differ");
  TORCH_CHECK_VALUE(kvh >= 1 && h % kvh == 0, "paged_attention_decode: ", h,
                    " query heads are not a multiple of ", kvh, " KV heads");
  TORCH_CHECK_VALUE(block_size >= 1 && k_cache.size(1) % block_size == 0, "paged_attention_decode: block_size ",
                    block_size, " does not divide the cache's ", k_cache.size(1), " slots");
  TORCH_CHECK_VALUE(block_tables_in.dim() == 2 && block_tables_in.size(0) == b,
                    "paged_attention_decode: block_tables must be [B, max_blocks] with B = ", b, ", got ",
                    block_tables_in.sizes());
  TORCH_CHECK_VALUE(context_lens_in.dim() == 1 && context_lens_in.size(0) == b,
                    "paged_attention_decode: context_lens must be [B] with B = ", b, ", got ",
                    context_lens_in.sizes());
  const auto it = block_tables_in.scalar_type();
  TORCH_CHECK_VALUE(it == at::kInt || it == at::kLong, "paged_attention_decode: block_tables must be int32 or int64");
  TORCH_CHECK_VALUE(context_lens_in.scalar_type() == at::kInt || context_lens_in.scalar_type() == at::kLong,
                    "paged_attention_decode: context_lens must be int32 or int64");
  const at::Tensor q = q_in.contiguous();
  at::Tensor tables = block_tables_in.contiguous();
  at::Tensor lens = context_lens_in.contiguous();
  at::Tensor out = at::empty_like(q);
  if (b == 0) return out;
  if (it == at::kInt && lens.scalar_type() == at::kInt) {
    check_tables<int32_t>(tables, lens, block_size, k_cache.size(1), "paged_attention_decode");
  } else {  // checked in int64, so the narrowing below is exact
    tables = tables.to(at::kLong);
    lens = lens.to(at::kLong);
    check_tables<int64_t>(tables, lens, block_size, k_cache.size(1), "paged_attention_decode");
    tables = tables.to(at::kInt);
    lens = lens.to(at::kInt);
  }
  if (dt == at::kFloat)
    decode_all<float, float>(q, k_cache, v_cache, tables, lens, block_size, scale, out);
  else if (dt == at::kChar)
    decode_all<int8_t, float>(q, k_cache, v_cache, tables, lens, block_size, scale, out, *k_scale, *v_scale);
  else if (dt == at::kBFloat16)
    decode_dispatch_q<c10::BFloat16>(q, k_cache, v_cache, tables, lens, block_size, scale, out, bf16_dot);
  else
    decode_dispatch_q<c10::Half>(q, k_cache, v_cache, tables, lens, block_size, scale, out, false);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferlab, m) {
  m.def(
      "paged_attention_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor context_lens, int block_size, float scale, Tensor? k_scale=None, Tensor? v_scale=None, "
      "bool bf16_dot=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(inferlab, CPU, m) { m.impl("paged_attention_decode", &paged_attention_decode); }
