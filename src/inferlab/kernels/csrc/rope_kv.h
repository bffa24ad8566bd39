// Rotating q and k (rotate-half RoPE) and writing k and v into the paged cache, one head of one
// token at a time: shared by fused.cpp's rope_write_kv (over a finished qkv product) and
// linear.cpp's linear_panels_rope_kv (over each chunk of the product as its tiles finish it), so
// that both give the same bits. The checks of their common arguments are here too.
#pragma once

#include <ATen/ATen.h>

#include "rows.h"

#include <algorithm>
#include <cstdint>
#include <optional>

namespace inferlab_rope_kv {

// The checked arguments of one call: T tokens of H query and kvH KV heads of D values, the
// outputs q [T, H, D] and k [T, kvH, D] (float32, rotated), v [T, kvH, D] (float32, or null:
// the caller's product holds it), the caches [kvH, num_slots, D] and their scales (int8 caches).
struct RopeKv {
  int64_t t = 0, heads = 0, kv_heads = 0, d = 0, num_slots = 0;
  const int64_t* pos = nullptr;
  const int64_t* slots = nullptr;
  const float* cos = nullptr;
  const float* sin = nullptr;
  float* q = nullptr;
  float* k = nullptr;
  float* v = nullptr;
  float* k_scale = nullptr;
  float* v_scale = nullptr;
  at::Tensor q_t, k_t, v_t, pos_t, slots_t;  // keep what the pointers point into alive
};

// Checks the arguments both operators take (t tokens) and allocates q and k (and v when
// `with_v`). `op` names the operator in the messages.
inline RopeKv check_rope_kv(const char* op, int64_t t, const at::Tensor& positions, const at::Tensor& cos,
                            const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slots, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                            bool with_v) {
  for (const at::Tensor* c : {&cos, &sin})
    TORCH_CHECK(c->scalar_type() == at::kFloat && c->is_contiguous(), op, ": cos and sin must be contiguous float32");
  const auto cdt = k_cache.scalar_type();
  TORCH_CHECK(cdt == at::kFloat || cdt == at::kHalf || cdt == at::kBFloat16 || cdt == at::kChar,
              op, ": k_cache must be float32, float16, bfloat16 or int8, got ", cdt);
  const bool quant = cdt == at::kChar;
  TORCH_CHECK(quant == (k_scale.has_value() && k_scale->defined()) &&
                  quant == (v_scale.has_value() && v_scale->defined()),
              op, ": k_scale and v_scale are given exactly when the caches are int8");
  TORCH_CHECK(v_cache.scalar_type() == cdt, op, ": k_cache and v_cache must share one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), op, ": the caches must be contiguous");
  TORCH_CHECK(head_dim % 2 == 0, op, ": head_dim must be even");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == t, op, ": positions must be [T] int64");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == t, op, ": slots must be [T] int64");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == head_dim && sin.sizes() == cos.sizes(), op, ": cos/sin must be [P, D]");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(0) == num_kv_heads && k_cache.size(2) == head_dim &&
                  v_cache.sizes() == k_cache.sizes(),
              op, ": caches must be [kvH, num_slots, D]");
  if (quant)
    for (const at::Tensor& sc : {*k_scale, *v_scale})
      TORCH_CHECK(sc.scalar_type() == at::kFloat && sc.is_contiguous() && sc.dim() == 2 &&
                      sc.size(0) == num_kv_heads && sc.size(1) == k_cache.size(1),
                  op, ": the scales must be contiguous float32 [kvH, num_slots]");
  RopeKv a;
  a.t = t, a.heads = num_heads, a.kv_heads = num_kv_heads, a.d = head_dim, a.num_slots = k_cache.size(1);
  a.pos_t = positions.contiguous(), a.slots_t = slots.contiguous();
  a.pos = a.pos_t.data_ptr<int64_t>(), a.slots = a.slots_t.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(a.pos[i] >= 0 && a.pos[i] < max_pos, op, ": position ", a.pos[i], " outside the rope table (",
                max_pos, ")");
    TORCH_CHECK(a.slots[i] >= 0 && a.slots[i] < a.num_slots, op, ": slot ", a.slots[i], " outside the cache (",
                a.num_slots, ")");
  }
  a.cos = cos.data_ptr<float>(), a.sin = sin.data_ptr<float>();
  const auto f32 = cos.options();
  a.q_t = at::empty({t, num_heads, head_dim}, f32), a.k_t = at::empty({t, num_kv_heads, head_dim}, f32);
  a.q = a.q_t.data_ptr<float>(), a.k = a.k_t.data_ptr<float>();
  if (with_v) a.v_t = at::empty({t, num_kv_heads, head_dim}, f32), a.v = a.v_t.data_ptr<float>();
  if (quant) a.k_scale = k_scale->data_ptr<float>(), a.v_scale = v_scale->data_ptr<float>();
  return a;
}

// Head h (0 .. H + 2 kvH: q heads, then k's, then v's) of token i, its D values at src: q and k
// rotated into a.q / a.k, k and v written into their cache slot (and v into a.v where given).
template <typename C>
inline void rope_kv_head(const RopeKv& a, C* kc, C* vc, int64_t i, int64_t h, const float* src) {
  using inferlab_rows::rope_row;
  using inferlab_rows::store_kv_row;
  const int64_t d = a.d;
  const float* c = a.cos + a.pos[i] * d;
  const float* s = a.sin + a.pos[i] * d;
  if (h < a.heads) {
    rope_row(src, c, s, a.q + (i * a.heads + h) * d, d);
    return;
  }
  const bool is_k = h < a.heads + a.kv_heads;
  const int64_t g = h - a.heads - (is_k ? 0 : a.kv_heads);
  const int64_t srow = g * a.num_slots + a.slots[i], off = srow * d;
  if (is_k) {
    float* kout = a.k + (i * a.kv_heads + g) * d;
    rope_row(src, c, s, kout, d);
    store_kv_row(kout, kc + off, a.k_scale ? a.k_scale + srow : nullptr, d);
  } else {
    if (a.v) std::copy(src, src + d, a.v + (i * a.kv_heads + g) * d);
    store_kv_row(src, vc + off, a.v_scale ? a.v_scale + srow : nullptr, d);
  }
}

// body(kc, vc) with the caches' element type (float, at::Half, at::BFloat16 or int8_t).
template <typename Body>
inline void dispatch_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, Body body) {
  const auto cdt = k_cache.scalar_type();
  if (cdt == at::kFloat) body(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  else if (cdt == at::kHalf) body(k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>());
  else if (cdt == at::kChar) body(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
  else body(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>());
}

}  // namespace inferlab_rope_kv
