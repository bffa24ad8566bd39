"""The fused decoder-layer operators (kernels/csrc/fused.cpp) against the torch operators they
replace: same numbers, same cache writes, and clear errors on wrong input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_marks import needs_int8_dot
from same_outputs import assert_same_greedy

from inferlab import LLM, SamplingParams
from inferlab.kernels import build
from inferlab.models import decoder
from inferlab.models.rope import apply_rope, rope_cache
from inferlab.models.testing import make_tiny_hf_model

pytestmark = pytest.mark.skipif(not build.available(), reason=f"kernels unavailable: {build.unavailable_reason()}")


@pytest.fixture(scope="module")
def ops():
    return torch.ops.inferlab


@pytest.mark.parametrize("t", [1, 7, 64])
def test_add_rms_norm_matches_torch(ops, t):
    g = torch.Generator().manual_seed(t)
    x, r, w = torch.randn(t, 96, generator=g), torch.randn(t, 96, generator=g), torch.randn(96, generator=g)
    got_x = x.clone()
    out = ops.add_rms_norm_(got_x, r, w, 1e-6)
    torch.testing.assert_close(got_x, x + r, rtol=0, atol=0)
    torch.testing.assert_close(out, F.rms_norm(x + r, (96,), w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("t", "heads", "kv_heads", "d"), [(1, 9, 3, 64), (5, 4, 4, 128), (33, 8, 2, 32)])
def test_rope_write_kv_matches_torch(ops, t, heads, kv_heads, d):
    g = torch.Generator().manual_seed(d + t)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g)
    cos, sin = rope_cache(d, 10000.0, None, 256, torch.float32)
    pos = torch.randint(0, 256, (t,), generator=g)
    slots = torch.randperm(300, generator=g)[:t]
    kc, vc = torch.full((kv_heads, 300, d), 7.0), torch.full((kv_heads, 300, d), 7.0)
    q, k = ops.rope_write_kv(qkv, pos, cos, sin, kc, vc, slots, heads, kv_heads, d)

    qr, kr, vr = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    torch.testing.assert_close(q, apply_rope(qr.reshape(t, heads, d), c, s), rtol=1e-5, atol=1e-5)
    k_ref = apply_rope(kr.reshape(t, kv_heads, d), c, s)
    torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kc[:, slots], k.transpose(0, 1), rtol=0, atol=0)  # the cache holds what it returns
    torch.testing.assert_close(vc[:, slots], vr.reshape(t, kv_heads, d).transpose(0, 1), rtol=0, atol=0)
    untouched = torch.ones(300, dtype=torch.bool)
    untouched[slots] = False
    assert bool((kc[:, untouched] == 7.0).all()) and bool((vc[:, untouched] == 7.0).all())


@pytest.mark.parametrize("d", [40, 64])
def test_bf16_stores_round_as_torch_does(ops, d):
    """Every float32 -> bf16 store (the vector paths of both kernel variants and their scalar tails)
    rounds to nearest even exactly as torch's conversion: ties, overflow to inf, inf and NaN.
    (Denormal inputs, below 1.2e-38, are left out: vcvtneps2bf16 flushes them to zero.)"""
    g = torch.Generator().manual_seed(d)
    qkv = torch.randn(3, 3 * d, generator=g) * 100
    v = qkv[:, 2 * d:]
    v[0, :8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.4e38, -3.4e38, 0.0, -0.0, 1e-30])
    tie = torch.tensor([0x3F808000, 0x3F818000, 0x3F80C000, 0x3F80FFFF], dtype=torch.int32).view(torch.float32)
    v[1, :4], v[1, -4:] = tie, tie  # halfway cases, in a vector lane and in the tail
    cos, sin = rope_cache(d, 10000.0, None, 8, torch.float32)
    kc, vc = torch.zeros(1, 4, d, dtype=torch.bfloat16), torch.zeros(1, 4, d, dtype=torch.bfloat16)
    ops.rope_write_kv(qkv, torch.arange(3), cos, sin, kc, vc, torch.arange(3), 1, 1, d)
    want = v.to(torch.bfloat16)
    got = vc[0, :3]
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])

    x, r, w = torch.randn(5, 100, generator=g), torch.randn(5, 100, generator=g), torch.randn(100, generator=g)
    out32 = ops.add_rms_norm_(x.clone(), r, w, 1e-6, False)
    assert torch.equal(ops.add_rms_norm_(x.clone(), r, w, 1e-6, True), out32.to(torch.bfloat16))


def test_rope_write_kv_rejects_a_slot_outside_the_cache(ops):
    cos, sin = rope_cache(8, 10000.0, None, 16, torch.float32)
    kc = vc = torch.zeros(1, 4, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rope_write_kv(torch.randn(1, 24), torch.tensor([0]), cos, sin, kc, vc, torch.tensor([4]), 1, 1, 8)


@pytest.mark.parametrize("m", [1, 3, 40])
def test_silu_mul_matches_torch(ops, m):
    x = torch.randn(m, 2 * 100, generator=torch.Generator().manual_seed(m))
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(x), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_silu_mul_is_exact_enough_over_the_whole_range(ops):
    """The vectorised exp is clamped to stay finite: huge gates give silu(g) = g or 0, not NaN."""
    gate = torch.tensor([[-1000.0, -100.0, -88.0, -20.0, -1e-3, 0.0, 1e-3, 3.0, 20.0, 88.0, 100.0, 1000.0]])
    gate = torch.cat([gate, gate.flip(1), gate[:, :3]], dim=1)  # both signs through the 8-wide path and the tail
    x = torch.cat([gate, torch.full_like(gate, 2.0)], dim=1)
    torch.testing.assert_close(ops.silu_mul(x), F.silu(gate) * 2.0, rtol=2e-6, atol=1e-30)


def test_the_operators_refuse_other_dtypes(ops):
    with pytest.raises(RuntimeError, match="float32"):
        ops.silu_mul(torch.randn(2, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="float32"):
        ops.add_rms_norm_(torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(2, 8), torch.ones(8), 1e-5)


# ---- the decoder's fused forward against its plain-operator forward ----


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("fused"), arch="llama")


def _generate(path, monkeypatch, fused: bool):
    """Greedy outputs on the "fused" backend or the "eager" one (decode steps too go through the
    operators: no "step" backend here)."""
    calls = []
    real = decoder.apply_rope

    def spy(*a, **kw):  # the eager layers rotate q and k in torch; the fused ones in rope_write_kv
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(decoder, "apply_rope", spy)
    # A small token budget: steps mix decodes with chunks of prompts, fresh and continued.
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=24, num_kv_blocks=96,
              decoder_backend="fused" if fused else "eager")
    assert llm.engine.runner.backends.fused_layers == fused
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (3, 16, 30, 45)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2))
    assert bool(calls) != fused  # the path asked for is the path taken
    return outs


def test_fused_forward_gives_the_same_tokens_and_logprobs(tiny_llama, monkeypatch):
    fused = _generate(tiny_llama, monkeypatch, True)
    plain = _generate(tiny_llama, monkeypatch, False)
    assert_same_greedy(fused, plain, top_ids=True)


@needs_int8_dot
def test_w8a8_norms_and_silu_handing_over_codes_change_no_bit(tiny_llama):
    """The fused layers of w8a8 in panels quantize the norms' and SiLU's rows as they make them
    (add_rms_norm_q8_, silu_mul_q8): the same tokens and logprobs, to the bit, as the rows
    handed over in float32 and quantized by the product."""
    llm = LLM(str(tiny_llama), weight_dtype="w8a8", max_num_batched_tokens=24, num_kv_blocks=96,
              decoder_backend="fused")
    model = llm.engine.runner.model
    assert model.q8_epilogues
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (3, 16, 30, 45)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    fused = llm.generate(prompts, params)
    model.q8_epilogues = False
    plain = llm.generate(prompts, params)
    def bits(out) -> list:
        return [(c.token_id, c.logprob, [(x.token_id, x.logprob) for x in top]) for c, top in out.outputs[0].logprobs]

    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert bits(a) == bits(b)
