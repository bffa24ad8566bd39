"""Linear layers whose weights are stored in fewer bits than they are multiplied in.

A decode step reads every weight once for a few rows of activations, so its time is the time
to read the weights: `WeightOnlyLinear` keeps them in float16 / bfloat16 (half of float32's
bytes) or int8 with one float32 scale per output row (a quarter), and multiplies in the
activations' dtype (float32 on a CPU without fast 16-bit arithmetic; on AVX512-BF16 the
kernels multiply bf16 weights in bf16 with float32 sums, see `bf16_products`). Our C++ kernels
(csrc/linear.cpp) convert the weights in registers, so they are read from memory once per call;
without the kernels (the engine's `KernelInfo` says none loaded, or activations are not float32
on the CPU) the same math runs in plain torch: dequantize, then `F.linear`.

`Int4Linear` (a WeightOnlyLinear) stores 4-bit group-wise weights (kernels/int4.py's format)
and multiplies them with integer dot products on x quantized per group of 32 (csrc/q4.h).

`DenseLinear` is the other implementation of the same small interface (`__call__`, `rows`,
`nbytes`): the weight in the compute dtype and `F.linear`, exactly as before weight-only storage.
`make_linear` picks one from the engine's `ResolvedPrecision` (models/precision.py): what the
weights are stored and computed in and which kernels this process has are decided there, once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from inferlab.kernels import build
from inferlab.kernels.int4 import INT4, Int4Weight, quantize

if TYPE_CHECKING:
    from inferlab.models.kv_cache import KVCache
    from inferlab.models.precision import ResolvedPrecision

__all__ = ["DenseLinear", "Int4Linear", "WeightOnlyLinear", "bucket_rows", "linear", "make_linear", "pack_panels",
           "pack_panels_i8", "panel_corrections_i8", "quantize_int8", "unpack_panels"]

# The storage dtypes WeightOnlyLinear takes; torch.int8 means symmetric per-output-row scales.
STORED_DTYPES = (torch.float16, torch.bfloat16, torch.int8)

# From this many rows of x on, the kernels hand float32 tiles of the weight to torch's GEMM
# (compute-bound there) instead of running our micro-kernel. Measured on one core of this AVX2
# EPYC with SmolLM2-135M's shapes: our kernel is ahead of float32 F.linear up to M ~ 128 and
# ~15-20% behind it at 256-512, where the GEMM on converted tiles is within 1-5% of it.
MKL_MIN_ROWS = 128

# The same switch for 16-bit weights multiplied in float32 (linear_w16: the AVX2 machines' default,
# --dtype float32 anywhere): our kernel has since caught up. SmolLM2's gate/up + down + qkv, 2
# threads, float16 weights, medians of 5 (2026-12-03, Zen 4): held to AVX2 (the avx2 variant,
# oneDNN and MKL too), ours against the GEMM 2.63 / 3.31 ms at 128 rows, 5.59 / 6.35 at 256, 8.46 /
# 8.71 at 384, 11.08 / 10.60 at 512; the avx512 variant 2.30 / 3.00 at 128, 4.82 / 5.05 at 256,
# 7.83 / 7.39 at 384. So the GEMM from 256 rows. Below it are speculative decoding's verifying
# steps (32 streams with 4 drafts: 160 rows), which then multiply as a plain decode step does.
W16_MKL_MIN_ROWS = 256

# From this many rows of x on, the avx512 kernels multiply int8 weight-only codes as bf16 tiles by
# vdpbf16ps, x rounded to bf16 (csrc/matvec.h kI8Bf16MinRows, the same number): converting the
# codes to float32 in registers made 32 rows 3x slower than bf16 weights.
INT8_BF16_MIN_ROWS = 4

_FP16_MAX = torch.finfo(torch.float16).max
INT8_GROUP = 64  # k values w8a8's panels are padded to (csrc/matvec.h's kI8Group; x's scales: KernelInfo)


# torch's 16-bit GEMMs on the CPU go to oneDNN, which builds one primitive per (M, N, K) and keeps
# it in a cache of up to 1024 (~0.6 MB each for SmolLM2-135M's shapes, heaptrack). A step's
# token count is its M, and under varied traffic almost every step brings a new one: ~0.6 GB of
# RSS before the cache is full. Padding M up to one of 8 buckets per power of two (at most 12.5%
# extra rows, or 7 below 64 rows) leaves ~48 Ms up to 2048 rows, so the cache stays at a few hundred primitives.
ONEDNN_DTYPES = (torch.bfloat16, torch.float16)


def bucket_rows(m: int) -> int:
    """`m` rounded up to a multiple of max(8, 2**(bit_length(m) - 4)): 8, 16, .., 128, 144, .., 256, 288, .."""
    step = max(8, 1 << max(m.bit_length() - 4, 0))
    return -(-m // step) * step


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; a 16-bit product on the CPU gets its rows zero-padded to `bucket_rows` first (rows
    are independent: the padding only adds rows of output, which are dropped)."""
    if x.dtype not in ONEDNN_DTYPES or x.device.type != "cpu" or x.dim() != 2:
        return F.linear(x, weight, bias)
    m = x.shape[0]
    padded = bucket_rows(m)
    if padded == m:
        return F.linear(x, weight, bias)
    xp = x.new_zeros((padded, x.shape[1]))
    xp[:m] = x
    return F.linear(xp, weight, bias)[:m]


PANEL = 16  # output columns per panel of bf16 weights (csrc/matvec.h kPanel)


def _to_panels(weight: torch.Tensor, k_multiple: int, run: int) -> torch.Tensor:
    """[N, K] as panels of PANEL output columns, each [Kp / run, PANEL, run] (runs of `run`
    consecutive k, one instruction's operand; Kp = K rounded up to `k_multiple`), zero-padded."""
    n, k = weight.shape
    np_, kp = -(-n // PANEL) * PANEL, -(-k // k_multiple) * k_multiple
    padded = F.pad(weight, (0, kp - k, 0, np_ - n))
    return padded.view(np_ // PANEL, PANEL, kp // run, run).permute(0, 2, 1, 3).contiguous()


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 [N, K] matrix as the AVX-512 kernels multiply it (csrc/matvec.h): panels of 16
    output columns, each [Kp / 2, 16, 2] (pairs of consecutive k, vdpbf16ps's operand; Kp = K
    rounded up to even), zero-padded to whole panels: [ceil(N / 16), Kp / 2, 16, 2]."""
    return _to_panels(weight, 2, 2)


def pack_panels_i8(codes: torch.Tensor, xor: int = 0) -> torch.Tensor:
    """int8 codes [N, K] as the w8a8 kernels multiply them (csrc/matvec.h panel_products_i8):
    panels of 16 output columns, each [Kq / 4, 16, 4] (quads of consecutive k, vpdpbusd's
    operand; Kq = K rounded up to whole groups of INT8_GROUP), zero-padded to whole panels;
    each byte xor `xor` (128 on AVX2: u = w + 128, vpmaddubsw's unsigned operand, padding too)."""
    panels = _to_panels(codes, INT8_GROUP, 4)
    return panels ^ _signed_byte(xor) if xor else panels


def _signed_byte(v: int) -> int:
    """A byte's bits as the int8 value torch's xor takes (128 -> -128)."""
    return v - 256 if v >= 128 else v


def unpack_panels(panels: torch.Tensor, n: int, k: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """`pack_panels`' and `pack_panels_i8`'s way back: the [N, K] matrix, or only its rows `ids`
    (an embedding lookup from a tied lm_head's panels reads just those)."""
    if ids is None:
        return panels.permute(0, 2, 1, 3).reshape(panels.shape[0] * PANEL, -1)[:n, :k]
    return panels[ids // PANEL, :, ids % PANEL, :].reshape(ids.numel(), -1)[:, :k]


def panel_corrections_i8(panels: torch.Tensor) -> torch.Tensor:
    """-128 x each column's code sums per group of INT8_GROUP k, [panels, groups, 16] int32: the
    start of vpdpbusd's group sums (x is stored as q + 128), which are then exact."""
    p, quads = panels.shape[:2]
    groups = quads * 4 // INT8_GROUP
    sums = panels.view(p, groups, INT8_GROUP // 4, PANEL, 4).sum((2, 4), dtype=torch.int32)
    return (sums * -128).contiguous()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: scale = max|w_row| / 127, q = round(w / scale).

    Per row rather than per tensor: rows of a projection can differ widely in range (orders of
    magnitude), and a row's scale multiplies its output once, after the dot product.
    An all-zero row gets scale 1 (its codes are 0 either way) so nothing divides by zero.
    """
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


class DenseLinear:
    """The weight in the compute dtype: F.linear, the path every float32 test runs."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight.contiguous()
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the weight (an embedding lookup when the matrix is a tied lm_head)."""
        return self.weight.index_select(0, ids)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.weight, self.bias)


class WeightOnlyLinear:
    """y = x @ W^T (+ bias), W stored as float16, bfloat16 or int8 (+ per-row scales).

    Built from a weight in any float dtype; `compute_dtype` is what `rows()` returns. Calls with
    float32 activations on the CPU take our kernels where `kernel` (the engine's; None: this
    process's, `build.kernel_info()`) has them; anything else takes the fallback, the same math
    in plain torch.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        stored_dtype: torch.dtype,
        bias: torch.Tensor | None = None,
        compute_dtype: torch.dtype = torch.float32,
        kernel: build.KernelInfo | None = None,
        int8_activations: bool = False,
    ):
        if weight.dim() != 2:
            raise ValueError(f"a linear weight must be a [out, in] matrix, got shape {tuple(weight.shape)}")
        if stored_dtype not in STORED_DTYPES:
            raise ValueError(f"stored_dtype must be float16, bfloat16 or int8, not {stored_dtype}")
        self.compute_dtype = compute_dtype
        self.scale: torch.Tensor | None = None
        self.out_features, self.in_features = weight.shape
        kernel = build.kernel_info() if kernel is None else kernel
        # The AVX-512 variant multiplies bf16 weights in bf16 (vdpbf16ps): x is rounded to bf16
        # first, the sums stay float32. Its weights are kept in panels (`pack_panels`), the one
        # copy every row count multiplies; elsewhere the products are float32's.
        self.bf16_products = stored_dtype == torch.bfloat16 and kernel.bf16_dot
        if stored_dtype == torch.int8:
            self.weight, self.scale = quantize_int8(weight)
        else:
            if stored_dtype == torch.float16:
                peak = float(weight.abs().max()) if weight.numel() else 0.0
                if peak > _FP16_MAX:  # would become inf; bfloat16 has float32's range
                    raise ValueError(
                        f"a weight of magnitude {peak:.4g} does not fit float16 (max {_FP16_MAX}); "
                        "store the weights as bfloat16 or float32 (--weight-dtype)"
                    )
            self.weight = weight.to(stored_dtype).contiguous()
            if self.bf16_products:
                self.weight = pack_panels(self.weight)
        # Kept in float32, as the kernels take it; the fallback casts it to the activations' dtype.
        self.bias = bias.float().contiguous() if bias is not None else None
        self.use_kernels = kernel.available
        # SiLU(gate) * up can come straight from the products of a [gate; up] weight
        # (`product_silu_bf16`: the amx variant's tiles, the avx512 variant's panel products into a
        # buffer in cache): bf16 panels, no bias, each half whole panels.
        self.silu_tiles = (self.bf16_products and bias is None and self.out_features % 32 == 0
                           and (self.in_features + 1) // 2 * 2 % 32 == 0)
        # From MKL_MIN_ROWS rows on, int8 weights (as bf16 codes x scales) go to oneDNN's bf16
        # GEMM there: x and the output rounded to bf16.
        self.bf16_gemm = stored_dtype == torch.int8 and kernel.bf16_dot
        # w8a8 (`int8_x`): x is quantized per group on the fly (symmetric; kernel.int8_x_group
        # values per scale, codes up to kernel.int8_x_max) and the integer dot product
        # (kernel.int8_dot) runs on the stored codes, kept in panels (`pack_panels_i8`,
        # `i8_panels`), the one copy every row count multiplies. On AVX-512 x goes in as unsigned
        # bytes (q + 128): -128 x the weight's group sums (`row_sums`), computed here once, undo
        # that offset. On AVX2 the panels hold the codes with their sign bit flipped (u = w + 128,
        # vpmaddubsw's unsigned operand; kernel.int8_panel_xor) and the kernel takes the offset
        # off with x's own sums: `row_sums` is empty there.
        self.row_sums: torch.Tensor | None = None
        if int8_activations and stored_dtype != torch.int8:
            raise ValueError("int8_activations needs int8 weights")
        self.int8_x = int8_activations and bool(kernel.int8_dot)
        self.i8_panels = self.int8_x
        self.panel_xor = kernel.int8_panel_xor if self.i8_panels else 0
        if self.i8_panels:
            self.weight = pack_panels_i8(self.weight, self.panel_xor)
            self.row_sums = (panel_corrections_i8(self.weight) if not self.panel_xor
                             else torch.empty(0, dtype=torch.int32))
            self.bf16_gemm = False
        # w8a8's the same (`product_silu_q8`), from the amx variant's tiles or the panel products
        # into a buffer in cache: each half whole groups of 64 (its output groups are the down
        # product's scales, the last of them what is left).
        self.silu_tiles_q8 = self.i8_panels and bias is None and self.out_features % 128 == 0

    @property
    def bf16_x_min_rows(self) -> int | None:
        """From how many rows of x the kernels round x to bf16 (None: never; the products are
        float32's): 1 for bf16 products, INT8_BF16_MIN_ROWS for int8 weight-only codes on the
        avx512 variant, MKL_MIN_ROWS where only the oneDNN GEMM does."""
        if self.bf16_products:
            return 1
        if self.i8_panels:
            return None
        if not self.int8_x and self.scale is not None and self.bf16_gemm:
            return INT8_BF16_MIN_ROWS
        return MKL_MIN_ROWS if self.bf16_gemm else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernels and x.dtype == torch.float32 and x.device.type == "cpu":
            return self.kernel(x)
        return self.fallback(x)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """Our C++ kernels: float32 x only. Where they hand the rows to oneDNN's bf16 GEMM
        (`bf16_gemm`, from MKL_MIN_ROWS rows), the rows are padded to `bucket_rows` first, as
        `linear` does for torch's own 16-bit GEMMs: one cached primitive per row count."""
        m = x.shape[0]
        if self.bf16_gemm and x.dim() == 2 and m >= MKL_MIN_ROWS and bucket_rows(m) != m:
            xp = x.new_zeros((bucket_rows(m), x.shape[1]))
            xp[:m] = x
            return self.product(xp)[:m]
        return self.product(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        ops = torch.ops.inferlab
        if self.bf16_products:
            return ops.linear_panels(x, self.weight, self.out_features, self.bias)
        if self.i8_panels:
            return ops.linear_panels_i8(x, self.weight, self.row_sums, self.scale, self.out_features, self.bias)
        if self.scale is not None:
            return ops.linear_w8(x, self.weight, self.scale, self.bias, MKL_MIN_ROWS)
        return ops.linear_w16(x, self.weight, self.bias, W16_MKL_MIN_ROWS)

    def product_bf16(self, x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """x @ W^T (+ bias) for bf16 products, x given in float32 or bf16, the output bf16 or
        float32: what `kernel` computes, for callers that pass bf16 between operators (silu_mul,
        add_rms_norm_) instead of widening to float32 and rounding again on the way in."""
        if not self.bf16_products:
            raise ValueError("product_bf16 needs bf16 weights on a kernel variant with bf16 products")
        return torch.ops.inferlab.linear_panels(x, self.weight, self.out_features, self.bias,
                                                out_dtype == torch.bfloat16)

    def product_rope_kv(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        cache: KVCache, slots: torch.Tensor, heads: int, kv_heads: int,
                        head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A qkv weight's product with RoPE and the KV-cache write as its epilogue: (q, k, v),
        float32 [T, heads or kv_heads, head_dim], q and k rotated, k and v written at `slots`:
        the bits of product_bf16(x, float32) then fused.cpp's rope_write_kv, without the
        product written out whole and read back."""
        if not self.bf16_products:
            raise ValueError("product_rope_kv needs bf16 weights on a kernel variant with bf16 products")
        return torch.ops.inferlab.linear_panels_rope_kv(x, self.weight, self.bias, positions, cos, sin, cache.k,
                                                        cache.v, slots, heads, kv_heads, head_dim, cache.k_scale,
                                                        cache.v_scale)

    def product_rope_kv_q8(self, xq: torch.Tensor, sx: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor, cache: KVCache, slots: torch.Tensor, heads: int, kv_heads: int,
                           head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """w8a8's product_rope_kv from x's codes: the bits of product_q8 then rope_write_kv."""
        if not self.i8_panels:
            raise ValueError("product_rope_kv_q8 needs w8a8 weights (in panels)")
        return torch.ops.inferlab.linear_panels_i8_q_rope_kv(
            xq, sx, self.in_features, self.weight, self.row_sums, self.scale, self.bias, positions, cos, sin, cache.k,
            cache.v, slots, heads, kv_heads, head_dim, cache.k_scale, cache.v_scale)

    def product_silu_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x @ W_gate^T) * (x @ W_up^T) in bf16 for a [gate; up] weight (`silu_tiles`): the bits
        of silu_mul(product_bf16(x)), without the [M, 2I] product written out and read back."""
        if not self.silu_tiles:
            raise ValueError("product_silu_bf16 needs bf16 panels of a [gate; up] weight without a bias, each half "
                             "whole panels")
        return torch.ops.inferlab.linear_panels_silu(x, self.weight, self.out_features)

    def product_silu_q8(self, xq: torch.Tensor, sx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """w8a8: SiLU(gate) * up of a [gate; up] weight (`silu_tiles_q8`), from x's codes, as the
        down product's codes and scales: the bits of silu_mul_q8(product_q8(xq, sx))."""
        if not self.silu_tiles_q8:
            raise ValueError("product_silu_q8 needs w8a8 panels of a [gate; up] weight without a bias, "
                             "each half whole groups of 64")
        return torch.ops.inferlab.linear_panels_i8_silu_q(xq, sx, self.in_features, self.weight, self.row_sums,
                                                          self.scale, self.out_features)

    def product_q8(self, xq: torch.Tensor, sx: torch.Tensor) -> torch.Tensor:
        """x @ W^T (+ bias) from x already quantized for w8a8's panels (u8 codes in groups of 64,
        a scale per kernel.int8_x_group values, as fused.cpp's add_rms_norm_q8_ and silu_mul_q8
        make them): the bits `kernel` gives for the float32 rows those codes were made from."""
        if not self.i8_panels:
            raise ValueError("product_q8 needs w8a8 weights (in panels)")
        return torch.ops.inferlab.linear_panels_i8_q(xq, sx, self.in_features, self.weight, self.row_sums, self.scale,
                                                     self.out_features, self.bias)

    @property
    def fused_argmax(self) -> bool:
        """`argmax` runs without the product written whole (w8a8's or bf16 panels on our kernels)."""
        return (self.i8_panels or self.bf16_products) and self.use_kernels

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's argmax of `self(x)` (float32 x [M, K]), int64 [M], the first index of the
        largest, as the sampler's greedy token: the product's own bits, never written whole
        (linear.cpp linear_panels_i8_argmax / linear_panels_argmax) where `fused_argmax`, else
        from `self(x)`."""
        if self.fused_argmax and x.dtype == torch.float32 and x.device.type == "cpu":
            ops = torch.ops.inferlab
            if self.i8_panels:
                return ops.linear_panels_i8_argmax(x, self.weight, self.row_sums, self.scale, self.out_features,
                                                   self.bias)
            return ops.linear_panels_argmax(x, self.weight, self.out_features, self.bias)
        return self(x).float().argmax(dim=-1)

    def fallback(self, x: torch.Tensor) -> torch.Tensor:
        """Plain torch, same math: the weight dequantized to x's dtype, then F.linear."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return linear(x, self.dequantized(x.dtype), bias)

    def codes(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The stored values as an [N, K] matrix (int8 codes, or 16-bit weights), or its rows
        `ids`, whichever layout holds them."""
        n, k = self.out_features, self.in_features
        if self.bf16_products or self.i8_panels:
            codes = unpack_panels(self.weight, n, k, ids)
            return codes ^ _signed_byte(self.panel_xor) if self.panel_xor else codes
        return self.weight if ids is None else self.weight.index_select(0, ids)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as the products see it: codes x scales for int8, the 16-bit values as is."""
        if self.scale is None:
            return self.codes().to(dtype)
        return (self.codes().float() * self.scale[:, None]).to(dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows in the compute dtype: an embedding lookup from the stored table, so a
        tied embedding needs no second, full-precision copy."""
        if (self.bf16_products or self.i8_panels) and self.compute_dtype == torch.float32:
            # one call, not five (at one decode stream a dispatch is ~3% of the Python around the step)
            return torch.ops.inferlab.panel_rows(self.weight, ids, self.in_features, self.scale)
        r = self.codes(ids).to(self.compute_dtype)
        if self.scale is not None:
            r = r * self.scale.index_select(0, ids).to(self.compute_dtype)[:, None]
        return r

    @property
    def nbytes(self) -> int:
        return _nbytes(self.weight, self.scale, self.bias)


class Int4Linear(WeightOnlyLinear):
    """y = x @ W^T (+ bias), W in 4 bits per weight with a float16 (d, m) per group of 32 (int4.py).

    `weight` and `scale` are the codes (uint8 [N, K / 2]) and the (d, m) pairs (float16
    [N, K / 32, 2]): what DecoderStep takes in the places of an int8 weight and its scales.
    Built from float weights (quantized here) or an Int4Weight as it is (a GGUF's Q4 blocks).
    Below MKL_MIN_ROWS rows the kernels quantize x per group of 32 to int8 and run the integer
    dot product on the codes (vpdpbusd / vpmaddubsw); from there the weight is dequantized in
    tiles for the GEMM (bf16 through oneDNN on AVX-512, float32 through at::mm on AVX2). The
    fallback dequantizes and calls F.linear: float32 x, so it differs from the kernels by x's
    int8 rounding only.
    """

    def __init__(
        self,
        weight: torch.Tensor | Int4Weight,
        bias: torch.Tensor | None = None,
        compute_dtype: torch.dtype = torch.float32,
        kernel: build.KernelInfo | None = None,
    ):
        self.q = weight if isinstance(weight, Int4Weight) else quantize(weight)
        self.compute_dtype = compute_dtype
        self.weight, self.scale = self.q.codes, self.q.dm
        self.bias = bias.float().contiguous() if bias is not None else None
        kernel = build.kernel_info() if kernel is None else kernel
        self.use_kernels = kernel.available
        self.bf16_products = False
        self.bf16_gemm = kernel.bf16_dot
        self.row_sums = None
        self.int8_x = self.i8_panels = False
        self.panel_xor = 0

    @property
    def bf16_x_min_rows(self) -> int | None:
        """x is rounded to int8 per 32 below MKL_MIN_ROWS rows (not to bf16); only the oneDNN
        tiles from there round it to bf16."""
        return MKL_MIN_ROWS if self.bf16_gemm else None

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.inferlab.linear_w4(x, self.weight, self.scale, self.bias, MKL_MIN_ROWS)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.q.dequantize(dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.q.index_select(ids).dequantize(self.compute_dtype)


def make_linear(
    weight: torch.Tensor | Int4Weight,
    bias: torch.Tensor | None,
    precision: ResolvedPrecision,
    stored_dtype: torch.dtype | None = None,
) -> DenseLinear | WeightOnlyLinear:
    """The layer `precision` asks for: DenseLinear when the weight is stored in the compute dtype,
    Int4Linear for int4.INT4 (from float weights or an Int4Weight), else WeightOnlyLinear.
    `stored_dtype`: another storage than `precision.weights`, weight-only (float x): an int4
    model's int8 embedding table."""
    compute_dtype, kernel = precision.compute, precision.kernel
    int8_activations = precision.int8_activations and stored_dtype is None
    stored_dtype = precision.weights if stored_dtype is None else stored_dtype
    if stored_dtype == INT4:
        return Int4Linear(weight, bias, compute_dtype, kernel)
    if isinstance(weight, Int4Weight):
        weight = weight.dequantize(compute_dtype)
    if stored_dtype == compute_dtype:
        return DenseLinear(weight.to(compute_dtype), None if bias is None else bias.to(compute_dtype))
    if stored_dtype not in STORED_DTYPES:
        raise ValueError(
            f"weights stored as {stored_dtype} with compute in {compute_dtype}: weight-only storage "
            "is float16, bfloat16, int8 or int4"
        )
    return WeightOnlyLinear(weight, stored_dtype, bias, compute_dtype, kernel, int8_activations)


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.nbytes for t in tensors if t is not None)
