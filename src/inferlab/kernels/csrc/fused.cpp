// Small fused operators for the decoder layer: each replaces several eager torch operators
// (and their dispatch, which dominates a small decode step on a CPU) with one pass over memory.
//
//   add_rms_norm_(x, residual, weight, eps) -> out     x += residual; out = rms_norm(x) * weight
//   rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slots, H, kvH, D[, k_scale, v_scale]) -> (q, k)
//       rotate q and k of each token (rotate-half layout), write k and v into the paged cache
//       at `slots` ([kvH, num_slots, D] caches of float32, float16 or bfloat16, or int8 codes
//       with their [kvH, num_slots] float32 scales, quantized per row as rows.h says), return the
//       rotated q [T, H, D] and k [T, kvH, D] (float32)
//       (a fresh prompt attends to its own k and v without reading the cache back)
//   silu_mul(x) -> out                                 x = [gate | up] -> silu(gate) * up
//                                                      (float32, or bfloat16 in and out)
//   add_rms_norm_q8_(x, residual, weight, eps) -> (codes, scales)
//   silu_mul_q8(x) -> (codes, scales)                  (the AVX-512 VNNI variant) the same rows,
//       handed to w8a8's next product already quantized (linear_panels_i8_q): see below
//
// float32 activations (silu_mul also bf16; the caches may be 16-bit): the callers use them on the float32 compute path and fall back to torch
// operators otherwise.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "matvec.h"  // quantize_row_u8, i8_groups (w8a8's activation codes)
#include "rope_kv.h"
#include "rows.h"

#include <optional>
#include <tuple>
#include <vector>

namespace {

using namespace inferlab_rows;  // rms_norm_row, rope_row, silu_mul_row, store_kv_row

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// residual float32, or bfloat16 (a bf16 product's output, widened exactly); the output float32,
// or rounded to bf16 when bf16_out (the next product's input on the avx512 variant's prefill).
at::Tensor add_rms_norm_(at::Tensor x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                         bool bf16_out) {
  check_f32(x, "x");
  const bool bf16_residual = residual.scalar_type() == at::kBFloat16;
  if (!bf16_residual) check_f32(residual, "residual");
  TORCH_CHECK(residual.is_contiguous(), "residual must be contiguous");
  check_f32(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes(), "x and residual must be the same [T, hidden]");
  const int64_t t = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.numel() == n, "weight must have ", n, " elements");
  at::Tensor out = at::empty_like(x, bf16_out ? x.options().dtype(at::kBFloat16) : x.options());
  float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> row;  // the normed row before its rounding to bf16
    if (bf16_out) row.resize(n);
    for (int64_t i = begin; i < end; ++i) {
      float* xr = xp + i * n;
      if (bf16_residual) add_row(xr, residual.data_ptr<at::BFloat16>() + i * n, n);
      else add_row(xr, residual.data_ptr<float>() + i * n, n);
      if (bf16_out) {
        rms_norm_row(xr, wp, n, feps, row.data());
        store_row(row.data(), out.data_ptr<at::BFloat16>() + i * n, n);
      } else {
        rms_norm_row(xr, wp, n, feps, out.data_ptr<float>() + i * n);
      }
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> rope_write_kv(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  check_f32(qkv, "qkv");
  const int64_t t = qkv.size(0), heads = num_heads + 2 * num_kv_heads;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == heads * head_dim, "qkv must be [T, (H + 2 kvH) * D]");
  const inferlab_rope_kv::RopeKv a = inferlab_rope_kv::check_rope_kv(
      "rope_write_kv", t, positions, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads, head_dim, k_scale,
      v_scale, /*with_v=*/false);
  const float* in = qkv.data_ptr<float>();
  inferlab_rope_kv::dispatch_cache(k_cache, v_cache, [&](auto* kc, auto* vc) {
    at::parallel_for(0, t, 8, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        for (int64_t h = 0; h < heads; ++h)
          inferlab_rope_kv::rope_kv_head(a, kc, vc, i, h, in + (i * heads + h) * head_dim);
    });
  });
  return {a.q_t, a.k_t};
}

// bf16 in and out (the avx512 variant's prefill: gate_up's oneDNN output is bf16 already and the
// down product takes bf16): each row widened to float32, the same math, rounded once.
at::Tensor silu_mul_bf16(const at::Tensor& x) {
  const int64_t m = x.size(0), n = x.size(1) / 2;
  at::Tensor out = at::empty({m, n}, x.options());
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> row;  // [gate | up | out], grown once per pool thread
    row.resize(3 * n);
    for (int64_t i = begin; i < end; ++i) {
      const at::BFloat16* xr = xp + i * 2 * n;
      widen_row(xr, row.data(), 2 * n);
      silu_mul_row(row.data(), row.data() + n, n, row.data() + 2 * n);
      store_row(row.data() + 2 * n, op + i * n, n);
    }
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x must be [M, 2 * I]");
  if (x.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
    return silu_mul_bf16(x);
  }
  check_f32(x, "x");
  const int64_t m = x.size(0), n = x.size(1) / 2;
  at::Tensor out = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) silu_mul_row(xp + i * 2 * n, xp + i * 2 * n + n, n, op + i * n);
  });
  return out;
}

// w8a8's products take x as u8 codes with a scale per group (matvec.h quantize_row_u8). Why these: a
// norm's or SiLU's float32 rows (1.2 MB for a 512-token prompt at SmolLM2's 576, 3.1 MB out of
// SiLU at 1,536) were written out, then read back by linear_panels_i8 to be quantized, after the
// product before had pushed them out of L2 (the norm took ~240 us a call inside a prefill against
// ~60 us alone). Here each row is quantized while it is still in L1, and only its codes (a
// quarter of the bytes) and scales are written: the codes linear_panels_i8 would have made of
// the same float32 row, bit for bit (`linear_panels_i8_q` multiplies them).
std::tuple<at::Tensor, at::Tensor> q8_outputs(const at::Tensor& like, int64_t t, int64_t n) {
  return {at::empty({t, inferlab_matvec::i8_groups(n) * inferlab_matvec::kI8Group}, like.options().dtype(at::kByte)),
          at::empty({t, inferlab_matvec::i8_scale_groups(n)}, like.options().dtype(at::kFloat))};
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_q8_(at::Tensor x, const at::Tensor& residual, const at::Tensor& weight,
                                                    double eps) {
  check_f32(x, "x");
  check_f32(residual, "residual");
  check_f32(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes(), "x and residual must be the same [T, hidden]");
  const int64_t t = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.numel() == n, "weight must have ", n, " elements");
  auto [codes, scales] = q8_outputs(x, t, n);
  const int64_t ld = codes.size(1), groups = scales.size(1);
  float* xp = x.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  float* sp = scales.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> row;  // the normed row, then its codes
    row.resize(n);
    for (int64_t i = begin; i < end; ++i) {
      float* xr = xp + i * n;
      add_row(xr, rp + i * n, n);
      rms_norm_row(xr, wp, n, feps, row.data());
      inferlab_matvec::quantize_row_u8(row.data(), n, cp + i * ld, sp + i * groups);
    }
  });
  return {codes, scales};
}

std::tuple<at::Tensor, at::Tensor> silu_mul_q8(const at::Tensor& x) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x must be [M, 2 * I]");
  const int64_t m = x.size(0), n = x.size(1) / 2;
  auto [codes, scales] = q8_outputs(x, m, n);
  const int64_t ld = codes.size(1), groups = scales.size(1);
  const float* xp = x.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  float* sp = scales.data_ptr<float>();
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> row;
    row.resize(n);
    for (int64_t i = begin; i < end; ++i) {
      silu_mul_row(xp + i * 2 * n, xp + i * 2 * n + n, n, row.data());
      inferlab_matvec::quantize_row_u8(row.data(), n, cp + i * ld, sp + i * groups);
    }
  });
  return {codes, scales};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferlab, m) {
  m.def("add_rms_norm_(Tensor(a!) x, Tensor residual, Tensor weight, float eps, bool bf16_out=False) -> Tensor");
  m.def("rope_write_kv(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slots, int num_heads, int num_kv_heads, int head_dim, "
        "Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("add_rms_norm_q8_(Tensor(a!) x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul_q8(Tensor x) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(inferlab, CPU, m) {
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("rope_write_kv", &rope_write_kv);
  m.impl("silu_mul", &silu_mul);
  m.impl("add_rms_norm_q8_", &add_rms_norm_q8_);
  m.impl("silu_mul_q8", &silu_mul_q8);
}
