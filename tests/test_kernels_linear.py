"""Weight-only linear layers: our C++ kernels against a float64 product of the dequantized
weight, the plain-torch fallback against the kernels, int8's quantization error, the weight
dtype "auto" resolves to, and the engine with 16-bit weights against its float32 run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from epilogue_checks import assert_same_logprobs_with_the_path_off
from kernel_marks import needs_int8_dot

from inferlab import LLM, SamplingParams
from inferlab.config import CacheConfig, LoadConfig
from inferlab.kernels import build
from inferlab.kernels.linear import (
    MKL_MIN_ROWS,
    W16_MKL_MIN_ROWS,
    DenseLinear,
    WeightOnlyLinear,
    make_linear,
    pack_panels,
    pack_panels_i8,
    panel_corrections_i8,
    quantize_int8,
    unpack_panels,
)
from inferlab.models.precision import resolve_precision
from inferlab.models.testing import make_tiny_hf_model

STORED = [torch.float16, torch.bfloat16, torch.int8]
PLAIN = build.KernelInfo("none", (), "plain torch in this test")
# Odd sizes: K not a multiple of 8 (the kernels' vector width) and N not of 4 (their row block).
SHAPES = [(37, 45), (130, 576)]
ROWS = list(range(1, 21)) + [512]

needs_kernels = pytest.mark.skipif(
    not build.available(), reason=f"inferlab CPU kernels unavailable: {build.unavailable_reason() or '?'}"
)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)  # every random input here is the same on every run


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, 0] *= 20  # an outlier column, as real projections have
    return w


def _reference(x: torch.Tensor, lin: WeightOnlyLinear, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 product of the dequantized weight, and the error bound a float32 sum may reach.
    With `lin.bf16_products` (AVX512-BF16), or int8 codes from `lin.bf16_x_min_rows` rows of x, the
    product of x rounded to bf16, as the kernel defines it, and from MKL_MIN_ROWS `rows` on
    oneDNN's bf16 output rounding (half an ulp)."""
    gemm = lin.bf16_gemm and rows >= MKL_MIN_ROWS  # oneDNN: bf16 x, bf16 weights, bf16 output
    w = lin.dequantized(torch.bfloat16 if gemm else torch.float32).double()
    xs = x.bfloat16().double() if gemm or _tiles_round_x(lin, x.reshape(-1, x.shape[-1]).shape[0]) else x.double()
    y = xs @ w.T
    # float32 accumulation over K terms: a few ulps of the sum of magnitudes.
    bound = 1e-5 * (xs.abs() @ w.abs().T) + 1e-6
    if gemm:
        bound = bound + y.abs() * 2.0**-8 * 1.01
    if lin.bias is not None:
        y = y + lin.bias.double()
    return y, bound


def _tiles_round_x(lin: WeightOnlyLinear, m: int) -> bool:
    """Whether our micro-kernel (below MKL_MIN_ROWS rows, or forced) rounds these m rows of x to
    bf16: from `lin.bf16_x_min_rows` rows, when that is below MKL_MIN_ROWS."""
    lo = lin.bf16_x_min_rows
    return lo is not None and lo < MKL_MIN_ROWS and m >= lo


def _check(y: torch.Tensor, x: torch.Tensor, lin: WeightOnlyLinear, rows: int | None = None) -> None:
    ref, bound = _reference(x, lin, x.reshape(-1, x.shape[-1]).shape[0] if rows is None else rows)
    assert y.dtype == torch.float32 and y.shape == ref.shape
    err = (y.double() - ref).abs()
    worst = int(err.argmax())
    assert bool((err <= bound).all()), (
        f"max error {float(err.flatten()[worst]):.3g}, its bound {float(bound.flatten()[worst]):.3g}")


@needs_kernels
@pytest.mark.parametrize("stored", STORED, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_kernel_matches_dequantized_reference(stored, shape, with_bias):
    n, k = shape
    bias = torch.randn(n) if with_bias else None
    lin = WeightOnlyLinear(_weight(n, k), stored, bias)
    g = torch.Generator().manual_seed(1)
    for m in ROWS:
        x = torch.randn(m, k, generator=g)
        _check(lin(x), x, lin)  # the path MKL_MIN_ROWS picks
        # and each path forced, whatever M is: our micro-kernel, then float32 tiles through torch's GEMM
        for min_rows in (1 << 30, 1):
            if lin.bf16_products:  # bf16 weights in panels: one kernel for every row count
                y = torch.ops.inferlab.linear_panels(x, lin.weight, n, lin.bias)
            elif stored == torch.int8:
                y = torch.ops.inferlab.linear_w8(x, lin.weight, lin.scale, lin.bias, min_rows)
            else:
                y = torch.ops.inferlab.linear_w16(x, lin.weight, lin.bias, min_rows)
            _check(y, x, lin, rows=0 if min_rows > m else MKL_MIN_ROWS)


@needs_kernels
def test_16bit_weights_in_float32_stay_on_our_kernel_below_their_gemm_switch():
    """float32 products of float16 weights take our micro-kernel below W16_MKL_MIN_ROWS rows
    (32 streams verifying 4 drafts each: 160), so a verifying step multiplies as a decode step
    does; torch's GEMM from there. The two differ in float32 rounding, so each is told apart."""
    lin = WeightOnlyLinear(_weight(130, 576), torch.float16, torch.randn(130))
    for m in (160, W16_MKL_MIN_ROWS - 1, W16_MKL_MIN_ROWS):
        x = torch.randn(m, 576)
        ours = torch.ops.inferlab.linear_w16(x, lin.weight, lin.bias, 1 << 30)
        gemm = torch.ops.inferlab.linear_w16(x, lin.weight, lin.bias, 1)
        assert not torch.equal(ours, gemm)
        assert torch.equal(lin(x), ours if m < W16_MKL_MIN_ROWS else gemm), m


@needs_kernels
def test_kernel_takes_any_leading_dims_and_strides():
    lin = WeightOnlyLinear(_weight(21, 40), torch.float16, torch.randn(21))
    x = torch.randn(40, 2, 3).permute(1, 2, 0)  # [2, 3, 40], not contiguous
    y = lin(x)
    assert y.shape == (2, 3, 21)
    _check(y.reshape(6, 21), x.reshape(6, 40), lin)
    assert lin(torch.randn(0, 40)).shape == (0, 21)


@needs_kernels
def test_kernel_rejects_mismatched_inputs():
    w = torch.zeros(8, 16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.inferlab.linear_w16(torch.zeros(2, 15), w)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.inferlab.linear_w16(torch.zeros(2, 16, dtype=torch.float64), w)
    with pytest.raises(RuntimeError, match="int8"):
        torch.ops.inferlab.linear_w8(torch.zeros(2, 16), w, torch.ones(8))
    with pytest.raises(RuntimeError, match="scale"):
        torch.ops.inferlab.linear_w8(torch.zeros(2, 16), w.to(torch.int8), torch.ones(7))


@needs_kernels
@pytest.mark.parametrize("stored", STORED, ids=str)
def test_fallback_equals_kernel(stored):
    w, bias = _weight(67, 93, seed=3), torch.randn(67)
    fast = WeightOnlyLinear(w, stored, bias)
    plain = WeightOnlyLinear(w, stored, bias, kernel=PLAIN)
    for m in (1, 5, 17, 300):
        x = torch.randn(m, 93)
        gemm = fast.bf16_gemm and m >= MKL_MIN_ROWS
        if gemm or _tiles_round_x(fast, m):  # the fallback's float32 products of the x the kernel multiplies
            xb = x.bfloat16().float()
            w = plain.dequantized(torch.bfloat16).float() if gemm else plain.dequantized()
            want = F.linear(xb, w, plain.bias)
            out_rounding = 2.0**-8 * (xb @ w.T).abs() if gemm else 0.0  # the bias is added after
            assert bool(((fast(x) - want).abs() <= 1e-5 * (1 + want.abs()) + out_rounding * 1.01).all())
        else:
            torch.testing.assert_close(fast(x), plain(x), rtol=1e-5, atol=1e-5)


# ---- the fallback and the storage: no kernels needed ---------------------------------------


@pytest.mark.parametrize("stored", STORED, ids=str)
def test_fallback_is_flinear_of_the_dequantized_weight(stored):
    w, bias = _weight(19, 33), torch.randn(19)
    lin = WeightOnlyLinear(w, stored, bias, kernel=PLAIN)
    x = torch.randn(4, 33)
    assert lin.weight.dtype == stored
    _check(lin(x), x, lin)
    # Built here from the stored codes, not through lin.dequantized() (which the fallback calls).
    w_seen = lin.weight.float() * lin.scale[:, None] if stored == torch.int8 else w.to(stored).float()
    torch.testing.assert_close(lin(x), F.linear(x, w_seen, bias), rtol=0, atol=0)
    # Activations in another dtype (a bf16-compute engine) take the fallback, in that dtype.
    assert lin(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_int8_quantization_error_is_bounded():
    w = _weight(64, 200)
    w[5] = 0.0  # an all-zero row must not divide by zero
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (64,) and bool(torch.isfinite(scale).all())
    rows = torch.arange(64) != 5
    torch.testing.assert_close(scale[rows], w[rows].abs().amax(1) / 127)  # per output row, symmetric
    assert bool((q[rows].abs().amax(1) == 127).all())  # each row's largest weight uses the full range
    deq = q.float() * scale[:, None]
    assert bool(((deq - w).abs() <= scale[:, None] / 2 * (1 + 1e-5)).all())  # round to nearest: half a step
    assert bool((deq[5] == 0).all())
    # So each output is off by at most sum_k |x_k| * scale_n / 2.
    lin = WeightOnlyLinear(w, torch.int8, kernel=PLAIN)
    x = torch.randn(8, 200, generator=torch.Generator().manual_seed(2))
    err = (lin(x) - x @ w.T).abs()
    assert bool((err <= x.abs().sum(1, keepdim=True) * scale / 2 * (1 + 1e-4) + 1e-5).all())


@pytest.mark.parametrize("stored", STORED, ids=str)
@pytest.mark.parametrize("kernel", ["plain", "this machine's"])
def test_rows_are_the_dequantized_rows(stored, kernel):
    lin = WeightOnlyLinear(_weight(50, 24), stored, kernel=PLAIN if kernel == "plain" else None)
    ids = torch.tensor([3, 0, 49, 3])
    rows = lin.rows(ids)
    assert rows.dtype == torch.float32
    torch.testing.assert_close(rows, lin.dequantized()[ids], rtol=0, atol=0)


# ---- bf16 weights in panels (the AVX-512 BF16 variant's layout) ------------------------------

BF16_PANELS = pytest.mark.skipif(
    not build.kernel_info().bf16_dot,
    reason=f"bf16 panels are the AVX512_BF16 variant's layout; this process has {build.kernel_info().variant}")


@pytest.mark.parametrize("shape", [(1, 2), (17, 45), (50, 24), (96, 576)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_panels_pack_and_unpack_exactly(shape):
    n, k = shape
    w = _weight(n, k).bfloat16()
    p = pack_panels(w)
    assert p.shape == (-(-n // 16), -(-k // 2), 16, 2) and p.is_contiguous()
    if n > 1:
        assert torch.equal(p[0, 0, 1], w[1, :2])  # row 1's first pair: panel 0, pair 0, column 1
    assert torch.equal(unpack_panels(p, n, k), w)
    ids = torch.tensor([n - 1, 0, n // 2, n - 1])
    assert torch.equal(unpack_panels(p, n, k, ids), w[ids])
    assert torch.count_nonzero(p) == torch.count_nonzero(w)  # the padding is zeros


@pytest.mark.parametrize("shape", [(1, 2), (17, 45), (50, 130), (96, 576)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_int8_panels_pack_unpack_and_their_corrections(shape):
    """w8a8's panels (both variants' layout): 16 columns x quads of k, K padded to groups of
    64 with zeros; the corrections are -128 x each column's code sums per group."""
    n, k = shape
    q, _ = quantize_int8(_weight(n, k))
    p = pack_panels_i8(q)
    groups = -(-k // 64)
    assert p.shape == (-(-n // 16), groups * 16, 16, 4) and p.dtype == torch.int8 and p.is_contiguous()
    if n > 1 and k >= 4:
        assert torch.equal(p[0, 0, 1], q[1, :4])  # row 1's first quad: panel 0, quad 0, column 1
    assert torch.equal(unpack_panels(p, n, k), q)
    ids = torch.tensor([n - 1, 0, n // 2])
    assert torch.equal(unpack_panels(p, n, k, ids), q[ids])
    assert torch.count_nonzero(p) == torch.count_nonzero(q)  # the padding is zeros
    corr = panel_corrections_i8(p)
    want = F.pad(q, (0, groups * 64 - k, 0, -n % 16)).view(-1, 16, groups, 64).sum(-1, dtype=torch.int32) * -128
    assert corr.dtype == torch.int32 and torch.equal(corr, want.transpose(1, 2))
    u = pack_panels_i8(q, 128)  # the AVX2 variant's: every byte's sign bit flipped, u = w + 128, padding too
    assert torch.equal(u.view(torch.uint8).int() - 128, p.int())


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 2), (17, 45), (50, 130)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_panel_rows_gathers_rows_exactly_from_either_panel_layout(shape):
    """The embedding lookup of a tied lm_head kept in panels: float32 rows, exactly the stored
    values (bf16 and int8 widen exactly), any order and repeats; a row past the panels is an
    IndexError, a layout it does not know a clear error."""
    n, k = shape
    ids = torch.tensor([n - 1, 0, n // 2, n - 1])
    w = _weight(n, k).bfloat16()
    got = torch.ops.inferlab.panel_rows(pack_panels(w), ids, k)
    assert got.dtype == torch.float32 and torch.equal(got, w[ids].float())
    q, _ = quantize_int8(_weight(n, k))
    xor = build.kernel_info().int8_panel_xor  # the codes as this variant's w8a8 panels hold them
    assert torch.equal(torch.ops.inferlab.panel_rows(pack_panels_i8(q, xor), ids, k), q[ids].float())
    scale = torch.rand(n) + 0.01  # the codes' per-row scales, multiplied in as the per-call path does
    assert torch.equal(torch.ops.inferlab.panel_rows(pack_panels_i8(q, xor), ids, k, scale),
                       q[ids].float() * scale.index_select(0, ids)[:, None])
    with pytest.raises(RuntimeError, match="scales for panels"):
        torch.ops.inferlab.panel_rows(pack_panels_i8(q, xor), ids, k, torch.ones(-(-n // 16) * 16 + 1))
    with pytest.raises(IndexError, match="outside"):  # row n is the last panel's padding (no n here is a multiple of 16)
        torch.ops.inferlab.panel_rows(pack_panels_i8(q, xor), torch.tensor([n]), k, scale)
    assert torch.ops.inferlab.panel_rows(pack_panels(w), ids[:0], k).shape == (0, k)
    with pytest.raises(IndexError, match="outside"):
        torch.ops.inferlab.panel_rows(pack_panels(w), torch.tensor([-(-n // 16) * 16]), k)
    with pytest.raises(RuntimeError, match="panels must be"):
        torch.ops.inferlab.panel_rows(w, ids, k)


@needs_kernels
@BF16_PANELS
@pytest.mark.parametrize("shape", [(17, 45), (200, 576), (48, 64)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_panel_products_in_every_form(shape):
    """linear_panels against x rounded to bf16 times the weight in float64: float32 or bf16 x in,
    float32 or bf16 out, odd K (a zero pair-half), N not of 16 (masked stores), 1 to 130 rows
    (tiles of 8 and their tails, blocks of 64 rows), with and without bias."""
    n, k = shape
    bias = torch.randn(n)
    lin = WeightOnlyLinear(_weight(n, k), torch.bfloat16, bias)
    assert lin.bf16_products and lin.weight.dim() == 4
    for m in (1, 3, 8, 9, 23, 64, 130):
        x = torch.randn(m, k)
        _check(lin(x), x, lin)
        ref, bound = _reference(x, lin)
        out = lin.product_bf16(x.bfloat16())  # bf16 in, bf16 out: the sums rounded once
        assert out.dtype == torch.bfloat16
        assert bool(((out.double() - ref).abs() <= bound + ref.abs() * 2.0**-8 * 1.01).all())
        torch.testing.assert_close(lin.product_bf16(x, torch.float32), lin(x), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="do not hold"):
        torch.ops.inferlab.linear_panels(torch.randn(2, k + 2), lin.weight, n, None)


def test_nbytes_and_the_dense_case():
    w = _weight(30, 16)
    assert WeightOnlyLinear(w, torch.float16).nbytes == 30 * 16 * 2
    bf16 = WeightOnlyLinear(w, torch.bfloat16, torch.zeros(30))
    # bf16 products keep the weight in whole panels of 16 rows (30 -> 32): the bytes as stored
    assert bf16.nbytes == (32 if bf16.bf16_products else 30) * 16 * 2 + 30 * 4
    assert WeightOnlyLinear(w, torch.int8).nbytes == 30 * 16 + 30 * 4  # codes + scales
    dense = make_linear(w, None, resolve_precision(LoadConfig(dtype="float32")))
    assert isinstance(dense, DenseLinear) and dense.weight is w and dense.nbytes == 30 * 16 * 4
    f16 = make_linear(w, None, resolve_precision(LoadConfig(dtype="float32", weight_dtype="float16")))
    assert isinstance(f16, WeightOnlyLinear) and f16.weight.dtype == torch.float16


def test_bad_storage_is_a_value_error():
    with pytest.raises(ValueError, match="does not fit float16"):
        WeightOnlyLinear(torch.full((2, 2), 70000.0), torch.float16)
    WeightOnlyLinear(torch.full((2, 2), 70000.0), torch.bfloat16)  # bfloat16 has float32's range
    with pytest.raises(ValueError, match="stored_dtype"):
        WeightOnlyLinear(torch.zeros(2, 2), torch.float64)
    with pytest.raises(ValueError, match="matrix"):
        WeightOnlyLinear(torch.zeros(2), torch.float16)


# ---- which weight dtype a LoadConfig gets --------------------------------------------------


def _variant(monkeypatch, variant: str) -> None:
    """As if kernels/build.py had chosen `variant` on this machine."""
    info = build.KernelInfo(variant, ())
    monkeypatch.setattr(build, "kernel_info", lambda: info)
    monkeypatch.setattr(build, "available", lambda: info.available)


def _weights(variant: str, native_bf16: bool, **load) -> torch.dtype:
    """How the weights are stored with these LoadConfig settings, as if on a CPU with `variant`."""
    return resolve_precision(LoadConfig(**load), kernel=build.KernelInfo(variant, ()), native_bf16=native_bf16).weights


def test_auto_weight_dtype():
    assert _weights("avx2", False) == torch.float16  # an AVX2 CPU: float32 compute
    # An explicit float32 compute keeps float32 weights: the exact-match tests rely on it.
    assert _weights("avx2", False, dtype="float32") == torch.float32
    # AVX512-BF16 (the avx512 variant): float32 compute, bf16 weights for vdpbf16ps.
    avx512 = resolve_precision(LoadConfig(), kernel=build.KernelInfo("avx512", ()), native_bf16=True)
    assert (avx512.compute, avx512.weights, avx512.bf16_products) == (torch.float32, torch.bfloat16, True)
    assert _weights("avx512", True, dtype="float32") == torch.float32
    # No kernels: native bf16 computes in bf16, weights as computed.
    plain = resolve_precision(LoadConfig(), kernel=build.KernelInfo("none", ()), native_bf16=True)
    assert (plain.compute, plain.weights, plain.uses_kernels) == (torch.bfloat16, torch.bfloat16, False)
    assert _weights("none", False) == torch.float32  # nor bf16: 16-bit would be slower


def test_kv_cache_dtype_auto_follows_the_weights():
    def kv(variant: str, cache_dtype: str = "auto", **load) -> torch.dtype:
        return resolve_precision(LoadConfig(**load), CacheConfig(cache_dtype=cache_dtype),
                                 kernel=build.KernelInfo(variant, ()), native_bf16=False).kv_cache

    assert kv("avx2") == torch.float16  # an AVX2 CPU: float32 compute
    assert kv("avx2", dtype="float32") == torch.float32
    assert kv("avx2", "float16", dtype="float32") == torch.float16
    assert kv("avx512") == torch.float16  # bf16 weights, float16 K/V (the attention kernel widens them)
    assert kv("none") == torch.float32
    with pytest.raises(ValueError, match="cache_dtype"):
        CacheConfig(cache_dtype="int4")


def test_explicit_weight_dtype():
    assert _weights("avx2", False, weight_dtype="int8") == torch.int8
    assert _weights("avx2", False, dtype="float32", weight_dtype="bfloat16") == torch.bfloat16
    assert _weights("avx2", False, dtype="bfloat16", weight_dtype="bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="wider than the compute dtype"):
        _weights("avx2", False, dtype="bfloat16", weight_dtype="float32")
    with pytest.raises(ValueError, match="weight_dtype must be"):
        LoadConfig(weight_dtype="int3")


def test_weight_dtype_flags():
    from inferlab.cli import build_parser
    from inferlab.server.cli import _engine_config

    argv = ["serve", "--weight-dtype", "int8"]
    parser, _ = build_parser(argv)
    assert _engine_config(parser.parse_args(argv)).load.weight_dtype == "int8"
    assert _engine_config(parser.parse_args(["serve"])).load.weight_dtype == "auto"
    argv = ["generate", "--weight-dtype", "bfloat16"]
    parser, _ = build_parser(argv)
    assert parser.parse_args(argv).weight_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--weight-dtype", "int3"])


# ---- the engine --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("llama"), arch="llama")


def _greedy(llm: LLM) -> list[tuple[list[int], list[float]]]:
    prompts = [list(range(3, 40)), [7, 300, 12, 5, 90]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, [lp.logprob for lp, _ in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "fallback"])
def test_engine_with_float16_weights_follows_float32(tiny_llama, monkeypatch, use_kernels):
    if use_kernels and not build.available():
        pytest.skip(f"inferlab CPU kernels unavailable: {build.unavailable_reason()}")
    ref = _greedy(LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64))
    if not use_kernels:
        _variant(monkeypatch, "none")
    llm = LLM(str(tiny_llama), dtype="float32", weight_dtype="float16", num_kv_blocks=64)
    runner = llm.engine.runner
    assert runner.precision.weights == torch.float16 and runner.precision.uses_kernels is use_kernels
    qkv = runner.model.layers[0].qkv
    assert isinstance(qkv, WeightOnlyLinear) and qkv.weight.dtype == torch.float16
    assert qkv.use_kernels is use_kernels
    assert runner.model.lm_head is runner.model.embed  # tied: one 16-bit table for both
    for (ids, lps), (ref_ids, ref_lps) in zip(_greedy(llm), ref):
        assert ids == ref_ids
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-2


@pytest.mark.parametrize("mode", ["w8a8", "bfloat16"])
def test_greedy_steps_take_the_lm_heads_argmax_for_the_samplers_tokens(tiny_llama, mode):
    """A step whose rows are all plain greedy asks the lm_head (w8a8's or bf16 panels) for its
    argmax (no logits, no sampler: ModelRunner.fused_greedy) and gets the tokens the sampler
    picks from the logits; a row asking for logprobs keeps its step on the sampler."""
    _panels_or_skip(mode)
    llm = LLM(str(tiny_llama), dtype="float32", weight_dtype=mode, num_kv_blocks=64)
    runner = llm.engine.runner
    assert runner.fused_greedy
    calls: list[int] = []
    real = runner.model.greedy_tokens
    runner.model.greedy_tokens = lambda h: calls.append(h.shape[0]) or real(h)
    prompts = [list(range(3, 40)), [7, 300, 12, 5, 90], [5, 6, 7]]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def tokens(params):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_prefix_cache=False)]

    fast = tokens(greedy)
    assert len(calls) == 8 and calls[-1] == 3  # the prefill's step and the 7 decode steps
    runner.fused_greedy = False
    assert tokens(greedy) == fast
    runner.fused_greedy, calls[:] = True, []
    assert tokens([greedy, greedy, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)]) == fast
    assert not calls


def test_engine_float32_keeps_dense_weights(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=16)
    model = llm.engine.runner.model
    assert llm.engine.precision.weights == torch.float32
    assert all(isinstance(lin, DenseLinear) for lin in (model.layers[0].qkv, model.layers[0].down, model.lm_head))
    assert model.describe_precision().startswith("weights float32 (F.linear), compute float32")


@pytest.mark.skipif(not build.kernel_info().bf16_dot,
                    reason=f"needs AVX512_BF16 (the avx512 kernel variant); this process has {build.kernel_info().variant}")
@pytest.mark.parametrize("m", [1, 6, 7, 32, 127, 200])
def test_bf16_products_are_bf16_x_times_bf16_w_in_float32(m):
    """vdpbf16ps (and oneDNN from MKL_MIN_ROWS): the product of x rounded to bf16, float32 sums;
    against a float32 reference, off by x's rounding only (~2^-9 of each term)."""
    n, k = 96, 600  # K not a multiple of 32: the masked tail
    lin = WeightOnlyLinear(_weight(n, k), torch.bfloat16, torch.randn(n))
    assert lin.bf16_products
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = lin(x)
    _check(y, x, lin)
    exact = F.linear(x.double(), lin.dequantized(torch.float64), lin.bias.double())
    mag = x.double().abs() @ lin.dequantized(torch.float64).abs().T
    rel = float(((y.double() - exact).abs() / mag).max())
    assert 1e-6 < rel < 2.0**-7  # x really was rounded (a float32 product is ~1e-7), and no worse than that


# K: a tail group, whole groups, both (600, 700: the last of the avx512 scales over 1 and 2 groups); 300 rows: the AVX2 variant shares rows out (kI8SplitRows)
W8A8_CASES = [(m, k) for k in (45, 576, 600, 700) for m in (1, 3, 4, 5, 32, 127, 300)]


def x_scales_pow2(t: torch.Tensor, per_block: int) -> torch.Tensor:
    """The AVX2 variant's group scales from t = max|x_g| / qmax (float32 [m, groups]): per block
    of `per_block` groups, e with ceil(max t / 2^e) in [128, 255], each scale ceil(t / 2^e) 2^e (all
    0 where max t < 2^-100)."""
    m, groups = t.shape
    blocks = -(-groups // per_block)
    tb = F.pad(t, (0, blocks * per_block - groups)).view(m, blocks, per_block)
    tmax = tb.amax(-1, keepdim=True)
    e = torch.frexp(tmax).exponent - 8
    e = torch.where(torch.ceil(tmax * torch.pow(2.0, -e.float())) > 255, e + 1, e).float()
    scale = torch.ceil(tb * torch.pow(2.0, -e)) * torch.pow(2.0, e)
    return torch.where(tmax >= 2.0**-100, scale, torch.zeros_like(scale)).view(m, -1)[:, :groups]


def w8a8_reference(x: torch.Tensor, lin: WeightOnlyLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """What w8a8 computes on this process's variant, in float64: x quantized per group of G
    values exactly as the kernels do (float32 s = max|x_g| / Q and Q / max|x_g|, q = round half to
    even of x * that; G, Q = 64, 127 on avx512 and 16, 63 on avx2: KernelInfo.int8_x_group /
    int8_x_max; on avx2 s rounded up to an 8-bit multiple of a power of two per block of
    KernelInfo.int8_scale_block values, x_scales_pow2, and q = round(x * float32(1 / s))), each
    group's integer sum dot_g(q, codes) exact, y = sum_g dot_g * s_g * row
    scale + bias; and the bound on the float32 rounding after the integer sums, 2^-20 of what the
    kernel rounds: its int32 lanes (partial sums of q * w: at most sum |q| |w| per group) times
    s_g, and also the 128-offsets in them (avx512: x stored as q + 128, then -128 x the group's
    codes; avx2: the codes stored as w + 128, then -128 x the group's q), summed over groups,
    scaled, biased. A q one step off moves y by s_g |w| (a few times the bound or more); float32
    products instead of the integer path, by ~1e-2 of y."""
    kernel = build.kernel_info()
    g, qmax = kernel.int8_x_group, kernel.int8_x_max
    m, k = x.shape
    n, groups = lin.out_features, -(-(-(-k // 64) * 64) // g)  # the last scale may cover fewer values
    xg = F.pad(x, (0, groups * g - k)).view(m, groups, g)
    amax = xg.abs().amax(-1)
    if kernel.int8_scale_block:
        scale = x_scales_pow2(amax / qmax, kernel.int8_scale_block // g)
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    else:
        scale = amax / qmax
        # Q / max|x_g| as one float32 division, as the kernel divides: `qmax / amax` is torch's
        # reciprocal times Q, two roundings, and on some CPUs' x a product then lands on a .5 tie.
        inv = torch.where(amax > 0, torch.full_like(amax, float(qmax)).div(amax), torch.zeros_like(amax))
    q = torch.round(xg * inv[..., None]).double()
    codes = F.pad(lin.codes(), (0, groups * g - k)).view(n, groups, g).double()
    s = scale.double()[:, None, :] * lin.scale.double()[None, :, None]  # [m, n, groups]
    y = (torch.einsum("mgc,ngc->mng", q, codes) * s).sum(-1)
    lanes = torch.einsum("mgc,ngc->mng", q.abs(), codes.abs())
    lanes = lanes + (256 * q.abs().sum(-1)[:, None] if kernel.int8_panel_xor else 256 * codes.abs().sum(-1)[None])
    bias = lin.bias.double() if lin.bias is not None else torch.zeros(n, dtype=torch.float64)
    return y + bias, 2.0**-20 * ((lanes * s).sum(-1) + (y + bias).abs()) + 1e-30


def w8a8_outputs(expect_variant: str = "") -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
    """Each W8A8_CASES product on this process's kernels, checked against w8a8_reference; the
    outputs and their bounds, for a comparison with the other variant's (run in-process or in a
    child process given another INFERLAB_KERNELS)."""
    kernel = build.kernel_info()
    if expect_variant:
        assert kernel.variant == expect_variant, kernel
    out = {}
    for m, k in W8A8_CASES:
        n = 37  # not a multiple of the 4-row blocks
        bias = torch.randn(n, generator=torch.Generator().manual_seed(k))
        lin = WeightOnlyLinear(_weight(n, k), torch.int8, bias, int8_activations=True)
        assert lin.int8_x
        sums = (-(-n // 16), -(-k // 64), 16) if not kernel.int8_panel_xor else (0,)  # avx512's corrections
        assert tuple(lin.row_sums.shape) == sums
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + m))
        x[:, 1] *= 30  # an outlier channel: its group's scale is coarse, the others' are not
        want, bound = w8a8_reference(x, lin)
        y = lin(x)
        err = (y.double() - want).abs()
        assert bool((err <= bound).all()), (m, k, kernel.variant, float((err / bound).max()))
        out[(m, k)] = y, bound
    return out


@needs_int8_dot
@pytest.mark.parametrize("m, k", W8A8_CASES)
def test_w8a8_is_int8_x_per_group_times_the_codes(m, k):
    """weight_dtype w8a8, on this process's variant (vpdpbusd on avx512: 8-bit x per 64 values;
    vpmaddubsw on avx2: 7-bit x per 16, scales in powers of two per 256): x quantized per group
    (symmetric, round half to even), each group's integer sum exact, then the scales; against that
    math in float64, to float32's rounding. What the server reports (KernelInfo) is what the build
    runs (w8a8_numerics)."""
    kernel = build.kernel_info()
    assert list(torch.ops.inferlab.w8a8_numerics()) == [kernel.int8_x_group, kernel.int8_x_max, kernel.int8_panel_xor,
                                                       kernel.int8_scale_block]
    assert {"amx": (192, 127, 0, 0), "avx512": (192, 127, 0, 0), "avx2": (16, 63, 128, 256)}[kernel.variant] == (
        kernel.int8_x_group, kernel.int8_x_max, kernel.int8_panel_xor, kernel.int8_scale_block)
    n = 37
    lin = WeightOnlyLinear(_weight(n, k), torch.int8, torch.randn(n), int8_activations=True)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + m))
    want, bound = w8a8_reference(x, lin)
    y = lin(x)
    assert bool(((y.double() - want).abs() <= bound).all())
    plain = WeightOnlyLinear(_weight(n, k), torch.int8, torch.randn(n))  # weight-only int8
    assert plain.row_sums is None and not plain.int8_x
    assert float((plain(x) - lin(x)).abs().max()) > 1e-6  # the two modes really differ


@needs_int8_dot
def test_w8a8_holds_to_its_reference_when_x_spans_decades():
    """Rows whose groups of 16 span 1e-6 to 1e2, some all zero, a block of them tiny (~1e-36: held
    as zeros, whose power of two would overflow float32): beside a large group a small one
    gets only a few multiples of its block's power of two (avx2: m_g down to 0 or 1), and still the
    output is the documented math (w8a8_reference), each sum exact, no int32 lane overflowed."""
    m, k, n = 6, 600, 37
    gen = torch.Generator().manual_seed(7)
    groups = -(-k // 16)
    decades = torch.randint(-6, 3, (m, groups), generator=gen).double()
    spread = torch.pow(10.0, decades).float().repeat_interleave(16, dim=1)[:, :k]
    x = torch.randn(m, k, generator=gen) * spread
    x[1, 32:64] = 0.0  # two whole groups of zeros
    x[2] = 0.0  # a row of zeros
    x[3, :256] *= 1e-35  # a block below 2^-100 * 63: held as zeros
    lin = WeightOnlyLinear(_weight(n, k), torch.int8, torch.randn(n, generator=gen), int8_activations=True)
    want, bound = w8a8_reference(x, lin)
    y = lin(x)
    assert bool(((y.double() - want).abs() <= bound).all()), float(((y.double() - want).abs() / bound).max())


@needs_kernels
@pytest.mark.parametrize("mode", ["bf16 panels", "w8a8", "float16 rows"])
def test_a_rows_products_are_the_same_bits_at_every_row_count(mode):
    """Batching and speculative verification change no greedy token: a row's outputs do not
    depend on how many rows share the call, though a few rows stream the panels one after the
    other and more go in tiles of 3 (matvec.h panel_rows_bf16 / _i8), and float16 rows go in
    tiles of 3 rows, 4-6 rows by pairs of weight rows (dot_tile / dot_pair): the same sums, in
    the same order, in every form."""
    info = build.kernel_info()
    if mode == "bf16 panels" and not info.bf16_dot:
        pytest.skip(f"bf16 panels are the AVX512_BF16 variant's layout; this process has {info.variant}")
    if mode == "w8a8" and not info.int8_dot:
        pytest.skip(f"w8a8 needs an integer dot product; this process has {info.variant}")
    n, k = 200, 576
    stored, int8_x = {"bf16 panels": (torch.bfloat16, False), "w8a8": (torch.int8, True),
                      "float16 rows": (torch.float16, False)}[mode]
    lin = WeightOnlyLinear(_weight(n, k), stored, torch.randn(n), int8_activations=int8_x)
    # w8a8 past 4 passes of 64 rows too (AVX2 shares rows out there); many float16 rows go to torch's GEMM
    x = torch.randn(300 if mode == "w8a8" else 40, k)
    every = lin(x)
    for m in (m for m in (*range(1, 17), 40, 130, 257) if m < len(x)):
        torch.testing.assert_close(lin(x[:m]), every[:m], rtol=0, atol=0, msg=f"{m} rows")


@needs_kernels
@pytest.mark.parametrize("mode", ["bf16 panels", "w8a8"])
def test_many_rows_are_the_passes_of_64_rows_put_together(mode):
    """Many rows go 64 at a time over the weights, the passes in groups that each chunk of the
    weights runs through before the next (linear.cpp for_row_passes): 33 passes make several
    groups on any L2 size (an uneven last one on most), and every row and column must come out
    once, the bits of that pass alone."""
    info = build.kernel_info()
    if mode == "bf16 panels" and not info.bf16_dot:
        pytest.skip(f"bf16 panels are the AVX512_BF16 variant's layout; this process has {info.variant}")
    if mode == "w8a8" and not info.int8_dot:
        pytest.skip(f"w8a8 needs an integer dot product; this process has {info.variant}")
    n, k = 1024, 576  # 64 panels: 16 chunks a pass on 2 threads
    stored, int8_x = {"bf16 panels": (torch.bfloat16, False), "w8a8": (torch.int8, True)}[mode]
    lin = WeightOnlyLinear(_weight(n, k), stored, torch.randn(n), int8_activations=int8_x)
    x = torch.randn(33 * 64, k, generator=torch.Generator().manual_seed(1))
    every = lin(x)
    passes = torch.cat([lin(x[m : m + 64]) for m in range(0, len(x), 64)])
    torch.testing.assert_close(every, passes, rtol=0, atol=0)


@needs_kernels
@pytest.mark.parametrize("mode", ["bf16 panels", "w8a8"])
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8])
def test_qkv_product_with_rope_and_the_cache_write_gives_the_two_step_bits(mode, cache_dtype):
    """product_rope_kv / _q8 (the rotation and the cache write as the product's epilogue) against
    the product in float32 then rope_write_kv: q, k, v and both caches the same bits, at a few rows
    and over several groups of 64-row passes, tokens at scattered slots and positions."""
    from inferlab.models.kv_cache import KVCache

    info = build.kernel_info()
    if mode == "bf16 panels" and not info.bf16_dot:
        pytest.skip(f"bf16 panels are the AVX512_BF16 variant's layout; this process has {info.variant}")
    if mode == "w8a8" and not info.int8_dot:
        pytest.skip(f"w8a8 needs an integer dot product; this process has {info.variant}")
    ops = torch.ops.inferlab
    heads, kv_heads, d, k = 9, 3, 64, 576
    n = (heads + 2 * kv_heads) * d
    w8a8 = mode == "w8a8"
    lin = WeightOnlyLinear(_weight(n, k), torch.int8 if w8a8 else torch.bfloat16, torch.randn(n), int8_activations=w8a8)
    cos, sin = torch.randn(4096, d), torch.randn(4096, d)
    for t in (1, 130, 33 * 64):
        x, positions, slots = torch.randn(t, k), torch.randint(0, 4096, (t,)), torch.randperm(4096)[:t]

        def cache() -> KVCache:
            scales = (torch.zeros(kv_heads, 4096), torch.zeros(kv_heads, 4096)) if cache_dtype == torch.int8 else (None, None)
            return KVCache(torch.zeros(kv_heads, 4096, d, dtype=cache_dtype),
                           torch.zeros(kv_heads, 4096, d, dtype=cache_dtype), *scales)

        fused, two_step = cache(), cache()
        rope = (positions, cos, sin)
        if w8a8:
            codes = ops.add_rms_norm_q8_(x, torch.randn(t, k), torch.ones(k), 1e-5)
            q, k_rot, v = lin.product_rope_kv_q8(*codes, *rope, fused, slots, heads, kv_heads, d)
            qkv = lin.product_q8(*codes)
        else:
            q, k_rot, v = lin.product_rope_kv(x, *rope, fused, slots, heads, kv_heads, d)
            qkv = lin.product_bf16(x, torch.float32)
        want_q, want_k = ops.rope_write_kv(qkv, *rope, two_step.k, two_step.v, slots, heads, kv_heads, d,
                                           two_step.k_scale, two_step.v_scale)
        for got, want in ((q, want_q), (k_rot, want_k), (v, qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)),
                          (fused.k, two_step.k), (fused.v, two_step.v)):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{t} rows")
        if cache_dtype == torch.int8:
            assert torch.equal(fused.k_scale, two_step.k_scale) and torch.equal(fused.v_scale, two_step.v_scale)


@pytest.mark.skipif(not build.kernel_info().bf16_dot, reason=f"bf16 panels are the AVX512_BF16 variant's layout; "
                    f"this process has {build.kernel_info().variant}")
def test_qkv_product_with_rope_refuses_a_head_dim_of_part_panels():
    with pytest.raises(RuntimeError, match="head_dim"):
        torch.ops.inferlab.linear_panels_rope_kv(
            torch.randn(2, 64), pack_panels(torch.randn(24 * 3, 64).bfloat16()), None, torch.arange(2),
            torch.randn(8, 24), torch.randn(8, 24), torch.zeros(1, 8, 24), torch.zeros(1, 8, 24), torch.arange(2), 1, 1, 24)


@pytest.mark.skipif(not build.kernel_info().bf16_dot, reason=f"bf16 panels and w8a8's panels with their epilogues are "
                    f"the AVX-512 variants'; this process has {build.kernel_info().variant}")
def test_prefills_with_rope_from_the_qkv_product_give_the_same_logprobs(tmp_path):
    """The model takes RoPE and the cache write from the qkv product in its bf16 prefill steps
    (128+ rows) and in w8a8's steps off the decode step: prompt and sampled logprobs the same bits
    as with rope_write_kv after the product."""
    assert_same_logprobs_with_the_path_off(tmp_path, (("auto", "rope_tiles"), ("w8a8", "rope_tiles_q8")))


def _variant_in_child(variant: str, code: str) -> None:
    env = {**os.environ, "INFERLAB_KERNELS": variant}
    proc = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                           + code], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]


def silu_q8_is_the_product_then_silu_mul_q8() -> None:
    """linear_panels_i8_silu_q against silu_mul_q8(product_q8(...)) on this process's variant:
    codes and scales the same bits at every row count (a pass of 64 rows, several, a tile's
    tail), halves of one scale group, of several, and with a last group of what is left; a weight
    whose halves are not whole groups of 64 is refused by name."""
    ops = torch.ops.inferlab
    g = torch.Generator().manual_seed(6)
    # inter 64 / 320 / 448 / 640: a last output group of 64 / 128 / 64 columns (192 a scale on
    # AVX-512) and of 64 / 192 / 128 (the AVX2 variant's blocks of 256)
    for k, inter in ((576, 1536), (64, 64), (130, 320), (64, 448), (64, 640)):
        lin = WeightOnlyLinear(torch.randn(2 * inter, k, generator=g) * 0.05, torch.int8, int8_activations=True)
        assert lin.silu_tiles_q8
        for m in (1, 2, 5, 16, 17, 33, 64, 100, 300, 513):
            x = torch.randn(m, k, generator=g) * 3
            x[:, 1] *= 30
            xq, sx = ops.add_rms_norm_q8_(x, torch.zeros_like(x), torch.ones(k), 1e-5)
            want, got = ops.silu_mul_q8(lin.product_q8(xq, sx)), lin.product_silu_q8(xq, sx)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (k, inter, m)
    odd = WeightOnlyLinear(torch.randn(96, 64), torch.int8, int8_activations=True)  # halves of 48: not whole groups
    assert not odd.silu_tiles_q8
    with pytest.raises(ValueError, match="product_silu_q8 needs"):
        odd.product_silu_q8(*ops.add_rms_norm_q8_(torch.randn(2, 64), torch.zeros(2, 64), torch.ones(64), 1e-5))


@needs_int8_dot
def test_w8a8_silu_codes_from_the_gate_up_product_are_the_product_then_silu_mul_q8_bits():
    """w8a8's SiLU(gate) * up as the down product's codes, made from gate_up's sums in cache (the
    amx variant's tiles, the others' panel products into a buffer): silu_mul_q8's bits. This
    process's variant, and the avx2 variant's (its own x scales: blocks of 256) in a child where
    the CPU runs it."""
    silu_q8_is_the_product_then_silu_mul_q8()
    if build.kernel_info().variant != "avx2" and set(build.VARIANTS["avx2"][0]) <= build.cpu_flags():
        _variant_in_child("avx2", "from test_kernels_linear import silu_q8_is_the_product_then_silu_mul_q8 as f; f()")


@BF16_PANELS
def test_silu_from_the_gate_up_product_gives_the_product_then_silu_mul_bits():
    """linear_panels_silu takes SiLU(gate) * up from the gate and up products' sums while they are
    in cache (the amx variant's tiles, the avx512 variant's panel products): the bits of
    silu_mul(product_bf16(x)), every row count, x in float32 or bf16; a weight it cannot take (a
    bias, a half not whole panels) says so."""
    g = torch.Generator().manual_seed(5)
    for k, inter in ((576, 1536), (64, 48), (96, 16), (130, 32)):  # 130: K rounded up to 160 in the panels
        lin = WeightOnlyLinear(torch.randn(2 * inter, k, generator=g) * 0.05, torch.bfloat16)
        assert lin.silu_tiles == ((k + 1) // 2 * 2 % 32 == 0)
        if not lin.silu_tiles:
            with pytest.raises(ValueError, match="product_silu_bf16 needs"):
                lin.product_silu_bf16(torch.randn(3, k))
            continue
        for m in (1, 2, 8, 15, 16, 17, 31, 32, 33, 48, 64, 100, 300, 513):
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(m, k, generator=g) * 3).to(dtype)
                want = torch.ops.inferlab.silu_mul(lin.product_bf16(x))
                got = lin.product_silu_bf16(x)
                assert got.dtype == torch.bfloat16 and got.shape == (m, inter)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (k, inter, m, dtype)
    assert not WeightOnlyLinear(torch.randn(96, 64), torch.bfloat16, torch.randn(96)).silu_tiles  # a bias
    assert not WeightOnlyLinear(torch.randn(80, 64), torch.bfloat16).silu_tiles  # halves of 40: not whole panels


@BF16_PANELS
def test_bf16_prefills_with_silu_from_the_gate_up_product_give_the_same_logprobs(tmp_path):
    """The model takes SiLU(gate) * up from the gate_up product in its bf16 prefill steps (128+
    rows): prompt and sampled logprobs the same bits as with the product then silu_mul."""
    assert_same_logprobs_with_the_path_off(tmp_path, (("auto", "silu_tiles"),))


@needs_int8_dot
def test_w8a8_prefills_with_silu_codes_from_the_product_give_the_same_logprobs(tmp_path):
    """The model takes w8a8's SiLU(gate) * up codes from the gate_up product in every step off
    the decode step: prompt and sampled logprobs the same bits as with silu_mul_q8 after it."""
    assert_same_logprobs_with_the_path_off(tmp_path, (("w8a8", "silu_tiles_q8"),))


@needs_int8_dot
def test_w8a8_on_each_variant_computes_its_own_documented_numerics(tmp_path):
    """avx2 (vpmaddubsw, 7-bit x per 16 values) and avx512 (vpdpbusd, 8-bit x per 64) quantize x
    differently, each by its own rule: each variant's outputs hold to its own float64 reference
    (w8a8_outputs), and the two stay as close as their roundings of x allow: each x value moves
    by at most half its step, max|x| over its group of 64 / (2 x 63) on avx2 (its scale rounded up
    by < 2^-7, and its 16-value groups' max is at most the 64's), / (2 x 127) on avx512, so the two
    outputs differ by at most sum_k |w_k| x both half-steps, plus each one's float32 bound. (A tolerance
    in y's spread instead failed on one CPU's random x: the outlier group's 7-bit steps are coarse.)
    The variant this process did not load runs in a child process."""
    missing = {v: sorted(set(build.VARIANTS[v][0]) - build.cpu_flags()) for v in ("avx512", "avx2")}
    if any(missing.values()):
        pytest.skip("this CPU lacks " + "; ".join(f"{', '.join(f)} ({v})" for v, f in missing.items() if f))
    mine = build.kernel_info().variant
    other = "avx512" if mine == "avx2" else "avx2"  # amx: the avx512 numerics (tests/test_kernels_amx.py)
    _variant_in_child(other, f"import torch, test_kernels_linear as t; "
                             f"torch.save(t.w8a8_outputs({other!r}), {str(tmp_path / 'y.pt')!r})")
    theirs = torch.load(tmp_path / "y.pt")
    ours = w8a8_outputs(mine)
    assert ours.keys() == theirs.keys()
    for (m, k), (y, bound) in ours.items():
        lin = WeightOnlyLinear(_weight(37, k), torch.int8, None, int8_activations=True)  # the codes w8a8_outputs made
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + m))
        x[:, 1] *= 30
        groups = -(-k // 64)
        amax = F.pad(x, (0, groups * 64 - k)).view(m, groups, 64).abs().amax(-1).repeat_interleave(64, -1)[:, :k]
        half_steps = amax.double() * (1.01 / (2 * 63) + 1 / (2 * 127))
        allowed = half_steps @ lin.dequantized().double().abs().T + bound + theirs[(m, k)][1]
        diff = (y.double() - theirs[(m, k)][0].double()).abs()
        assert bool((diff <= allowed).all()), ((m, k), float((diff / allowed).max()))
        assert float(diff.max()) > 0, (m, k)  # the two variants do round x differently


@needs_int8_dot
def test_w8a8_codes_are_laid_out_in_panels_on_every_variant():
    """vpdpbusd (avx512) and vpmaddubsw (avx2) multiply the same layout, one copy of the codes,
    which unpack to the [N, K] matrix: avx512 with its corrections, avx2 with every code's sign
    bit flipped (u = w + 128) and none."""
    lin = WeightOnlyLinear(_weight(8, 130), torch.int8, None, int8_activations=True)
    assert torch.equal(lin.codes(), quantize_int8(_weight(8, 130))[0])
    assert lin.i8_panels and lin.weight.shape == (1, 48, 16, 4)
    assert tuple(lin.row_sums.shape) == ((0,) if build.kernel_info().int8_panel_xor else (1, 3, 16))
    ids = torch.tensor([7, 0, 3])
    assert torch.equal(lin.rows(ids), lin.dequantized()[ids])  # a tied embedding's lookup from the panels


@needs_int8_dot
def test_linear_panels_i8_refuses_mismatched_inputs():
    lin = WeightOnlyLinear(_weight(20, 70), torch.int8, torch.randn(20), int8_activations=True)
    x, ops = torch.randn(3, 70), torch.ops.inferlab
    assert ops.linear_panels_i8(x, lin.weight, lin.row_sums, lin.scale, 20, lin.bias).shape == (3, 20)
    wrong_corr = torch.zeros(1, 1, 16, dtype=torch.int32) if lin.row_sums.numel() == 0 else lin.row_sums[:, :1]
    bad = {
        "x dtype": ((x.double(), lin.weight, lin.row_sums, lin.scale, 20, None), "x must be float32"),
        "x width": ((torch.randn(3, 140), lin.weight, lin.row_sums, lin.scale, 20, None), "panels must be"),
        "n": ((x, lin.weight, lin.row_sums, lin.scale, 40, None), "panels must be"),
        "corr": ((x, lin.weight, wrong_corr, lin.scale, 20, None), "corr must be"),
        "scale": ((x, lin.weight, lin.row_sums, lin.scale[:19], 20, None), "scale must be"),
        "bias": ((x, lin.weight, lin.row_sums, lin.scale, 20, torch.randn(19)), "bias must be"),
    }
    for args, message in bad.values():
        with pytest.raises(RuntimeError, match=message):
            ops.linear_panels_i8(*args)


def _panels_or_skip(mode: str) -> None:
    info = build.kernel_info()
    if mode == "w8a8" and not info.int8_dot:
        pytest.skip(f"w8a8 needs an integer dot product; this process has {info.variant}")
    if mode == "bfloat16" and not info.bf16_dot:
        pytest.skip(f"bf16 panels are the AVX512_BF16 variants' layout; this process has {info.variant}")


@pytest.mark.parametrize("mode", ["w8a8", "bfloat16"])
@pytest.mark.parametrize("m", [1, 2, 5, 13, 32, 40])
def test_lm_head_argmax_is_the_products_argmax_without_the_product(mode, m):
    """linear_panels_i8_argmax / linear_panels_argmax (a greedy step's lm_head): each row's argmax
    of the very product the panels give, the first index of the largest, across chunks of 2,048
    columns (n = 4,500: three chunks, the last part of a panel); equal columns in different
    chunks give the first. Every row count's path (rows streamed, tiles of rows, the amx tiles)."""
    _panels_or_skip(mode)
    n, k = 4500, 200
    w = _weight(n, k, seed=m)
    w[300] = w[2100] = w[4400] = w[300] * 3  # equal columns, larger than the rest, in the 1st, 2nd and 3rd chunk
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    bias[4400] = bias[2100] = bias[300]

    def make(b):
        return (WeightOnlyLinear(w, torch.int8, b, int8_activations=True) if mode == "w8a8"
                else WeightOnlyLinear(w, torch.bfloat16, b))

    lin = make(bias)
    assert lin.fused_argmax
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[: m // 2 + 1] = w[300] * 4  # these rows' largest output is column 300's, tied with 2100 and 4400
    y = lin(x)
    got = lin.argmax(x)
    assert got.dtype == torch.long and got.shape == (m,)
    assert torch.equal(got, y.argmax(dim=-1))
    assert bool((got[: m // 2 + 1] == 300).all()) and bool((y[: m // 2 + 1, 4400] == y[: m // 2 + 1, 300]).all())
    unbiased = make(None)
    assert torch.equal(unbiased.argmax(x), unbiased(x).argmax(dim=-1))
    ops = torch.ops.inferlab
    if mode == "w8a8":
        with pytest.raises(RuntimeError, match="x must be a float32 matrix"):
            ops.linear_panels_i8_argmax(x[None], lin.weight, lin.row_sums, lin.scale, n, lin.bias)
        with pytest.raises(RuntimeError, match="panels must be"):
            ops.linear_panels_i8_argmax(x, lin.weight, lin.row_sums, lin.scale, n + 40, lin.bias)
    else:
        with pytest.raises(RuntimeError, match="x must be a matrix"):
            ops.linear_panels_argmax(x[None], lin.weight, n, lin.bias)
        with pytest.raises(RuntimeError, match="bias must be"):
            ops.linear_panels_argmax(x, lin.weight, n, bias[:-1])


@needs_int8_dot
@pytest.mark.parametrize("m", [MKL_MIN_ROWS, 200])
def test_w8a8_panels_quantize_x_at_prefill_sizes_too(m):
    """One copy of the codes, one numerics for every row count: 64 rows a pass over the panels."""
    n, k = 50, 600
    lin = WeightOnlyLinear(_weight(n, k), torch.int8, torch.randn(n), int8_activations=True)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    want, bound = w8a8_reference(x, lin)
    assert bool(((lin(x).double() - want).abs() <= bound).all())


def test_w8a8_needs_our_kernels_and_says_what_this_machine_has(monkeypatch):
    _variant(monkeypatch, "none")
    with pytest.raises(ValueError, match=r"w8a8 needs .*integer dot product.*kernels are none: "
                                         r"use one of auto, float32, bfloat16, float16, int8, int4$"):
        resolve_precision(LoadConfig(weight_dtype="w8a8"))
    for variant in ("avx2", "avx512"):
        _variant(monkeypatch, variant)
        assert resolve_precision(LoadConfig(weight_dtype="w8a8")).weights == torch.int8
    with pytest.raises(ValueError, match="needs int8 weights"):
        WeightOnlyLinear(_weight(4, 8), torch.float16, int8_activations=True)


def test_16bit_products_see_few_row_counts(monkeypatch):
    """oneDNN caches one ~0.6 MB primitive per GEMM shape (up to 1024): 16-bit linears on the CPU
    pad their rows to a bucket, so 1..300-token steps make a few dozen shapes, not 300."""
    from inferlab.kernels import linear as lin

    seen: set[int] = set()
    real = lin.F.linear

    def spy(x, w, b=None):
        seen.add(x.shape[0])
        return real(x, w, b)

    monkeypatch.setattr(lin.F, "linear", spy)
    w = torch.randn(48, 32).bfloat16()
    layer = lin.DenseLinear(w)
    for m in range(1, 301):
        x = torch.randn(m, 32).bfloat16()
        y = layer(x)
        assert y.shape == (m, 48)
        if m in (1, 7, 77, 300):
            assert torch.equal(y, real(x, w))  # rows are independent: padding changes none of them
    assert len(seen) <= 40
    assert all(0 <= lin.bucket_rows(m) - m < max(8, m // 8) for m in range(1, 5000))  # <= 12.5% extra, or < 8 rows


@pytest.mark.skipif(not build.kernel_info().bf16_dot,
                    reason=f"needs AVX512_BF16 (the avx512 kernel variant); this process has {build.kernel_info().variant}")
@pytest.mark.parametrize("dtype", [torch.int8])
def test_rows_our_kernels_hand_to_onednn_are_bucketed(dtype):
    """From MKL_MIN_ROWS rows the avx512 kernels call oneDNN's bf16 GEMM for int8 codes, one
    cached primitive per row count: those rows are padded to a bucket too, and the padding
    changes no row. (bf16 weights are in panels: our kernel at every row count, no oneDNN.)"""
    from inferlab.kernels.linear import MKL_MIN_ROWS, bucket_rows

    lin = WeightOnlyLinear(_weight(40, 64), dtype, torch.randn(40))
    assert lin.bf16_gemm
    seen: list[int] = []
    real = lin.product
    lin.product = lambda x: seen.append(x.shape[0]) or real(x)
    for m in range(MKL_MIN_ROWS - 2, 400):
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m))
        y = lin(x)
        assert y.shape == (m, 40)
        if m in (MKL_MIN_ROWS + 1, 333):
            assert torch.equal(y, real(x))
    assert {bucket_rows(m) for m in range(MKL_MIN_ROWS, 400)} >= set(seen[2:]) and len(set(seen)) <= 20



@needs_int8_dot
@pytest.mark.parametrize("m", [1, 5, 64, 200])
@pytest.mark.parametrize("k", [64, 70, 576])
def test_w8a8_norm_and_silu_hand_over_the_codes_the_product_would_make(m, k):
    """add_rms_norm_q8_ and silu_mul_q8 quantize each row as they make it: the next product
    gives the bits it gives for the float32 rows (and the residual stream is updated alike)."""
    g = torch.Generator().manual_seed(m * 1000 + k)
    ops = torch.ops.inferlab
    lin = WeightOnlyLinear(_weight(40, k), torch.int8, torch.randn(40, generator=g), int8_activations=True)
    x, r = torch.randn(m, k, generator=g), torch.randn(m, k, generator=g)
    w = torch.rand(k, generator=g) + 0.5
    x_plain, x_q8 = x.clone(), x.clone()
    want = lin(ops.add_rms_norm_(x_plain, r, w, 1e-5, False))
    codes, scales = ops.add_rms_norm_q8_(x_q8, r, w, 1e-5)
    per = build.kernel_info().int8_x_group  # x values per scale on this variant
    assert codes.dtype == torch.uint8 and codes.shape == (m, -(-k // 64) * 64)
    assert scales.shape == (m, -(-(-(-k // 64) * 64) // per))
    assert torch.equal(x_q8, x_plain)
    assert torch.equal(lin.product_q8(codes, scales), want)
    gate_up = torch.randn(m, 2 * k, generator=g) * 3
    assert torch.equal(lin.product_q8(*ops.silu_mul_q8(gate_up)), lin(ops.silu_mul(gate_up)))


@needs_int8_dot
def test_linear_panels_i8_q_refuses_mismatched_codes():
    lin = WeightOnlyLinear(_weight(20, 70), torch.int8, None, int8_activations=True)
    ops = torch.ops.inferlab
    codes, scales = ops.silu_mul_q8(torch.randn(3, 140))
    assert lin.product_q8(codes, scales).shape == (3, 20)
    bad = {
        "dtype": ((codes.to(torch.int8), scales, 70), "xq must be contiguous uint8"),
        "width": ((codes[:, :64].contiguous(), scales, 70), "xq must be contiguous uint8"),
        "k": ((codes, scales, 140), "xq must be contiguous uint8"),
        "scales": ((codes, scales[:2], 70), "sx must be"),
    }
    for (xq, sx, k), message in bad.values():
        with pytest.raises(RuntimeError, match=message):
            ops.linear_panels_i8_q(xq, sx, k, lin.weight, lin.row_sums, lin.scale, 20, None)
    with pytest.raises(ValueError, match="product_q8 needs w8a8"):
        WeightOnlyLinear(_weight(20, 70), torch.int8, None).product_q8(codes, scales)
