"""models/backends.py: the forward and decode-attention backends chosen once, what each model and
machine gets, and every registered pair giving the definition's tokens."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from same_outputs import assert_same_greedy

from inferlab import LLM, SamplingParams
from inferlab.config import CacheConfig, LoadConfig
from inferlab.engine.engine_args import EngineArgs
from inferlab.kernels import build
from inferlab.models import decoder
from inferlab.models.attention import PagedDecode
from inferlab.models.backends import ATTENTION, FORWARD, select_backends
from inferlab.models.precision import resolve_precision
from inferlab.models.testing import make_tiny_hf_model, tiny_model_config

needs_kernels = pytest.mark.skipif(not build.available(), reason=f"kernels unavailable: {build.unavailable_reason()}")
AVX512 = build.KernelInfo("avx512", ())
NONE = build.KernelInfo("none", (), "off in this test")


def _select(forward="auto", attention="auto", kernel=AVX512, qk_norm=False, **load):
    cache = CacheConfig(cache_dtype=load.pop("cache_dtype", "auto"))
    p = resolve_precision(LoadConfig(**load), cache, kernel=kernel, native_bf16=True)
    model = dataclasses.replace(tiny_model_config(), qk_norm=qk_norm)
    return select_backends(p, model, forward, attention)


def test_auto_takes_the_fastest_path_the_machine_runs():
    fast = _select()
    assert (fast.forward, fast.decode_step, fast.fused_layers, fast.paged_decode, fast.fused_sampler) == \
        ("step", True, True, True, True)
    assert fast.reasons == ()
    plain = _select(kernel=NONE)
    assert (plain.forward, plain.decode_step, plain.fused_layers, plain.paged_decode, plain.fused_sampler) == \
        ("eager", False, False, False, False)


def test_what_a_model_or_a_cache_lacks_downgrades_one_part_and_says_why():
    qwen3 = _select(qk_norm=True)  # the decode step applies q/k norms; the fused layer cannot
    assert qwen3.decode_step and not qwen3.fused_layers and "q/k norms" in qwen3.reasons[0]
    for kv in ("float32", "bfloat16", "float16", "int8"):  # every cache the paged kernel reads, the step reads
        cache = _select(dtype="float32", cache_dtype=kv)
        assert cache.paged_decode and cache.decode_step and cache.reasons == (), kv
    bf16 = _select("step", dtype="bfloat16")  # bf16 activations: no fused kernels, eager layers
    assert (bf16.decode_step, bf16.fused_layers) == (False, False) and "float32 activations" in bf16.reasons[0]
    assert bf16.paged_decode  # the attention kernel takes a bf16 query
    no_kernels = _select(attention="paged", kernel=NONE)
    assert not no_kernels.paged_decode and "paged kernel needs" in no_kernels.reasons[0]


def test_the_backends_asked_for_are_the_ones_chosen():
    for forward, attention in itertools.product(FORWARD, ATTENTION):
        b = _select(forward, attention, dtype="float32")
        assert b.forward == forward and b.attention == attention
        assert b.decode_step == (forward == "step" and attention == "paged")  # the step reads block tables
        assert b.fused_layers == FORWARD[forward].fused_layers


def test_an_unknown_backend_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="decoder_backend must be one of auto, step, fused, eager"):
        LoadConfig(decoder_backend="turbo")
    with pytest.raises(ValueError, match="attention_backend must be one of auto, paged, sdpa"):
        EngineArgs(attention_backend="flash").create_engine_config()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("backends"), arch="llama")


def _generate(path, monkeypatch, forward: str, attention: str):
    """Greedy outputs and what ran: whether a DecoderStep was called, decode metadata kinds."""
    steps: list[bool] = []
    real_step = decoder.DecoderModel._decode_step
    monkeypatch.setattr(decoder.DecoderModel, "_decode_step",
                        lambda self, *a: steps.append(True) or real_step(self, *a))
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=24, num_kv_blocks=96, decoder_backend=forward,
              attention_backend=attention)
    kinds: set[bool] = set()
    real_prepare = llm.engine.runner._prepare

    def spy(decodes, prefills):
        out = real_prepare(decodes, prefills)
        if out[2].decode is not None:
            kinds.add(isinstance(out[2].decode, PagedDecode))
        return out

    llm.engine.runner._prepare = spy
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (3, 16, 30)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2))
    info = llm.engine.info()["backends"]
    assert (info["forward"], info["decode_attention"]) == (forward, attention)  # reported as chosen
    return outs, bool(steps), kinds


@needs_kernels
@pytest.mark.parametrize("forward,attention", list(itertools.product(FORWARD, ATTENTION)))
def test_every_registered_pair_gives_the_definitions_tokens(tiny, monkeypatch, forward, attention):
    """Each forward x attention backend against eager + sdpa (plain torch operators), in float32,
    over steps that mix decodes with fresh and continued prompt chunks; and the path asked for is
    the path taken."""
    outs, stepped, kinds = _generate(tiny, monkeypatch, forward, attention)
    ref, ref_stepped, ref_kinds = _generate(tiny, monkeypatch, "eager", "sdpa")
    assert not ref_stepped and ref_kinds == {False}
    assert stepped == (forward == "step" and attention == "paged")
    assert kinds == {attention == "paged"}
    assert_same_greedy(outs, ref, top_ids=True)
