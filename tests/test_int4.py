"""4-bit group-wise weights (weight_dtype int4): the format's packing, GGUF Q4_0 / Q4_1 / Q4_K
blocks taken as they are, the kernels (both variants) against the math they define, and a tiny
model generating with int4 through DecoderStep, per operator and in plain torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from same_outputs import assert_same_greedy

from inferlab import LLM, SamplingParams
from inferlab.config import LoadConfig
from inferlab.kernels import build
from inferlab.kernels.int4 import GROUP, INT4, Int4Weight, from_gguf, pack, quantize, unpack
from inferlab.kernels.linear import MKL_MIN_ROWS, Int4Linear, make_linear
from inferlab.models import decoder
from inferlab.models.precision import resolve_precision
from inferlab.models.testing import make_tiny_gguf, make_tiny_hf_model

PLAIN = build.KernelInfo("none", (), "plain torch in this test")

needs_kernels = pytest.mark.skipif(not build.available(), reason=f"kernels unavailable: {build.unavailable_reason()}")
ROWS = [1, 3, 33, 200]


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, 0] *= 20  # an outlier column, as real projections have
    return w


# ---- the format -----------------------------------------------------------------------------


def test_pack_unpack_round_trip_and_the_documented_nibble_order():
    q = torch.randint(0, 16, (5, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    codes = pack(q)
    assert codes.shape == (5, 48) and codes.dtype == torch.uint8
    assert torch.equal(unpack(codes), q)
    # byte 16 g + j: q[32 g + j] low, q[32 g + j + 16] high
    for g, j in [(0, 0), (1, 5), (2, 15)]:
        assert int(codes[3, 16 * g + j]) == int(q[3, 32 * g + j]) | (int(q[3, 32 * g + j + 16]) << 4)


def test_quantize_stores_5_bits_a_weight_and_beats_plain_min_max():
    w = _weight(64, 256)
    q = quantize(w)
    assert q.shape == (64, 256) and q.codes.dtype == torch.uint8 and q.dm.dtype == torch.float16
    assert q.nbytes * 8 / w.numel() == 5.0
    groups = w.view(64, 8, GROUP)
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    plain = (torch.round((groups - lo) / d).clamp(0, 15) * d + lo).view(64, 256)
    err, plain_err = float((q.dequantize() - w).pow(2).sum()), float((plain - w).pow(2).sum())
    assert err < 0.95 * plain_err  # the range search pays
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.zeros(4, 48))


def test_index_select_and_rows_dequantize_the_rows_asked_for():
    w = _weight(40, 64)
    lin = Int4Linear(w, kernel=PLAIN)
    ids = torch.tensor([3, 0, 39, 3])
    assert torch.equal(lin.rows(ids), lin.dequantized()[ids])


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1])
def test_gguf_q4_0_and_q4_1_blocks_give_exactly_ggufs_values(qtype):
    w = _weight(12, 128, seed=3).numpy()
    blocks = gguf.quants.quantize(w, qtype)
    want = gguf.quants.dequantize(blocks, qtype)
    ours = from_gguf(blocks, qtype, 12, 128)
    assert ours.nbytes * 8 / w.size == 5.0
    assert np.array_equal(ours.dequantize().numpy(), want)
    if qtype == QType.Q4_1:  # the code bytes are the file's, as they are
        assert np.array_equal(ours.codes.numpy().reshape(-1, 16), blocks.reshape(-1, 20)[:, 4:])


def test_gguf_q4_k_blocks_give_ggufs_values_up_to_float16_rounding_of_the_scales():
    rows, cols = 6, 512
    rng = np.random.default_rng(0)
    n = rows * cols // 256
    blocks = rng.integers(0, 256, size=(n, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.float16(0.003).reshape(1).view(np.uint8)  # d
    blocks[:, 2:4] = np.float16(0.0021).reshape(1).view(np.uint8)  # dmin
    blocks[1, 0:2] = np.float16(0.0007).reshape(1).view(np.uint8)
    want = gguf.quants.dequantize(blocks.reshape(rows, -1), QType.Q4_K).reshape(rows, cols)
    ours = from_gguf(blocks, QType.Q4_K, rows, cols).dequantize().numpy()
    # d * sc and dmin * mn (6-bit sc, mn) rounded to float16: half an ulp, 2^-11 relative, each
    bound = (15 * 0.003 * 63 + 0.0021 * 63) * 2.0**-11
    assert np.abs(ours - want).max() <= bound  # a code or scale in the wrong place is off by ~1


# ---- the kernels ----------------------------------------------------------------------------


def _x_quantized(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it below MKL_MIN_ROWS rows: int8 per group of 32, s = max|x| / 127,
    q = round-half-even(x * (127 / max|x|)) in float32, back to s * q."""
    m, k = x.shape
    xg = x.view(m, k // GROUP, GROUP)
    amax = xg.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(xg * inv) * (amax / 127)).view(m, k)


def check_kernel_against_reference(m: int, n: int = 37, k: int = 576) -> None:
    """linear_w4 against float64 products of the dequantized weight: below MKL_MIN_ROWS with x
    as the kernels quantize it (then only float32 rounding is left); from there with x (and, on
    the AVX-512 variant, x, weights and output rounded to bf16 by oneDNN)."""
    lin = Int4Linear(_weight(n, k), torch.randn(n))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    w = lin.dequantized(torch.float64)
    y = lin(x).double()
    if m < MKL_MIN_ROWS:
        xs = _x_quantized(x).double()
        bound = 1e-5 * (xs.abs() @ w.abs().T) + 1e-6
    else:
        bf16 = build.kernel_info().bf16_dot
        xs = x.bfloat16().double() if bf16 else x.double()
        ws = lin.dequantized(torch.bfloat16).double() if bf16 else w
        bound = 1e-5 * (xs.abs() @ ws.abs().T) + 1e-6
        if bf16:
            bound = bound + (xs @ ws.T).abs() * 2.0**-8 * 1.01
        w = ws
    want = xs @ w.T + lin.bias.double()
    assert y.shape == want.shape
    assert bool(((y - want).abs() <= bound).all()), float((y - want).abs().max())
    # and the fallback (float x, no int8 rounding) is within x's quantization noise of the kernels
    fallback = lin.fallback(x).double()
    assert float((fallback - y).abs().max()) <= 0.02 * float((x.abs().double() @ w.abs().T).max())


@needs_kernels
@pytest.mark.parametrize("m", ROWS)
def test_kernel_matches_the_dequantized_weights(m):
    check_kernel_against_reference(m)
    check_kernel_against_reference(m, n=130, k=1536)


def _cpu_has(variant: str) -> bool:
    return set(build.VARIANTS[variant][0]) <= build.cpu_flags()


@pytest.mark.skipif(not _cpu_has("avx2"), reason="this CPU lacks AVX2/FMA/F16C")
def test_the_avx2_variant_matches_too():
    """The other variant, in its own process (the variant is decided once per process)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_int4 as t; from inferlab.kernels import build\n"
            "assert build.kernel_info().variant == 'avx2', build.kernel_info()\n"
            "for m in t.ROWS: t.check_kernel_against_reference(m); t.check_kernel_against_reference(m, 130, 1536)\n")
    env = dict(os.environ, INFERLAB_KERNELS="avx2")
    r = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]


@needs_kernels
def test_linear_w4_checks_its_inputs():
    lin = Int4Linear(_weight(8, 64))
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.inferlab.linear_w4(torch.randn(1, 32), lin.weight, lin.scale, None, MKL_MIN_ROWS)
    with pytest.raises(RuntimeError, match="dm must be"):
        torch.ops.inferlab.linear_w4(torch.randn(1, 64), lin.weight, lin.scale.float(), None, MKL_MIN_ROWS)


# ---- the weight dtype and the model --------------------------------------------------------------


def test_weight_dtype_int4_resolves_to_the_marker_and_make_linear_builds_int4():
    assert resolve_precision(LoadConfig(weight_dtype="int4")).weights == INT4
    int4 = resolve_precision(LoadConfig(dtype="float32", weight_dtype="int4"))
    assert isinstance(make_linear(_weight(8, 64), None, int4), Int4Linear)
    q = quantize(_weight(8, 64))
    assert make_linear(q, None, int4).q is q  # an Int4Weight is kept as it is
    with pytest.raises(ValueError, match="weight_dtype must be one of .*int4"):
        LoadConfig(weight_dtype="int3")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4")
    return {arch: make_tiny_hf_model(root / arch, arch=arch) for arch in ("llama", "qwen2")}


def _generate(path, monkeypatch, use_step: bool, n_prompts: int = 3, kernels: bool = True):
    if not kernels:  # as if the kernels had not loaded: the decision and the linears see the same
        none = build.KernelInfo("none", (), "off in this test")
        monkeypatch.setattr(build, "kernel_info", lambda: none)
        monkeypatch.setattr(build, "available", lambda: False)
    steps: list[bool] = []
    real = decoder.DecoderModel._decode_step

    def spy(self, *a, **kw):
        step = real(self, *a, **kw)
        steps.append(step is not None)
        return step

    monkeypatch.setattr(decoder.DecoderModel, "_decode_step", spy)
    llm = LLM(str(path), dtype="float32", weight_dtype="int4", num_kv_blocks=64,
              decoder_backend="step" if use_step else "fused")
    model = llm.engine.runner.model
    assert isinstance(model.layers[0].qkv, Int4Linear) and isinstance(model.layers[0].down, Int4Linear)
    # the embedding / tied lm_head from float weights: int8 (see DecoderModel's `table`)
    assert model.lm_head is model.embed and model.embed.weight.dtype == torch.int8
    g = torch.Generator().manual_seed(n_prompts)
    prompts = [torch.randint(3, 250, (int(n),), generator=g).tolist()
               for n in torch.randint(2, 40, (n_prompts,), generator=g)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3))
    assert any(steps) == (use_step and kernels)
    return outs, model


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int4_decode_step_gives_the_per_operator_tokens(tiny, monkeypatch, arch):
    step, model = _generate(tiny[arch], monkeypatch, True)
    ops, _ = _generate(tiny[arch], monkeypatch, False)
    assert_same_greedy(step, ops, tol=1e-3, top_ids=True)
    assert "int4" in model.describe_precision() and "4-bit codes" in model.describe_precision()


@needs_kernels
def test_int4_plain_torch_fallback_is_close(tiny, monkeypatch):
    """Without the kernels: float x (no int8 rounding), dequantized weights, F.linear: the first
    token's log-probability within x's int8 noise of the kernels'."""
    fast, _ = _generate(tiny["llama"], monkeypatch, True)
    slow, model = _generate(tiny["llama"], monkeypatch, True, kernels=False)
    assert "plain torch" in model.describe_precision()
    for a, b in zip(fast, slow):  # the first token: from the same prompt, the same weights
        (chosen_a, top_a), (chosen_b, _) = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        if chosen_a.token_id == chosen_b.token_id:
            assert abs(chosen_a.logprob - chosen_b.logprob) < 0.05
        else:  # a near-tie (this tiny random model's distributions are flat) may flip
            assert abs(top_a[0].logprob - top_a[1].logprob) < 0.05


def test_a_q4_gguf_loads_its_codes_as_they_are(tmp_path):
    """weight_dtype int4 on a Q4_1 GGUF: each layer matrix's codes are the file's bytes, and
    llama's permuted q/k rows are put back in Hugging Face's order (by index, as the floats)."""
    hf = make_tiny_hf_model(tmp_path / "hf", "llama")
    path = make_tiny_gguf(tmp_path / "m.gguf", qtype="Q4_1", hf_dir=hf)
    llm = LLM(str(path), dtype="float32", weight_dtype="int4", num_kv_blocks=16)
    model = llm.engine.runner.model
    ref = LLM(str(hf), dtype="float32", weight_dtype="float32", num_kv_blocks=16).engine.runner.model
    want_qkv = ref.layers[0].qkv.weight
    err = (model.layers[0].qkv.dequantized() - want_qkv).norm() / want_qkv.norm()
    assert float(err) < 0.15  # 4-bit noise; rows out of order would be ~1.4
    reader = gguf.GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    rows, cols = int(t.shape[1]), int(t.shape[0])
    want = from_gguf(t.data, t.tensor_type, rows, cols)
    assert torch.equal(model.layers[0].down.weight, want.codes) and torch.equal(model.layers[0].down.scale, want.dm)
    assert isinstance(model.embed, Int4Linear)  # a Q4 token_embd is the file's choice: kept too
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_int4_weight_shape_and_numel():
    q = Int4Weight(torch.zeros(3, 16, dtype=torch.uint8), torch.zeros(3, 1, 2, dtype=torch.float16))
    assert q.shape == (3, 32) and q.numel() == 96
