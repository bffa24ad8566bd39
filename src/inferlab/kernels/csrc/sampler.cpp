// One step's sampling in one call: greedy, or temperature then top-k / top-p / min-p, each row
// drawn by inverse CDF from its own uniform (engine/sampler.py defines the distribution; this is
// the same definition without the ~25 batched torch operators it takes there).
//
// Why: at 32 rows of a 49,152-token vocabulary, the torch version of llama.cpp's default
// sampling (top-k 40, top-p 0.95, min-p 0.05) took ~14 ms of a ~30 ms decode step on one core,
// most of it in topk over the whole row and in dispatch; here a row is two or three vectorised
// passes over its logits (~10-20 us) and the rows run in parallel.
//
// Per row, z = logits / T:
//  - top-k k (0 < k < V) or top-p < 1: the c highest logits (c = k, or CANDIDATES for a
//    top-p-only row), sorted; probabilities normalised over the top-k, or over the whole row
//    when there is no top-k; the nucleus keeps a candidate while the mass before it is < p; a
//    top-p-only row whose candidates hold less than p of the mass is redone over the whole
//    vocabulary, sorted. Then min-p against the top candidate, then the inverse CDF over the
//    kept candidates in rank order.
//  - neither: softmax over the whole row, min-p against the most likely token, inverse CDF in
//    vocabulary order.
// The inverse CDF: the first index whose running float32 sum of weights exceeds u x total; the
// last index with weight when rounding puts u x total at the total itself.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

using inferlab_simd::exp8;
using inferlab_simd::row_argmax;
using inferlab_simd::row_max;

constexpr int64_t kCandidates = 256;  // engine/sampler.py CANDIDATES
constexpr float kExpFloor = -87.0f;   // exp8 clamps below this; weights there are exactly 0

// exp((x[j] - shift) * inv_t) into w (0 where the exponent is below kExpFloor); returns the sum.
float exp_row(const float* x, int64_t n, float shift, float inv_t, float* w) {
  const __m256 s = _mm256_set1_ps(shift), it = _mm256_set1_ps(inv_t), floor = _mm256_set1_ps(kExpFloor);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 z = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), s), it);
    const __m256 e = _mm256_and_ps(exp8(z), _mm256_cmp_ps(z, floor, _CMP_GE_OQ));
    _mm256_storeu_ps(w + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  float total = inferlab_simd::hsum(acc);
  for (; j < n; ++j) {
    const float z = (x[j] - shift) * inv_t;
    w[j] = z >= kExpFloor ? std::exp(z) : 0.0f;
    total += w[j];
  }
  return total;
}

// The inverse CDF over weights w[0..n) (>= 0, not normalised) with uniform u, sequentially: for
// the few hundred candidates of a truncated row.
int64_t inverse_cdf(const float* w, int64_t n, double u) {
  float total = 0.0f;
  for (int64_t j = 0; j < n; ++j) total += w[j];
  const float target = static_cast<float>(u) * total;
  float run = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    run += w[j];
    if (run > target) return j;
  }
  for (int64_t j = n - 1; j > 0; --j)
    if (w[j] > 0.0f) return j;
  return 0;
}

// The same over a whole vocabulary, by blocks: the running sum is the sum of the whole blocks
// before plus the running sum inside the block (one vectorised pass for the block sums, then one
// block scanned), where a sequential pass is ~50 us per 49,152 values. Where rounding leaves the
// block's own running sum short of the target, its last weighted index is taken.
constexpr int64_t kBlock = 64;

int64_t inverse_cdf_blocked(const float* w, int64_t n, double u, std::vector<float>& sums) {
  const int64_t nb = (n + kBlock - 1) / kBlock;
  sums.resize(nb);
  float total = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * kBlock, hi = std::min(n, lo + kBlock);
    float s = 0.0f;
    if (hi - lo == kBlock) {
      __m256 acc = _mm256_loadu_ps(w + lo);
      for (int64_t j = lo + 8; j < hi; j += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(w + j));
      s = inferlab_simd::hsum(acc);
    } else {
      for (int64_t j = lo; j < hi; ++j) s += w[j];
    }
    sums[b] = s;
    total += s;
  }
  const float target = static_cast<float>(u) * total;
  float before = 0.0f;
  int64_t b = 0;
  for (; b < nb; ++b) {
    if (before + sums[b] > target && sums[b] > 0.0f) break;
    before += sums[b];
  }
  if (b == nb) {  // u x total rounded up to the total: the last weighted index
    for (int64_t j = n - 1; j > 0; --j)
      if (w[j] > 0.0f) return j;
    return 0;
  }
  const int64_t lo = b * kBlock, hi = std::min(n, lo + kBlock);
  float run = before;
  int64_t last = lo;
  for (int64_t j = lo; j < hi; ++j) {
    if (w[j] > 0.0f) last = j;
    run += w[j];
    if (run > target && w[j] > 0.0f) return j;
  }
  return last;
}

struct Cand {
  float v;
  int32_t id;
};

// The c highest of x[0..n) sorted highest first: a min-heap of c, new values compared 8 at a
// time against its smallest, so most of the row is one compare per 8 values.
void top_candidates(const float* x, int64_t n, int64_t c, std::vector<Cand>& out) {
  out.clear();
  auto higher = [](const Cand& a, const Cand& b) { return a.v > b.v || (a.v == b.v && a.id < b.id); };
  if (c > 4 * kCandidates || c >= n) {  // a large top-k, or the whole row: a partial sort
    for (int64_t j = 0; j < n; ++j) out.push_back({x[j], static_cast<int32_t>(j)});
    c = std::min(c, n);
    std::partial_sort(out.begin(), out.begin() + c, out.end(), higher);
    out.resize(c);
    return;
  }
  auto greater = [](const Cand& a, const Cand& b) { return a.v > b.v; };  // min-heap on v
  for (int64_t j = 0; j < c; ++j) out.push_back({x[j], static_cast<int32_t>(j)});
  std::make_heap(out.begin(), out.end(), greater);
  float thr = out.front().v;
  auto offer = [&](int64_t j) {
    if (x[j] > thr) {
      std::pop_heap(out.begin(), out.end(), greater);
      out.back() = {x[j], static_cast<int32_t>(j)};
      std::push_heap(out.begin(), out.end(), greater);
      thr = out.front().v;
    }
  };
  int64_t j = c;
  for (; j + 8 <= n; j += 8) {
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), _mm256_set1_ps(thr), _CMP_GT_OQ));
    while (mask) {
      offer(j + __builtin_ctz(mask));
      mask &= mask - 1;
    }
  }
  for (; j < n; ++j) offer(j);
  std::sort(out.begin(), out.end(), higher);
}

int64_t sample_row(const float* x, int64_t V, float temperature, int64_t top_k, float top_p, float min_p,
                   double u, std::vector<Cand>& cand, std::vector<float>& w, std::vector<float>& sums) {
  if (temperature == 0.0f) return row_argmax(x, V);
  const float inv_t = 1.0f / temperature;
  const bool limited = top_k > 0 && top_k < V;
  if (!limited && !(top_p < 1.0f)) {  // no truncation: the whole row in vocabulary order
    w.resize(V);
    exp_row(x, V, row_max(x, V), inv_t, w.data());  // the most likely token's weight is exp(0) = 1
    if (min_p > 0.0f)
      for (int64_t j = 0; j < V; ++j)
        if (w[j] < min_p) w[j] = 0.0f;
    return inverse_cdf_blocked(w.data(), V, u, sums);
  }
  int64_t c = limited ? top_k : std::min(V, kCandidates);
  top_candidates(x, V, c, cand);
  const float top = cand[0].v;
  // The candidates' weights exp(z - z_top) / norm into w[0..c), their sum returned.
  auto weigh = [&](int64_t n, float norm) {
    float mass = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      const float z = (cand[j].v - top) * inv_t;
      w[j] = (z >= kExpFloor ? std::exp(z) : 0.0f) / norm;
      mass += w[j];
    }
    return mass;
  };
  // The normaliser, relative to exp of the top logit: over the top-k (the candidates' own sum),
  // else over the whole row.
  w.resize(std::max<int64_t>(V, c));
  float mass;
  if (limited || c == V) {
    const float norm = weigh(c, 1.0f);
    for (int64_t j = 0; j < c; ++j) w[j] /= norm;
    mass = 1.0f;
  } else {
    const float norm = exp_row(x, V, top, inv_t, w.data());
    mass = weigh(c, norm);
    while (c < V && mass < top_p) {  // the nucleus reaches past the candidates: 8x more
      c = std::min(V, 8 * c);
      top_candidates(x, V, c, cand);
      mass = weigh(c, norm);
    }
  }
  float before = 0.0f;
  int64_t kept = c;
  for (int64_t j = 0; j < c; ++j) {  // keep while the mass before is < p (the top token always stays)
    if (before >= top_p) {
      kept = j;
      break;
    }
    before += w[j];
  }
  if (min_p > 0.0f) {
    const float floor = w[0] * min_p;
    for (int64_t j = 0; j < kept; ++j)
      if (w[j] < floor) w[j] = 0.0f;
  }
  return cand[inverse_cdf(w.data(), kept, u)].id;
}

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& u) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "sample_rows: logits must be float32 [N, V]");
  const at::Tensor x = logits.contiguous();
  const int64_t N = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0 && V < (int64_t{1} << 31), "sample_rows: vocabulary size out of range");
  for (const at::Tensor* t : {&temperature, &top_k, &top_p, &min_p, &u})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == N, "sample_rows: one parameter per row");
  const at::Tensor temp = temperature.to(at::kFloat).contiguous(), tk = top_k.to(at::kLong).contiguous(),
                   tp = top_p.to(at::kFloat).contiguous(), mp = min_p.to(at::kFloat).contiguous(),
                   uu = u.to(at::kDouble).contiguous();
  at::Tensor out = at::empty({N}, at::kLong);
  const float* xp = x.data_ptr<float>();
  const float *tpp = temp.data_ptr<float>(), *ppp = tp.data_ptr<float>(), *mpp = mp.data_ptr<float>();
  const int64_t* kp = tk.data_ptr<int64_t>();
  const double* up = uu.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<Cand> cand;
    std::vector<float> w, sums;
    for (int64_t i = begin; i < end; ++i)
      op[i] = sample_row(xp + i * V, V, tpp[i], kp[i], ppp[i], mpp[i], up[i], cand, w, sums);
  });
  return out;
}

}  // namespace

// apply_bitmask_(logits, bitmask, rows): logits[rows[k], j] = -inf where bit j of bitmask[k] is 0
// (bit j % 32 of word j / 32), in place, for a float32 [N, V] logits and an int32 [n, >= V / 32]
// bitmask; a NaN logit stays NaN (engine/structured_outputs.py's apply_bitmask, the definition,
// does the same). Why here: the numpy pass looks up eight float limits per bitmask byte and takes
// the minimum with the whole row, 0.4-0.6 ms for 32 rows of SmolLM2's 49,152 logits; here a word
// with every token allowed is skipped, and the others store -inf only into their forbidden lanes.
namespace {

inline void mask_row(float* x, const int32_t* words, int64_t vocab) {
  const float ninf = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j + 32 <= vocab; j += 32) {
    const uint32_t w = static_cast<uint32_t>(words[j / 32]);
    if (w == 0xffffffffu) continue;  // every token of the word allowed (free text, most words)
#if defined(__AVX512F__)
    for (int h = 0; h < 2; ++h) {
      float* p = x + j + 16 * h;
      const __m512 v = _mm512_loadu_ps(p);
      const __mmask16 forbidden = static_cast<__mmask16>(~(w >> (16 * h)));
      _mm512_mask_storeu_ps(p, forbidden & _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), _mm512_set1_ps(ninf));
    }
#else
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (int b = 0; b < 4; ++b) {
      float* p = x + j + 8 * b;
      const __m256 v = _mm256_loadu_ps(p);
      const __m256i bits = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>((w >> (8 * b)) & 0xffu)), sel);
      const __m256 allowed = _mm256_castsi256_ps(_mm256_cmpeq_epi32(bits, sel));
      const __m256 put = _mm256_andnot_ps(allowed, _mm256_cmp_ps(v, v, _CMP_ORD_Q));  // forbidden, not NaN
      _mm256_storeu_ps(p, _mm256_blendv_ps(v, _mm256_set1_ps(ninf), put));
    }
#endif
  }
  for (; j < vocab; ++j)
    if (!((static_cast<uint32_t>(words[j / 32]) >> (j % 32)) & 1u) && !std::isnan(x[j])) x[j] = ninf;
}

void apply_bitmask_(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(),
              "apply_bitmask_: logits must be a contiguous float32 [N, V] tensor");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous(),
              "apply_bitmask_: bitmask must be a contiguous int32 [n, words] tensor");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.numel() == bitmask.size(0),
              "apply_bitmask_: rows must be int64 [n], one per bitmask row");
  const int64_t vocab = logits.size(1), words = bitmask.size(1), n = bitmask.size(0);
  TORCH_CHECK(words * 32 >= vocab, "apply_bitmask_: ", words, " words do not cover ", vocab, " tokens");
  const at::Tensor r = rows.contiguous();
  const int64_t* rp = r.data_ptr<int64_t>();
  for (int64_t k = 0; k < n; ++k)
    TORCH_CHECK(rp[k] >= 0 && rp[k] < logits.size(0), "apply_bitmask_: row ", rp[k], " outside the logits");
  float* lp = logits.data_ptr<float>();
  const int32_t* bp = bitmask.data_ptr<int32_t>();
  at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) mask_row(lp + rp[k] * vocab, bp + k * words, vocab);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferlab, m) {
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, Tensor u) -> Tensor");
  m.def("apply_bitmask_(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(inferlab, CPU, m) {
  m.impl("sample_rows", &sample_rows);
  m.impl("apply_bitmask_", &apply_bitmask_);
}
