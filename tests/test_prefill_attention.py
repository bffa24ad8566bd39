"""Prefill attention chunk by chunk: fresh prompts over their own new K/V (no cache reads, however
many share the step), continuing chunks over their own gathered context with a bottom-right
causal mask, decodes as before; metadata from the real `ModelRunner._prepare`.

The reference is computed independently, in float64, per request: softmax(q kᵀ · scale + causal)
v over the request's whole context, built from the K/V the test made (not read from the cache).
"""

from __future__ import annotations

import math
from dataclasses import fields

import pytest
import torch

from inferlab import LLM, SamplingParams
from inferlab.config import CacheConfig, LoadConfig
from inferlab.engine import model_runner
from inferlab.engine.model_runner import ModelRunner
from inferlab.engine.outputs import ScheduledRequest
from inferlab.kernels import build
from inferlab.models.attention import (
    CPU_PREFILL_TILE,
    TILED_FRESH_MAX,
    ContinuingChunk,
    FreshRun,
    causal_bias_band,
    meta_to,
    paged_attention,
)
from inferlab.models.dummy_loader import load_dummy
from inferlab.models.kv_cache import KVCache, dequantize_kv, quantize_kv
from inferlab.models.precision import resolve_precision
from inferlab.models.testing import make_tiny_hf_model, tiny_model_config

H, KVH, D, BS, NUM_BLOCKS = 6, 2, 64, 16, 160
SCALE = 0.125

# (start position, new tokens) of each request, in the scheduler's order: decodes, two fresh
# prompts of one length (longer than a tile, a partial last tile), a chunk continuing after 100
# cached tokens (not block-aligned, longer than a tile), two short fresh prompts, a short
# continuing chunk, a decode listed among the prefills (the runner puts it first), and a fresh
# prompt past TILED_FRESH_MAX (one untiled call).
SPEC = [(5, 1), (40, 1), (0, 150), (0, 150), (100, 70), (0, 30), (0, 30), (16, 5), (17, 1), (0, 530)]


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    cfg = tiny_model_config("llama")
    weights = load_dummy(cfg, torch.float32).weights
    cache = CacheConfig(block_size=BS, num_blocks_override=NUM_BLOCKS)
    return ModelRunner(cfg, weights, resolve_precision(LoadConfig(dtype="float32"), cache), cache)


def _scheduled(spec: list[tuple[int, int]], gen: torch.Generator) -> list[ScheduledRequest]:
    """Requests over distinct random blocks; block 0 is never anyone's."""
    free = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
    out = []
    for i, (start, n) in enumerate(spec):
        need = (start + n + BS - 1) // BS
        blocks, free = free[:need], free[need:]
        out.append(ScheduledRequest(f"r{i}", [3] * n, start, blocks, True, SamplingParams(), [], []))
    return out


def _slots(s: ScheduledRequest, positions: range) -> torch.Tensor:
    return torch.tensor([s.block_ids[p // BS] * BS + p % BS for p in positions])


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [n, H, D] at positions start.., k/v [start + n, KVH, D] -> [n, H, D], in float64."""
    n, ctx = q.shape[0], k.shape[0]
    qh = q.double().transpose(0, 1)  # [H, n, D]
    kh = k.double().transpose(0, 1).repeat_interleave(H // KVH, 0)  # [H, ctx, D]
    vh = v.double().transpose(0, 1).repeat_interleave(H // KVH, 0)
    allowed = torch.ones(n, ctx, dtype=torch.bool).tril(diagonal=start)  # key c <= start + i
    scores = (qh @ kh.transpose(1, 2) * SCALE).masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ vh).transpose(0, 1).float()


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


def _stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [.., D] as a cache of `dtype` gives it back (int8: codes x per-row scales)."""
    if dtype == torch.int8:
        codes, scale = quantize_kv(x)
        return dequantize_kv(codes, scale, torch.float32)
    return x.to(dtype).float()


def _run_case(runner: ModelRunner, spec: list[tuple[int, int]], seed: int = 0, products: str = "torch",
              cache_dtype: torch.dtype = torch.float32):
    """One step through _prepare + paged_attention against the per-request reference.

    The cache holds NaN wherever no request's context lives (unused blocks, the tails of last
    blocks) and in the fresh prompts' own slots: a fresh prompt that read the cache, or a chunk
    that read past its own context, would turn its rows into NaN. (Block 0 and the decodes' blocks
    are zeros instead: the decode SDPA fallback pads with them, masked, as before.)

    `products`: "torch" (SDPA), or our flash attention (kernels/csrc/prefill_attention.cpp) with
    "bfloat16" products (the avx512 variant; float32 sums), against the reference on the inputs
    it rounds (q x scale, K, V: from the cache's dtype where a chunk reads the cache), or
    "float32" ones (every variant), against the reference on the cache's values.
    """
    g = torch.Generator().manual_seed(seed)
    sched = _scheduled(spec, g)
    decodes = [s for s in sched if len(s.token_ids) == 1]
    prefills = [s for s in sched if len(s.token_ids) > 1]
    ordered = decodes + prefills
    _, positions, meta, _ = runner._prepare(decodes, prefills)
    t = positions.shape[0]

    q = torch.randn(t, H, D, generator=g)
    k = torch.randn(t, KVH, D, generator=g)
    v = torch.randn(t, KVH, D, generator=g)
    k_cache = torch.full((KVH, NUM_BLOCKS * BS, D), float("nan"))
    v_cache = torch.full((KVH, NUM_BLOCKS * BS, D), float("nan"))
    k_cache[:, :BS] = 0
    v_cache[:, :BS] = 0
    for s in decodes:
        for b in s.block_ids:
            k_cache[:, b * BS : (b + 1) * BS] = 0
            v_cache[:, b * BS : (b + 1) * BS] = 0
    expected = torch.empty(t, H, D)
    row = 0
    for s in ordered:
        n = len(s.token_ids)
        hist_k = torch.randn(s.start_pos, KVH, D, generator=g)
        hist_v = torch.randn(s.start_pos, KVH, D, generator=g)
        new = slice(row, row + n)
        if s.start_pos > 0:  # its history and its new tokens live in the cache
            k_cache[:, _slots(s, range(s.start_pos))] = hist_k.transpose(0, 1)
            v_cache[:, _slots(s, range(s.start_pos))] = hist_v.transpose(0, 1)
            k_cache[:, _slots(s, range(s.start_pos, s.start_pos + n))] = k[new].transpose(0, 1)
            v_cache[:, _slots(s, range(s.start_pos, s.start_pos + n))] = v[new].transpose(0, 1)
        kr, vr = torch.cat([hist_k, k[new]]), torch.cat([hist_v, v[new]])
        if products != "torch" and (n == 1 or products == "float32"):  # float32 products
            # a decode reads the cache's values, and so does a continuing chunk here
            stored = (lambda x: _stored(x, cache_dtype)) if s.start_pos > 0 else (lambda x: x)
            expected[new] = _reference(q[new], stored(kr), stored(vr), s.start_pos)
        elif products == "bfloat16":  # SCALE is a power of two: rounding q x SCALE is rounding q
            from_cache = (lambda x: _bf16(_stored(x, cache_dtype))) if s.start_pos > 0 else _bf16
            expected[new] = _reference(_bf16(q[new]), from_cache(kr), from_cache(vr), s.start_pos)
        else:
            expected[new] = _reference(q[new], kr, vr, s.start_pos)
        row += n
    if cache_dtype == torch.int8:  # codes and scales of the float cache (NaN stays outside every context)
        (kq, ks), (vq, vs) = quantize_kv(k_cache), quantize_kv(v_cache)
        cache = KVCache(kq, vq, ks, vs)
    else:
        cache = KVCache(k_cache.to(cache_dtype), v_cache.to(cache_dtype))
    # kv_written: the cache is as the test left it (a fused op would have written it).
    with torch.profiler.profile() as prof:
        out = paged_attention(q, k, v, cache, meta, SCALE, kv_written=True, prefill=products)
    ran = {e.key for e in prof.key_averages()}
    if products != "torch":  # the kernel ran, for each kind of chunk present (int8: gathered, then the same kernel)
        suffix = {"bfloat16": "bf16", "float32": "f32"}[products]
        paged = bool(meta.prefill.continuing) and cache_dtype != torch.int8
        assert (f"inferlab::prefill_attention_{suffix}" in ran) == (bool(meta.prefill.fresh) or
                                                                   (bool(meta.prefill.continuing) and not paged)), ran
        assert (f"inferlab::prefill_attention_paged_{suffix}" in ran) == paged, ran
    else:
        assert not any("inferlab::prefill_attention" in key for key in ran), ran
    assert not out.isnan().any()
    if products == "bfloat16":  # P rounded to bf16: ~2^-9 relative per weight
        torch.testing.assert_close(out.view(t, H, D), expected, atol=1e-2, rtol=1e-2)
    else:
        torch.testing.assert_close(out.view(t, H, D), expected, atol=2e-5, rtol=1e-4)
    return meta


def test_metadata_groups_fresh_runs_and_continuing_chunks(runner):
    meta = _run_case(runner, SPEC)
    p = meta.prefill
    nd = 3  # the three decodes first, then the prefills in the scheduler's order
    assert meta.num_decode_tokens == nd
    assert p.fresh == (FreshRun(nd, 2, 150), FreshRun(nd + 370, 2, 30), FreshRun(nd + 435, 1, 530))
    assert p.continuing == (ContinuingChunk(nd + 300, 70, 100), ContinuingChunk(nd + 430, 5, 16))
    assert p.tile == CPU_PREFILL_TILE
    assert p.block_tables.shape == (2, (100 + 70 + BS - 1) // BS)


def test_many_fresh_prompts_alone_need_no_mask(runner):
    """Eight fresh 64-token prompts (one tile each): one run, plain causal, no mask built; the
    same for a prompt too long to tile."""
    meta = _run_case(runner, [(0, 64)] * 8 + [(9, 1)], seed=1)
    assert meta.prefill.fresh == (FreshRun(1, 8, 64),)
    assert meta.prefill.causal_bias is None and not meta.prefill.continuing
    meta = _run_case(runner, [(0, TILED_FRESH_MAX + 1)], seed=4)  # one untiled is_causal call
    assert meta.prefill.causal_bias is None and meta.prefill.fresh == (FreshRun(0, 1, TILED_FRESH_MAX + 1),)


@pytest.mark.parametrize("tile", ["whole chunk", 16, 1])
def test_other_tile_sizes(runner, monkeypatch, tile):
    """Whole chunks (what a GPU gets), small tiles, one query per call: the same answers."""
    pick = (lambda device, longest: longest) if tile == "whole chunk" else (lambda device, longest: tile)
    monkeypatch.setattr(model_runner, "prefill_tile", pick)
    meta = _run_case(runner, SPEC, seed=2)
    assert meta.prefill.tile == (530 if tile == "whole chunk" else tile)


@pytest.mark.skipif(not build.kernel_info().bf16_dot,
                    reason=f"needs the avx512 kernel variant (AVX512_BF16); this CPU runs {build.kernel_info().variant}")
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
def test_bf16_products_kernel(runner, cache_dtype):
    """The avx512 flash attention (kernels/csrc/prefill_attention.cpp) on every kind of chunk:
    fresh runs straight from the flat batch, continuing chunks read from the paged cache in
    place (NaN everywhere else in it), decodes beside them."""
    _run_case(runner, SPEC, seed=6, products="bfloat16", cache_dtype=cache_dtype)
    _run_case(runner, [(0, 64)] * 8 + [(0, 2), (0, 3)], seed=7, products="bfloat16", cache_dtype=cache_dtype)


@pytest.mark.skipif(not build.available(), reason=f"our kernels do not load here: {build.unavailable_reason()}")
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
def test_float32_products_kernel(runner, cache_dtype):
    """The same flash attention with float32 products (every kernel variant) on every kind of
    chunk, to float32 rounding: a continuing chunk of 5 after 16 is what speculative decoding's
    verification rows look like."""
    _run_case(runner, SPEC, seed=8, products="float32", cache_dtype=cache_dtype)
    _run_case(runner, [(0, 64)] * 8 + [(0, 2), (0, 3)], seed=9, products="float32", cache_dtype=cache_dtype)


@pytest.mark.parametrize("suffix", ["bf16", "f32"])
def test_flash_attention_rejects_bad_shapes(suffix):
    if not build.available():
        pytest.skip(f"our kernels do not load here: {build.unavailable_reason()}")
    if suffix == "bf16" and not build.kernel_info().bf16_dot:
        pytest.skip(f"needs the avx512 kernel variant (AVX512_BF16); this CPU runs {build.kernel_info().variant}")
    fresh, paged = getattr(torch.ops.inferlab, f"prefill_attention_{suffix}"), \
        getattr(torch.ops.inferlab, f"prefill_attention_paged_{suffix}")
    q, out = torch.zeros(1, 4, 6, 64), torch.zeros(1, 4, 6, 64)
    with pytest.raises(RuntimeError, match="keys for queries"):
        fresh(q, torch.zeros(1, 3, 2, 64), torch.zeros(1, 3, 2, 64), out, 0, SCALE)
    with pytest.raises(RuntimeError, match="share"):
        fresh(q, torch.zeros(1, 4, 4, 64), torch.zeros(1, 4, 4, 64), out, 0, SCALE)
    with pytest.raises(RuntimeError, match="must be float32, float16 or bfloat16"):
        fresh(q, torch.zeros(1, 4, 2, 64, dtype=torch.int8), torch.zeros(1, 4, 2, 64, dtype=torch.int8), out, 0,
              SCALE)
    cache = torch.zeros(2, 4 * BS, 64)
    with pytest.raises(RuntimeError, match=f"prefill_attention_paged_{suffix}: block 7 is outside the cache"):
        paged(q, cache, cache, torch.tensor([7]), BS, out, 0, SCALE)


def test_the_model_decides_prefill_attention_once():
    """bf16 prefill attention exactly where the linears multiply in bf16, ours in float32 wherever
    else our kernels run the model, torch's elsewhere (one decision, models/precision.py)."""
    cfg = tiny_model_config("llama")
    from inferlab.models.decoder import DecoderModel

    weights = load_dummy(cfg, torch.float32).weights
    exact = DecoderModel(cfg, weights, resolve_precision(LoadConfig(dtype="float32")))
    assert not exact.bf16_products
    assert exact.prefill_attention == ("float32" if build.available() else "torch")
    m16 = DecoderModel(cfg, weights, resolve_precision(LoadConfig(dtype="float32", weight_dtype="bfloat16")))
    assert m16.bf16_products == build.kernel_info().bf16_dot
    assert m16.prefill_attention == ("bfloat16" if build.kernel_info().bf16_dot else exact.prefill_attention)
    assert resolve_precision(LoadConfig(dtype="bfloat16")).prefill_attention == "torch"  # no kernels there


def test_causal_bias_band_slices():
    """Every slice the attention takes is the causal mask of its tile."""
    tile, m = 4, 10
    band = causal_bias_band(tile, m, torch.float32)
    for o in range(m):
        for r in range(1, min(tile, m - o) + 1):
            got = band[:r, m - o : m + r] == 0
            want = torch.tensor([[c <= o + i for c in range(o + r)] for i in range(r)])
            assert torch.equal(got, want), (o, r)


def test_meta_to_moves_the_prefill_tensors(runner):
    g = torch.Generator().manual_seed(3)
    sched = _scheduled(SPEC, g)
    _, _, meta, _ = runner._prepare([s for s in sched if len(s.token_ids) == 1],
                                    [s for s in sched if len(s.token_ids) > 1])
    moved = meta_to(meta, torch.device("meta"))
    for f in fields(meta.prefill):
        old, new = getattr(meta.prefill, f.name), getattr(moved.prefill, f.name)
        if isinstance(old, torch.Tensor):
            assert new.device.type == "meta" and new.shape == old.shape and new.dtype == old.dtype, f.name
        else:
            assert new == old, f.name


# ---- the engine: a batch of prompts generates what each prompt does alone ----


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    return make_tiny_hf_model(
        tmp_path_factory.mktemp("prefill"), arch="llama", hidden_size=96, num_attention_heads=6,
        num_key_value_heads=2, head_dim=64,
    )


def test_batched_prompts_generate_as_alone(gqa_model):
    """Fresh prompts several to a step, chunks continued across steps and after prefix-cache
    hits, decodes alongside: the same greedy tokens (and logprobs) as each prompt alone."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (150, 150, 150, 90, 200, 20)]
    shared = prompts[0][:96]  # a second batch hits the prefix cache on these six blocks
    prompts += [shared + torch.randint(3, 250, (n,), generator=g).tolist() for n in (60, 60, 33)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)

    alone_llm = LLM(str(gqa_model), dtype="float32", num_kv_blocks=128, enable_prefix_caching=False)
    alone = [alone_llm.generate(p, params)[0].outputs[0] for p in prompts]

    llm = LLM(str(gqa_model), dtype="float32", max_num_batched_tokens=400, num_kv_blocks=256)
    seen = []
    real = llm.engine.runner._prepare

    def spy(decodes, prefills):
        out = real(decodes, prefills)
        p = out[2].prefill
        if p is not None:
            seen.append((sum(r.count for r in p.fresh), len(p.continuing), len(decodes)))
        return out

    llm.engine.runner._prepare = spy
    batched = [o.outputs[0] for o in llm.generate(prompts[:6], params)]
    batched += [o.outputs[0] for o in llm.generate(prompts[6:], params)]

    assert any(f >= 2 for f, _, _ in seen), seen  # several fresh prompts in one step
    assert any(f >= 1 and c >= 1 and d >= 1 for f, c, d in seen), seen  # everything in one step
    assert any(c >= 2 for _, c, _ in seen), seen  # prefix-cache hits: several continuing chunks
    for i, (a, b) in enumerate(zip(alone, batched)):
        assert b.token_ids == a.token_ids, i
        for (ca, _), (cb, _) in zip(a.logprobs, b.logprobs):
            assert math.isclose(ca.logprob, cb.logprob, rel_tol=1e-4, abs_tol=1e-4), i
