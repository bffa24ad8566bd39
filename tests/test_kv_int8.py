"""`--kv-cache-dtype int8`: K/V stored as int8 codes with one float32 scale per (token, KV head).

The format's round trip is bounded by half a quantization step; every writer (torch, the fused
rope_write_kv) stores the same codes; the decode kernel on an int8 cache matches float32
attention over the dequantized cache tightly (so it reads the codes and the scales it should)
and over the original float32 cache loosely (what int8 costs), on each kernel variant the CPU
has; a tiny model generates the same greedy tokens through DecoderStep, the per-operator path
and the plain-torch path, also with chunked prefill and prefix-cache hits; and the same memory
holds ~1.9x float16's tokens.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from same_outputs import assert_same_greedy

from inferlab import LLM, SamplingParams
from inferlab.config import CacheConfig, LoadConfig, ModelConfig
from inferlab.engine.model_runner import num_kv_blocks
from inferlab.kernels import build
from inferlab.models.attention import decode_attention_kernel, decode_attention_sdpa, gather_kv, padded_slots_and_mask
from inferlab.models.kv_cache import KVCache, allocate_kv_cache, dequantize_kv, kv_bytes_per_token, quantize_kv
from inferlab.models.precision import resolve_precision
from inferlab.models.testing import make_tiny_hf_model

needs_kernels = pytest.mark.skipif(
    not build.available(), reason=f"inferlab CPU kernels unavailable: {build.unavailable_reason()}"
)


# ---- the format ----


def test_round_trip_is_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, 64, generator=g) * torch.logspace(-4, 2, 50).view(1, 50, 1)  # rows of every magnitude
    x[1, 7] = 0.0  # a zero row
    codes, scale = quantize_kv(x)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (3, 50)
    torch.testing.assert_close(scale, x.abs().amax(-1) / 127, rtol=0, atol=0)
    assert codes.abs().amax(-1)[scale > 0].eq(127).all()  # the largest value of a row uses the whole range
    assert scale[1, 7] == 0 and codes[1, 7].eq(0).all()
    err = (dequantize_kv(codes, scale, torch.float32) - x).abs()
    assert (err <= scale.unsqueeze(-1) * (0.5 + 1e-5)).all()
    assert (err.amax(-1) / x.abs().amax(-1).clamp_min(1e-30)).max() <= 0.5 / 127 + 1e-6  # relative to the row


def test_int8_cache_structure():
    caches = allocate_kv_cache(2, 3, 16, 32, torch.int8)
    c = caches[0]
    assert c.quantized and c.dtype == torch.int8 and c.k.shape == (3, 32, 16) and c.k_scale.shape == (3, 32)
    assert c.nbytes == 2 * (3 * 32 * 16 + 3 * 32 * 4)
    assert not allocate_kv_cache(1, 3, 16, 32, torch.float16)[0].quantized
    with pytest.raises(ValueError, match="k_scale"):
        KVCache(c.k, c.v)  # int8 codes without their scales


def test_gather_kv_dequantizes_the_blocks():
    kv = allocate_kv_cache(1, 2, 8, 64, torch.int8)[0]
    x = torch.randn(2, 64, 8)
    kv.k.copy_(quantize_kv(x)[0])
    kv.k_scale.copy_(quantize_kv(x)[1])
    blocks = torch.tensor([3, 0, 2])
    k, _ = gather_kv(kv, blocks, 16, 40, torch.float32)
    slots = torch.cat([torch.arange(b * 16, b * 16 + 16) for b in blocks.tolist()])[:40]
    torch.testing.assert_close(k[0], dequantize_kv(kv.k[:, slots], kv.k_scale[:, slots], torch.float32))


def test_kv_cache_dtype_int8_resolves_once():
    assert resolve_precision(LoadConfig(), CacheConfig(cache_dtype="int8")).kv_cache == torch.int8
    with pytest.raises(ValueError, match="cache_dtype"):
        CacheConfig(cache_dtype="int4")


def test_the_same_memory_holds_about_twice_float16s_tokens():
    # SmolLM2-135M's shape: the scale costs 4 bytes per 64 codes (at a smaller head_dim, more).
    config = ModelConfig("llama", 49152, 576, 1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)
    cache = CacheConfig(kv_cache_memory=64 << 20)
    n16, n8 = (num_kv_blocks(cache, kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, dt))
               for dt in (torch.float16, torch.int8))
    d = config.head_dim
    assert n8 / n16 == pytest.approx(2 * d / (d + 4), rel=0.01)  # 1.88x at head_dim 64
    assert 1.7 < n8 / n16 < 2.0
    per_token = kv_bytes_per_token(config.num_layers, config.num_kv_heads, d, torch.int8)
    assert per_token == 2 * config.num_layers * config.num_kv_heads * (d + 4)


# ---- the writers ----


@needs_kernels
def test_rope_write_kv_stores_torchs_codes():
    t, h, kvh, d, slots = 5, 4, 2, 64, 48
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g) * 3
    qkv[2, (h + kvh) * d :] = 0  # a zero V row
    pos = torch.tensor([0, 3, 7, 1, 30])
    where = torch.tensor([5, 17, 0, 40, 33])
    ang = torch.randn(64, d // 2, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, 1), torch.cat([ang.sin()] * 2, 1)
    kv = allocate_kv_cache(1, kvh, d, slots, torch.int8)[0]
    _, k = torch.ops.inferlab.rope_write_kv(qkv, pos, cos, sin, kv.k, kv.v, where, h, kvh, d, kv.k_scale, kv.v_scale)
    v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
    for new, codes, scales in ((k, kv.k, kv.k_scale), (v, kv.v, kv.v_scale)):
        want_c, want_s = quantize_kv(new.transpose(0, 1))
        assert torch.equal(codes[:, where], want_c)
        assert torch.equal(scales[:, where], want_s)
    assert kv.v_scale[:, 0].eq(0).all()
    with pytest.raises(RuntimeError, match="exactly when the caches are int8"):
        torch.ops.inferlab.rope_write_kv(qkv, pos, cos, sin, kv.k, kv.v, where, h, kvh, d)


# ---- the decode kernel on an int8 cache ----


def _int8_case(d: int, lens: list[int], bs: int = 16, heads: int = 6, kv_heads: int = 2, seed: int = 0):
    """A float32 cache with rows of varied magnitude, its int8 copy, and shuffled block tables."""
    g = torch.Generator().manual_seed(seed)
    need = [(n + bs - 1) // bs for n in lens]
    num_blocks = sum(need) + 5
    k = torch.randn(kv_heads, num_blocks * bs, d, generator=g) * torch.rand(kv_heads, num_blocks * bs, 1, generator=g) * 4
    v = torch.randn(kv_heads, num_blocks * bs, d, generator=g)
    perm, rows, at = torch.randperm(num_blocks, generator=g).tolist(), [], 0
    for n in need:
        rows.append(perm[at : at + n] + [0] * (max(need) - n))
        at += n
    q = torch.randn(len(lens), heads, d, generator=g)
    (kc, ks), (vc, vs) = quantize_kv(k), quantize_kv(v)
    return q, (k, v), KVCache(kc, vc, ks, vs), torch.tensor(rows, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


def _sdpa(q, k, v, tables, lens, bs, scale, k_scale=None, v_scale=None):
    slots, mask = padded_slots_and_mask(tables, bs, lens.long() - 1, 1, int(lens.max()))
    return decode_attention_sdpa(q, k, v, slots, mask, scale, k_scale, v_scale)


def check_kernel_on_an_int8_cache(expect_variant: str = "") -> None:
    """The kernel over int8 codes against float32 SDPA over the dequantized rows (tight) and
    over the float32 rows they came from (loose). Run in-process or in a child process that was
    given another INFERLAB_KERNELS."""
    if expect_variant:
        assert build.kernel_info().variant == expect_variant, build.kernel_info()
    for d in (64, 128, 20):  # the two unrolled head_dims and the generic loop with a tail
        lens = [1, 15, 16, 17, 300]
        q, (k, v), kv, tables, ctx = _int8_case(d, lens)
        scale = d**-0.5
        got = decode_attention_kernel(q, kv.k, kv.v, tables, ctx, 16, scale, kv.k_scale, kv.v_scale)
        deq = _sdpa(q, dequantize_kv(kv.k, kv.k_scale, torch.float32), dequantize_kv(kv.v, kv.v_scale, torch.float32),
                    tables, ctx, 16, scale)
        torch.testing.assert_close(got, deq, atol=2e-5, rtol=1e-5)
        fallback = _sdpa(q, kv.k, kv.v, tables, ctx, 16, scale, kv.k_scale, kv.v_scale)  # the SDPA path's dequant
        torch.testing.assert_close(fallback, deq, atol=1e-6, rtol=1e-6)
        exact = _sdpa(q, k, v, tables, ctx, 16, scale)
        err = (got - exact).abs()
        # int8 is lossy (a context of one is off by up to half a step of its V row's codes,
        # ~0.01 here; longer ones average over rows but K's error moves the softmax too).
        assert 1e-4 < err.max().item() < 0.1 and err.mean().item() < 0.01, (err.max().item(), err.mean().item())


@needs_kernels
@pytest.mark.parametrize("variant", ["avx512", "avx2"])
def test_decode_kernel_on_an_int8_cache(variant):
    missing = sorted(set(build.VARIANTS[variant][0]) - build.cpu_flags())
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}: no {variant} kernel variant to test")
    if build.kernel_info().variant == variant:
        check_kernel_on_an_int8_cache(variant)
        return
    # One variant per process (both register torch.ops.inferlab): the other one in a child.
    env = {**os.environ, "INFERLAB_KERNELS": variant}
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"import test_kv_int8 as t; t.check_kernel_on_an_int8_cache({variant!r})")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]


@needs_kernels
def test_decode_kernel_refuses_int8_without_scales():
    q, _, kv, tables, ctx = _int8_case(64, [5, 20])
    with pytest.raises(ValueError, match="exactly when the caches are int8"):
        decode_attention_kernel(q, kv.k, kv.v, tables, ctx, 16, 0.1)
    with pytest.raises(ValueError, match=r"float32 \[kvH, slots\]"):
        decode_attention_kernel(q, kv.k, kv.v, tables, ctx, 16, 0.1, kv.k_scale[:, :-16], kv.v_scale)


# ---- a tiny model end to end ----


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # 6 heads over 2 KV heads of 64: GQA and the kernel's unrolled head_dim.
    return make_tiny_hf_model(tmp_path_factory.mktemp("kv8"), arch="llama", hidden_size=96, num_attention_heads=6,
                              num_key_value_heads=2, head_dim=64)


PATHS = {  # name -> (decoder backend, attention backend), models/backends.py
    "step": ("step", "paged"),
    "operators": ("fused", "paged"),
    "plain torch": ("eager", "sdpa"),
}


def _generate(model, monkeypatch, path: str, prompts, kv_cache_dtype: str = "int8", **llm_kw):
    """Greedy outputs on one path (int8 K/V unless told): (outputs, continuing prefill chunks per step, whether
    a DecoderStep was built)."""
    forward, attention = PATHS[path]
    llm = LLM(str(model), dtype="float32", weight_dtype="float32", kv_cache_dtype=kv_cache_dtype,
              decoder_backend=forward, attention_backend=attention, **llm_kw)
    assert llm.engine.runner.kv_caches[0].quantized == (kv_cache_dtype == "int8")
    seen: list[int] = []
    real_prepare = llm.engine.runner._prepare

    def spy(decodes, prefills):
        out = real_prepare(decodes, prefills)
        p = out[2].prefill
        seen.append(len(p.continuing) if p is not None else 0)
        return out

    llm.engine.runner._prepare = spy
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    outs = [o for batch in prompts for o in llm.generate(batch, params)]
    built = llm.engine.runner.model._step is not None
    return outs, seen, built


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: DecoderStep's q/k norm before the K write
def test_the_three_paths_generate_alike_with_an_int8_cache(tiny, tmp_path, monkeypatch, arch):
    model = tiny if arch == "llama" else make_tiny_hf_model(tmp_path / arch, arch=arch)
    g = torch.Generator().manual_seed(2)
    prompts = [[torch.randint(3, 250, (int(n),), generator=g).tolist() for n in (3, 17, 40, 9, 33)]]
    runs = {p: _generate(model, monkeypatch, p, prompts, num_kv_blocks=64) for p in PATHS}
    assert runs["step"][2] and not runs["operators"][2]  # DecoderStep ran only where asked
    for p in ("operators", "plain torch"):
        assert_same_greedy(runs[p][0], runs["step"][0], tol=2e-3, top_ids=True)


@needs_kernels
def test_chunked_prefill_and_prefix_hits_read_the_int8_cache(tiny, monkeypatch):
    """Long prompts in chunks of at most 64 tokens, then prompts sharing a cached prefix: the
    continuing chunks attend over dequantized blocks, alike on every path, and close to a
    float32 cache (codes read as values, or the wrong scales, would not be)."""
    g = torch.Generator().manual_seed(4)
    first = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (150, 90, 20)]
    second = [first[0][:96] + torch.randint(3, 250, (n,), generator=g).tolist() for n in (40, 7)]
    kw = dict(num_kv_blocks=128, max_num_batched_tokens=64, long_prefill_token_threshold=64)
    runs = {p: _generate(tiny, monkeypatch, p, [first, second], **kw) for p in PATHS}
    outs, seen, _ = runs["step"]
    assert any(c >= 1 for c in seen), seen  # continuing chunks happened
    assert [o.num_cached_tokens for o in outs[3:]] == [96, 96]  # the second batch hit the prefix cache
    for p in ("operators", "plain torch"):
        assert_same_greedy(runs[p][0], outs, tol=2e-3, top_ids=True)
    exact, _, _ = _generate(tiny, monkeypatch, "step", [first, second], kv_cache_dtype="float32", **kw)
    assert_same_greedy(outs, exact, tol=0.05)  # measured: within 0.018 of float32's logprobs


def test_server_info_reports_the_int8_cache(tiny):
    llm = LLM(str(tiny), dtype="float32", kv_cache_dtype="int8", kv_cache_memory=8 << 20)
    info = llm.engine.info()
    cfg = llm.engine.model_config
    assert info["precision"]["kv_cache"] == "int8" and info["kv_cache"]["dtype"] == "int8"
    assert info["kv_cache"]["bytes_per_token"] == 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + 4)
    f16 = LLM(str(tiny), dtype="float32", kv_cache_dtype="float16", kv_cache_memory=8 << 20)
    assert 1.8 < llm.engine.num_blocks / f16.engine.num_blocks < 2.0
    assert f16.engine.info()["kv_cache"]["bytes_per_token"] == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
