"""models/precision.py: every precision decision made once, the same decisions as before, and
the one object passed down to the loader, the runner and the decoder (and reported)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from inferlab import LLM
from inferlab.config import KV_CACHE_DTYPES, WEIGHT_DTYPES, CacheConfig, LoadConfig
from inferlab.engine import llm_engine
from inferlab.kernels import build
from inferlab.kernels.int4 import INT4
from inferlab.models import loader
from inferlab.models.decoder import DecoderModel
from inferlab.models.dummy_loader import load_dummy
from inferlab.models.precision import ResolvedPrecision, cpu_has_native_bf16, dtype_name, resolve_precision
from inferlab.models.testing import make_tiny_hf_model, tiny_model_config

DTYPES = ("auto", "float32", "bfloat16", "float16")
VARIANTS = ("amx", "avx512", "avx2", "none")
_T = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def before(dtype: str, weight_dtype: str, cache_dtype: str, kernel: build.KernelInfo, native: bool):
    """The decisions as models/loader.py's resolve_dtype / resolve_weight_dtype / resolve_kv_dtype /
    int8_activations and DecoderModel's bf16_products made them before ResolvedPrecision (on the
    CPU), with kernels/build.py's available() and kernel_info() as `kernel`: the reference."""
    available = kernel.available
    compute = _T[dtype] if dtype != "auto" else (torch.float32 if available else
                                                 (torch.bfloat16 if native else torch.float32))
    auto16 = dtype == "auto" and compute == torch.float32 and available
    if weight_dtype == "auto":
        weights = _T[kernel.auto_weight_dtype] if auto16 else compute
    else:
        if weight_dtype == "w8a8" and not kernel.int8_dot:
            raise ValueError("w8a8")
        weights = {**_T, "int8": torch.int8, "w8a8": torch.int8, "int4": INT4}[weight_dtype]
        if weights.itemsize > compute.itemsize:
            raise ValueError("wider")
    kv = (torch.float16 if auto16 else compute) if cache_dtype == "auto" else {**_T, "int8": torch.int8}[cache_dtype]
    step_ok = compute == torch.float32 and available
    # DecoderModel: the embedding's WeightOnlyLinear.bf16_products (bf16 storage under another
    # compute dtype, kernels on, vdpbf16ps) and step_ok; an int4 model's table is int8.
    embed_bf16 = weights == torch.bfloat16 and weights != compute and available and kernel.bf16_dot
    return compute, weights, kv, weight_dtype == "w8a8", step_ok, embed_bf16 and step_ok


def _combinations():
    return itertools.product(DTYPES, WEIGHT_DTYPES, KV_CACHE_DTYPES, VARIANTS, (True, False))


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_combination_resolves_as_before(variant):
    """Table-driven over every dtype x weight_dtype x cache_dtype x (native bf16 or not) the
    configs accept, as if on a CPU with each kernel variant: the same dtypes, the same kernel path
    and bf16 decision, the same refusals."""
    kernel = build.KernelInfo(variant, ())
    n = 0
    for dtype, wd, kd, v, native in _combinations():
        if v != variant:
            continue
        load, cache = LoadConfig(dtype=dtype, weight_dtype=wd), CacheConfig(cache_dtype=kd)
        try:
            want = before(dtype, wd, kd, kernel, native)
        except ValueError as e:
            with pytest.raises(ValueError, match="w8a8 needs" if str(e) == "w8a8" else "wider than"):
                resolve_precision(load, cache, kernel=kernel, native_bf16=native)
            continue
        p = resolve_precision(load, cache, kernel=kernel, native_bf16=native)
        got = (p.compute, p.weights, p.kv_cache, p.int8_activations, p.uses_kernels, p.bf16_products)
        assert got == want, (dtype, wd, kd, variant, native)
        assert p.kernel is kernel and p.device == "cpu"
        # prefill attention in bf16 beside bf16 products and beside w8a8 (its x is int8 already),
        # where vdpbf16ps is: the avx512 (or amx) variant running our kernels
        assert p.bf16_attention == (p.uses_kernels and variant in ("amx", "avx512") and (p.bf16_products or wd == "w8a8"))
        # and our flash attention in float32 wherever else our kernels run the model
        assert p.prefill_attention == ("bfloat16" if p.bf16_attention else "float32" if p.uses_kernels else "torch")
        assert p.products == ("int8" if wd == "w8a8" else "bfloat16" if p.bf16_products else dtype_name(p.compute))
        n += 1
    assert n > 100


def test_what_this_cpu_accepts_builds_the_model_the_precision_says():
    """On this machine's own kernels and CPU: every accepted pair builds a DecoderModel whose
    linears agree with the decision it was handed (the linears still read kernels/build.py
    themselves, so a disagreement would show here)."""
    cfg = tiny_model_config("llama")
    weights = load_dummy(cfg, torch.float32).weights
    kernel, native = build.kernel_info(), cpu_has_native_bf16()
    built = 0
    for dtype, wd in itertools.product(DTYPES, WEIGHT_DTYPES):
        try:
            want = before(dtype, wd, "auto", kernel, native)
        except ValueError:
            continue
        p = resolve_precision(LoadConfig(dtype=dtype, weight_dtype=wd))
        assert (p.compute, p.weights, p.kv_cache, p.int8_activations, p.uses_kernels, p.bf16_products) == want
        model = DecoderModel(cfg, weights, p)
        assert (model.dtype, model.weight_dtype, model.step_ok) == (p.compute, p.weights, p.uses_kernels)
        assert model.bf16_products == (bool(getattr(model.embed, "bf16_products", False)) and p.uses_kernels)
        qkv = model.layers[0].qkv
        assert p.uses_kernels <= bool(getattr(qkv, "use_kernels", True))  # kernels decided on, linears able
        built += 1
    assert built >= 12


def test_the_reasons_say_why_not_the_fast_path():
    none = build.KernelInfo("none", (), "turned off by INFERLAB_KERNELS=0")
    p = resolve_precision(LoadConfig(), kernel=none, native_bf16=False)
    assert p.reasons == ("no CPU kernels (turned off by INFERLAB_KERNELS=0)",
                         "dtype auto computes in float32 without our kernels (no native bf16 on this CPU)")
    p = resolve_precision(LoadConfig(dtype="bfloat16", weight_dtype="int8"), kernel=build.KernelInfo("avx2", ()))
    assert p.reasons == ("compute bfloat16: our kernels take float32 activations, so plain torch runs",
                         "int8 weights with bfloat16 compute: no kernel, dequantized per call")
    fast = resolve_precision(LoadConfig(), kernel=build.KernelInfo("avx512", ()))
    assert fast.reasons == () and fast.products == "bfloat16" and fast.weight_mode == "bfloat16"
    assert "K/V float16" in fast.describe() and "our avx512 kernels, bfloat16 products" in fast.describe()
    # decode attention multiplies in bf16 over a bfloat16 cache beside bf16 prefill attention only
    assert fast.bf16_attention and not fast.bf16_decode_attention  # "auto" K/V: float16, float32 arithmetic
    bf16_kv = resolve_precision(LoadConfig(), CacheConfig(cache_dtype="bfloat16"), kernel=build.KernelInfo("avx512", ()))
    assert bf16_kv.bf16_decode_attention
    f32 = resolve_precision(LoadConfig(dtype="float32"), CacheConfig(cache_dtype="bfloat16"),
                            kernel=build.KernelInfo("avx512", ()))
    assert not f32.bf16_attention and not f32.bf16_decode_attention  # float32 products: float32 attention
    with pytest.raises(dataclasses.FrozenInstanceError):  # nobody downstream changes a decision
        fast.compute = torch.float16  # type: ignore[misc]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("precision"), arch="llama")


def test_the_engine_resolves_once_and_passes_the_one_object_down(tiny, monkeypatch):
    """One resolve_precision call per engine (the loader does not resolve again); the runner and
    the decoder hold that very object, and the engine's report is its as_dict."""
    calls: list[ResolvedPrecision] = []

    def counting(*a, **kw):
        p = resolve_precision(*a, **kw)
        calls.append(p)
        return p

    monkeypatch.setattr(llm_engine, "resolve_precision", counting)
    monkeypatch.setattr(loader, "resolve_precision", counting)
    llm = LLM(str(tiny), kv_cache_dtype="int8", num_kv_blocks=8)
    engine = llm.engine
    assert len(calls) == 1 and calls[0] is engine.precision
    assert engine.runner.precision is engine.precision and engine.runner.model.precision is engine.precision
    assert engine.runner.kv_caches[0].k.dtype == engine.precision.kv_cache == torch.int8
    info = engine.info()
    p = info["precision"]
    assert {k: p[k] for k in engine.precision.as_dict(engine.model_config)} == engine.precision.as_dict(engine.model_config)
    assert p["kv_bytes_per_token"] == info["kv_cache"]["bytes_per_token"] == engine.runner.kv_bytes_per_token
    assert p["kernel_variant"] == info["kernels"]["variant"] == build.kernel_info().variant


def test_a_pair_the_machine_cannot_run_is_refused_before_loading(tiny, monkeypatch):
    """w8a8 without our kernels fails at resolution, before any weight is read."""
    monkeypatch.setattr(build, "kernel_info", lambda: build.KernelInfo("none", (), "off in this test"))
    loaded: list[object] = []
    monkeypatch.setattr(llm_engine, "load_model", lambda *a, **kw: loaded.append(a))
    with pytest.raises(ValueError, match="w8a8 needs"):
        LLM(str(tiny), weight_dtype="w8a8", num_kv_blocks=8)
    assert not loaded


def test_plan_vs_bench_plans_at_what_the_server_reports(tiny):
    """benchmarks/plan_vs_bench.py takes the plan's precisions and the simulator's KV blocks from
    GET /server_info (it used to assume float32 K/V, half the blocks the server has)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from plan_vs_bench import Served

    llm = LLM(str(tiny), weight_dtype="float32", num_kv_blocks=8)  # as the script serves: dtype auto
    p = llm.engine.precision
    served = Served.from_info(llm.engine.info())
    assert (served.weights, served.kv, served.num_blocks) == ("float32", str(p.kv_cache).removeprefix("torch."), 8)
    assert served.compute == ("bf16" if p.bf16_products else "fp32")
    if p.uses_kernels:  # dtype auto with our kernels: float16 K/V beside float32 weights
        assert served.kv == "float16"
    with pytest.raises(RuntimeError, match="no precision"):
        Served.from_info({"model": "llama-server"})
