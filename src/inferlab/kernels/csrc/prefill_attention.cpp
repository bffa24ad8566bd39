// Causal prefill attention: flash attention over oneDNN's micro-kernel (brgemm), in two flavours
// by what the products multiply in: bf16 (the avx512 variant: AVX512_BF16) or float32 (every
// variant).
//
// Why: torch's CPU flash attention runs in float32 here whatever the input dtype (bf16 inputs
// are no faster without AMX), ~125 GFLOP/s on two Zen 5 cores: half of a 1,024-token prefill of
// SmolLM2 went to it. oneDNN's bf16 micro-kernel (`at::native::cpublas::brgemm`, bf16 x bf16 ->
// float32, exported by torch) runs these shapes at ~430-480 GFLOP/s per core, so the products go
// there, and the rest of flash attention (online softmax, masking, packing) is ours. In float32
// (the AVX2 machines' compute, `--dtype float32` anywhere) the same micro-kernel runs SmolLM2's
// tiles at ~105 GFLOP/s per core on a Zen 4 against torch's ~40 for the whole attention; and a
// continuing chunk (chunked prefill, a prefix-cache hit, speculative decoding's verification
// rows) reads its context straight from the paged cache instead of gathering it first.
//
// Method, per (sequence, KV head, block of kBq query positions): the G = H / kvH query heads
// that share the KV head are stacked into one matrix of kBq * G rows (position-major: row r is
// position q0 + r / G, head r % G), so K and V are read once for all of them (GQA). K^T and V
// are packed once per (sequence, KV head), zero-padded to whole key blocks: bf16 in "VNNI" pairs
// (brgemm's B layout: element (k, n) of a [K, N] matrix at ((k / 2) * N + n) * 2 + k % 2), float32
// plain ([D, ctxp] and [ctxp, D]). For each block of kBk keys up to the block's causal limit:
// S = Q K^T (float32), the causal mask, the online softmax (running max and sum per row,
// float32), P (rounded to bf16 in that flavour), O += P V (float32). Finally O / sum. The scale
// is folded into Q before its rounding.
//
// Numerics: bf16 flavour: Q, K, P and V rounded to bf16 (8 bits of mantissa), every sum in
// float32; the same products as the 16-bit linear layers on that variant. float32 flavour:
// float32 throughout (exp to ~1 ulp). Masked keys never enter a sum.
//
// Operators (torch.ops.inferlab.*), float32 q / out, k / v float32, bfloat16 or float16;
// NAME is bf16 (the avx512 variant only) or f32:
//   prefill_attention_NAME(Tensor q, Tensor k, Tensor v, Tensor(a!) out, int start, float scale) -> ()
//       q, out [b, n, H, D]; k, v [b, ctx, kvH, D] (any strides, D contiguous), ctx >= start + n:
//       query i of sequence s is at position start + i and sees keys 0 .. start + i.
//   prefill_attention_paged_NAME(Tensor q, Tensor k_cache, Tensor v_cache, Tensor blocks,
//                                int block_size, Tensor(a!) out, int start, float scale) -> ()
//       q, out [1, n, H, D]; the caches [kvH, slots, D], blocks (int32 / int64) the sequence's
//       blocks in order: a continuing chunk reads its context straight from the paged cache.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include "bf16.h"
#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <immintrin.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define INFERLAB_PREFILL_BF16 1
#endif

namespace {

using inferlab_simd::exp8;
using inferlab_simd::hmax;
using inferlab_simd::hsum;
using inferlab_simd::load8;

constexpr int64_t kBk = 128;  // keys per block: S is rows x kBk floats (L2-resident); 256 measured no better

// Query positions per task: ~192 rows of Q once the G heads are stacked (brgemm's M); measured
// 4-7% faster than 96 at 256-2,048 tokens (SmolLM2's 9 over 3 heads); at least 1.
int64_t query_block(int64_t g_heads) { return std::max<int64_t>(1, 192 / g_heads); }

// ---- the float32 flavour's pieces (AVX2; every variant) ------------------------------------

// One row of d values to float32.
template <typename T>
inline void row_to_f32(const T* r, int64_t d, float* out) {
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) _mm256_storeu_ps(out + i, load8(r + i));
  for (; i < d; ++i) out[i] = static_cast<float>(r[i]);
}

// exp(s - m) of one block row's first c scores into p (float32), 0 from c to nb; returns their
// sum. The tail of c (not a multiple of 8) through a small buffer, so every exp is exp8's.
inline float softmax_row_f32(const float* s, float* p, int64_t c, int64_t nb, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= c; k += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + k), mv));
    _mm256_storeu_ps(p + k, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = hsum(sum);
  if (k < c) {
    alignas(32) float t[8];
    for (int64_t j = 0; j < 8; ++j) t[j] = k + j < c ? s[k + j] - m : -INFINITY;  // exp8 clamps: ~1e-38, dropped below
    _mm256_store_ps(t, exp8(_mm256_load_ps(t)));
    for (int64_t j = 0; k + j < c; ++j) p[k + j] = t[j], total += t[j];
    k = c;
  }
  std::fill(p + k, p + nb, 0.0f);
  return total;
}

// The largest of a block row's first c scores: 16 lanes at a time where the variant has AVX-512
// (8 at a time there cost the bf16 flavour ~5% of its attention time at 1,024 tokens).
inline float row_max(const float* s, int64_t c) {
  int64_t k = 0;
#if defined(__AVX512F__)
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (; k + 16 <= c; k += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + k));
  float m = _mm512_reduce_max_ps(mx);
#else
  __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (; k + 8 <= c; k += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + k));
  float m = hmax(mx);
#endif
  for (; k < c; ++k) m = std::max(m, s[k]);
  return m;
}

#ifdef INFERLAB_PREFILL_BF16
using namespace inferlab_bf16;  // to_bf16, row_to_bf16, softmax_row_bf16
#endif

// What a flavour decides: how its operands are stored (E: uint16_t bf16 bits or float), how a
// row is rounded into them, how V is packed, and a block row's softmax; the rest is shared. A
// 32-bit "unit" is one float32 or a pair of bf16 along k (brgemm's VNNI layout), so K^T is
// [D / kPer] rows of ctxp units either way.
struct F32Flash {
  using E = float;
  static constexpr int64_t kPer = 1;  // values per 32-bit unit
  static constexpr bool kVnni = false;
  static constexpr const char* kName = "prefill_attention_f32";
  template <typename T>
  static void row(const T* r, int64_t d, E* out) { row_to_f32(r, d, out); }
  static void scaled_row(const float* r, float scale, int64_t d, E* out) {
    for (int64_t i = 0; i < d; ++i) out[i] = r[i] * scale;
  }
  static float softmax(const float* s, E* p, int64_t c, int64_t nb, float m) { return softmax_row_f32(s, p, c, nb, m); }
  static int64_t width(int64_t seen) { return std::min<int64_t>(kBk, seen); }
};
#ifdef INFERLAB_PREFILL_BF16
struct Bf16Flash {
  using E = uint16_t;
  static constexpr int64_t kPer = 2;
  static constexpr bool kVnni = true;
  static constexpr const char* kName = "prefill_attention_bf16";
  template <typename T>
  static void row(const T* r, int64_t d, E* out) { row_to_bf16(r, d, out); }
  // r * scale rounded to bf16 in one pass, 32 at a time (the same rounding as row_to_bf16's).
  static void scaled_row(const float* r, float scale, int64_t d, E* out) {
    const __m512 sv = _mm512_set1_ps(scale);
    int64_t i = 0;
    for (; i + 32 <= d; i += 32)
      _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(r + i + 16), sv),
                                                                _mm512_mul_ps(_mm512_loadu_ps(r + i), sv)));
    for (; i < d; ++i) out[i] = to_bf16(r[i] * scale);
  }
  static float softmax(const float* s, E* p, int64_t c, int64_t nb, float m) { return softmax_row_bf16(s, p, c, nb, m); }
  // The last block only as wide as its seen keys, in 16s: a full one would compute ~half a
  // block of masked-out keys per query block in both products.
  static int64_t width(int64_t seen) { return std::min<int64_t>(kBk, (seen + 15) / 16 * 16); }
};
#endif

// brgemm's operand type for a flavour's stored values.
template <typename E>
using Operand = std::conditional_t<std::is_same_v<E, float>, float, at::BFloat16>;

// The packed K^T [D / kPer][ctxp] units of one (sequence, KV head), zero past ctx; row(pos) points
// at that position's D values of K.
template <typename F, typename Row>
void pack_kt(Row row, int64_t ctx, int64_t ctxp, int64_t d, typename F::E* out, std::vector<typename F::E>& tmp) {
  // 16 keys at a time, so each of K^T's rows is written 16 units (a cache line) at once: a key
  // at a time wrote one unit per row, D / kPer lines apart (~11% of a 1,024-token prefill's
  // attention time went to packing).
  constexpr int64_t kKeys = 16;  // divides ctxp (a multiple of kBk)
  tmp.resize(kKeys * d);
  auto* o32 = reinterpret_cast<uint32_t*>(out);
  const auto* t32 = reinterpret_cast<const uint32_t*>(tmp.data());
  const int64_t units = d / F::kPer;
  for (int64_t p0 = 0; p0 < ctxp; p0 += kKeys) {
    for (int64_t j = 0; j < kKeys; ++j) {
      auto* t = tmp.data() + j * d;
      if (p0 + j < ctx) F::row(row(p0 + j), d, t);
      else std::fill(t, t + d, typename F::E{0});
    }
    for (int64_t i = 0; i < units; ++i)
      for (int64_t j = 0; j < kKeys; ++j) o32[i * ctxp + p0 + j] = t32[j * units + i];
  }
}

// V packed [ctxp][D] (float32), or [ctxp / 2][D][2] (bf16: two keys' rows interleaved), zero past ctx.
template <typename F, typename Row>
void pack_v(Row row, int64_t ctx, int64_t ctxp, int64_t d, typename F::E* out, std::vector<typename F::E>& tmp) {
  using E = typename F::E;
  if constexpr (F::kPer == 1) {
    for (int64_t p = 0; p < ctxp; ++p) {
      if (p < ctx) F::row(row(p), d, out + p * d);
      else std::fill(out + p * d, out + (p + 1) * d, E{0});
    }
  } else {
    tmp.resize(2 * d);
    E *a = tmp.data(), *b = tmp.data() + d;
    auto* o32 = reinterpret_cast<uint32_t*>(out);
    for (int64_t p = 0; p < ctxp; p += 2) {
      if (p < ctx) F::row(row(p), d, a);
      else std::fill(a, a + d, E{0});
      if (p + 1 < ctx) F::row(row(p + 1), d, b);
      else std::fill(b, b + d, E{0});
      uint32_t* o = o32 + (p / 2) * d;
      for (int64_t i = 0; i < d; ++i) o[i] = static_cast<uint32_t>(a[i]) | (static_cast<uint32_t>(b[i]) << 16);
    }
  }
}

template <typename E>
struct Scratch {  // per pool thread and flavour, grown once
  std::vector<E> a, p;
  std::vector<float> s, o, m, l, mn;  // mn: each row's new running max in a key block
};

// One task: kv head g of sequence b, query positions q0 .. q0 + nq - 1 (start + q0 .. in the
// sequence). kt / vv are that (b, g)'s packed K^T and V.
template <typename F>
void attend_block(const float* q, const int64_t qs[3], float* out, const int64_t os[3], int64_t g, int64_t g_heads,
                  int64_t d, int64_t start, int64_t q0, int64_t nq, int64_t ctxp, const typename F::E* kt,
                  const typename F::E* vv, float scale, Scratch<typename F::E>& sc) {
  using B = Operand<typename F::E>;
  const int64_t rows = nq * g_heads;
  sc.a.resize(rows * d);
  sc.p.resize(rows * kBk);
  sc.s.resize(rows * kBk);
  sc.o.assign(rows * d, 0.0f);
  sc.m.assign(rows, -std::numeric_limits<float>::infinity());
  sc.l.assign(rows, 0.0f);
  sc.mn.resize(rows);
  for (int64_t r = 0; r < rows; ++r)  // Q rows, scaled, rounded to the flavour's operands
    F::scaled_row(q + (q0 + r / g_heads) * qs[0] + (g * g_heads + r % g_heads) * qs[1], scale, d,
                  sc.a.data() + r * d);
  const auto* a = reinterpret_cast<const B*>(sc.a.data());
  const auto* pb = reinterpret_cast<const B*>(sc.p.data());
  const int64_t limit = start + q0 + nq;  // keys 0 .. limit - 1 are seen by some row
  for (int64_t j0 = 0; j0 < limit; j0 += kBk) {
    const int64_t nb = F::width(limit - j0);
    at::native::cpublas::brgemm(rows, nb, d, d, ctxp, kBk, false, a, reinterpret_cast<const B*>(kt) + j0 * F::kPer,
                                sc.s.data(), F::kVnni);
    // Every row's new running max first, then every row's softmax: a row's max feeds its exps,
    // and with both in one loop each row waited on its own max (a chain the out-of-order window
    // could not see past into the next row). Split, the rows of each loop are independent: the
    // same operations in the same order (the same bits), the bf16 flavour's attention 5% faster
    // at 512 and 1,024 tokens (2 cores of the Xeon with AMX, in-process alternated, 10 rounds).
    auto seen = [&](int64_t r) { return std::min<int64_t>(kBk, start + q0 + r / g_heads - j0 + 1); };  // keys row r sees
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t c = seen(r);
      if (c > 0) sc.mn[r] = std::max(sc.m[r], row_max(sc.s.data() + r * kBk, c));
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t c = seen(r);
      const float* s = sc.s.data() + r * kBk;
      auto* p = sc.p.data() + r * kBk;
      if (c <= 0) {
        std::fill(p, p + nb, typename F::E{0});
        continue;
      }
      const float m_new = sc.mn[r];
      // 0 on the first block (-inf); 1 while the running max holds (most blocks after the first
      // few), where exp(0) is exactly 1 and libm's call was ~5% of the attention's time.
      const float alpha = m_new == sc.m[r] ? 1.0f : std::exp(sc.m[r] - m_new);
      sc.l[r] = sc.l[r] * alpha + F::softmax(s, p, c, nb, m_new);
      sc.m[r] = m_new;
      if (alpha != 1.0f) {
        float* o = sc.o.data() + r * d;
        for (int64_t i = 0; i < d; ++i) o[i] *= alpha;
      }
    }
    at::native::cpublas::brgemm(rows, d, nb, kBk, d, d, true, pb, reinterpret_cast<const B*>(vv) + j0 * d,
                                sc.o.data(), F::kVnni);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = out + (q0 + r / g_heads) * os[0] + (g * g_heads + r % g_heads) * os[1];
    const float inv = 1.0f / sc.l[r];  // every row sees at least key 0
    const float* o = sc.o.data() + r * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = o[i] * inv;
  }
}

// Shared driver: b sequences of n queries, kvh KV heads; krow(s, g, pos) / vrow(...) point at
// K / V rows. Packs every (s, g) in parallel, then runs the (s, g, query block) tasks, heaviest
// (latest) blocks first, taken from a shared counter.
template <typename F, typename KRow, typename VRow>
void run(const at::Tensor& q, at::Tensor& out, int64_t ctx, int64_t kvh, int64_t start, double scale, KRow krow,
         VRow vrow) {
  using E = typename F::E;
  const int64_t b = q.size(0), n = q.size(1), h = q.size(2), d = q.size(3);
  const int64_t g_heads = h / kvh;
  const int64_t ctxp = (ctx + kBk - 1) / kBk * kBk;
  std::vector<E> kt(b * kvh * ctxp * d), vv(b * kvh * ctxp * d);
  at::parallel_for(0, 2 * b * kvh, 1, [&](int64_t t0, int64_t t1) {
    std::vector<E> tmp;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t sg = t / 2, s = sg / kvh, g = sg % kvh;
      if (t % 2 == 0)
        pack_kt<F>([&](int64_t p) { return krow(s, g, p); }, ctx, ctxp, d, kt.data() + sg * ctxp * d, tmp);
      else
        pack_v<F>([&](int64_t p) { return vrow(s, g, p); }, ctx, ctxp, d, vv.data() + sg * ctxp * d, tmp);
    }
  });
  const int64_t bq = query_block(g_heads);
  const int64_t nblocks = (n + bq - 1) / bq;
  const int64_t tasks = b * kvh * nblocks;
  const int64_t qs[3] = {q.stride(1), q.stride(2), q.stride(3)};
  const int64_t os[3] = {out.stride(1), out.stride(2), out.stride(3)};
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    thread_local Scratch<E> sc;
    // torch's micro-kernel loads its AMX tile configuration only when it was not the last kernel
    // it ran on this thread, and the amx variant's products (csrc/amx.h) load theirs in between:
    // start from none, or it may multiply on theirs (measured: wrong sums in 2 of 10 test runs).
    if constexpr (F::kVnni) at::native::cpublas::brgemm_release(true);
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const int64_t blk = nblocks - 1 - i / (b * kvh);  // latest first: the longest rows
      const int64_t sg = i % (b * kvh), s = sg / kvh, g = sg % kvh;
      const int64_t q0 = blk * bq, nq = std::min(bq, n - q0);
      attend_block<F>(qp + s * q.stride(0), qs, op + s * out.stride(0), os, g, g_heads, d, start, q0, nq, ctxp,
                      kt.data() + sg * ctxp * d, vv.data() + sg * ctxp * d, static_cast<float>(scale), sc);
    }
    at::native::cpublas::brgemm_release(F::kVnni);
  });
}

void check_q_out(const at::Tensor& q, const at::Tensor& out, int64_t kvh, const char* name) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.stride(3) == 1, name,
              ": q must be float32 [b, n, H, D] with D contiguous");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == at::kFloat && out.stride(3) == 1, name,
              ": out must be float32 shaped like q, D contiguous");
  TORCH_CHECK(kvh > 0 && q.size(2) % kvh == 0, name, ": ", q.size(2), " query heads do not share ", kvh,
              " KV heads evenly");
  TORCH_CHECK(q.size(3) % 2 == 0 && q.size(3) <= 512, name, ": head_dim must be even, <= 512");
}

// k / v's element type T (float32, float16 or bfloat16) as a compile-time type for `body`.
template <typename Body>
void dispatch_kv(at::ScalarType dt, const char* name, Body body) {
  if (dt == at::kFloat) body(float{});
  else if (dt == at::kHalf) body(at::Half{});
  else if (dt == at::kBFloat16) body(at::BFloat16{});
  else TORCH_CHECK(false, name, ": k and v must be float32, float16 or bfloat16, got ", dt);
}

template <typename F>
void prefill_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                            int64_t start, double scale) {
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && k.size(0) == q.size(0) && k.size(3) == q.size(3) &&
                  k.stride(3) == 1 && v.stride(3) == 1 && k.scalar_type() == v.scalar_type(),
              F::kName, ": k and v must be [b, ctx, kvH, D] like q's b and D, D contiguous");
  check_q_out(q, out, k.size(2), F::kName);
  const int64_t ctx = k.size(1);
  TORCH_CHECK(start >= 0 && ctx >= start + q.size(1), F::kName, ": ", ctx, " keys for queries at ", start, " .. ",
              start + q.size(1) - 1);
  if (q.numel() == 0) return;
  dispatch_kv(k.scalar_type(), F::kName, [&](auto zero) {
    using T = decltype(zero);
    const T *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
    run<F>(q, out, ctx, k.size(2), start, scale,
           [&](int64_t s, int64_t g, int64_t p) { return kp + s * k.stride(0) + p * k.stride(1) + g * k.stride(2); },
           [&](int64_t s, int64_t g, int64_t p) { return vp + s * v.stride(0) + p * v.stride(1) + g * v.stride(2); });
  });
}

template <typename F>
void prefill_attention_paged_impl(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                                  const at::Tensor& blocks, int64_t block_size, at::Tensor& out, int64_t start,
                                  double scale) {
  const std::string name = std::string(F::kName).insert(std::strlen("prefill_attention_"), "paged_");
  TORCH_CHECK(kc.dim() == 3 && vc.sizes() == kc.sizes() && kc.is_contiguous() && vc.is_contiguous() &&
                  kc.size(2) == q.size(3) && kc.scalar_type() == vc.scalar_type(),
              name, ": the caches must be contiguous [kvH, slots, D] like q's D");
  TORCH_CHECK(q.size(0) == 1, name, ": one sequence at a time");
  check_q_out(q, out, kc.size(0), name.c_str());
  TORCH_CHECK(block_size > 0 && blocks.dim() == 1, name, ": blocks must be a vector");
  const int64_t ctx = start + q.size(1);
  TORCH_CHECK(blocks.numel() * block_size >= ctx, name, ": ", blocks.numel(), " blocks of ", block_size,
              " hold fewer than ", ctx, " positions");
  if (q.numel() == 0) return;
  const at::Tensor bl = blocks.to(at::kLong).contiguous();
  const int64_t* bp = bl.data_ptr<int64_t>();
  const int64_t slots = kc.size(1), d = kc.size(2);
  for (int64_t i = 0; i < bl.numel(); ++i)
    TORCH_CHECK(bp[i] >= 0 && (bp[i] + 1) * block_size <= slots, name, ": block ", bp[i], " is outside the cache");
  auto slot = [&](int64_t p) { return bp[p / block_size] * block_size + p % block_size; };
  dispatch_kv(kc.scalar_type(), name.c_str(), [&](auto zero) {
    using T = decltype(zero);
    const T *kp = kc.data_ptr<T>(), *vp = vc.data_ptr<T>();
    run<F>(q, out, ctx, kc.size(0), start, scale,
           [&](int64_t, int64_t g, int64_t p) { return kp + (g * slots + slot(p)) * d; },
           [&](int64_t, int64_t g, int64_t p) { return vp + (g * slots + slot(p)) * d; });
  });
}

void prefill_attention_f32(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                           int64_t start, double scale) {
  prefill_attention_impl<F32Flash>(q, k, v, out, start, scale);
}

void prefill_attention_paged_f32(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                                 const at::Tensor& blocks, int64_t block_size, at::Tensor& out, int64_t start,
                                 double scale) {
  prefill_attention_paged_impl<F32Flash>(q, kc, vc, blocks, block_size, out, start, scale);
}

void prefill_attention_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                            int64_t start, double scale) {
#ifdef INFERLAB_PREFILL_BF16
  prefill_attention_impl<Bf16Flash>(q, k, v, out, start, scale);
#else
  TORCH_CHECK(false, "prefill_attention_bf16 needs the avx512 kernel variant (AVX512_BF16)");
#endif
}

void prefill_attention_paged_bf16(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                                  const at::Tensor& blocks, int64_t block_size, at::Tensor& out, int64_t start,
                                  double scale) {
#ifdef INFERLAB_PREFILL_BF16
  prefill_attention_paged_impl<Bf16Flash>(q, kc, vc, blocks, block_size, out, start, scale);
#else
  TORCH_CHECK(false, "prefill_attention_paged_bf16 needs the avx512 kernel variant (AVX512_BF16)");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferlab, m) {
  m.def("prefill_attention_bf16(Tensor q, Tensor k, Tensor v, Tensor(a!) out, int start, float scale) -> ()");
  m.def("prefill_attention_paged_bf16(Tensor q, Tensor k_cache, Tensor v_cache, Tensor blocks, int block_size, "
        "Tensor(a!) out, int start, float scale) -> ()");
  m.def("prefill_attention_f32(Tensor q, Tensor k, Tensor v, Tensor(a!) out, int start, float scale) -> ()");
  m.def("prefill_attention_paged_f32(Tensor q, Tensor k_cache, Tensor v_cache, Tensor blocks, int block_size, "
        "Tensor(a!) out, int start, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(inferlab, CPU, m) {
  m.impl("prefill_attention_bf16", &prefill_attention_bf16);
  m.impl("prefill_attention_paged_bf16", &prefill_attention_paged_bf16);
  m.impl("prefill_attention_f32", &prefill_attention_f32);
  m.impl("prefill_attention_paged_f32", &prefill_attention_paged_f32);
}
