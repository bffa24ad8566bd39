"""The paged-attention decode kernel against the SDPA path it replaces, and the engine with it
on and off.

Caches are random with shuffled, non-contiguous block tables, so a kernel that read the wrong
block, the wrong head or past a context's end would disagree with the reference. The SDPA
fallback tests run whether or not the kernels build.
"""

from __future__ import annotations

import pytest
import torch
from same_outputs import assert_same_greedy

from inferlab import LLM, SamplingParams
from inferlab.kernels import build
from inferlab.models import attention
from inferlab.models.attention import (
    AttentionMetadata,
    GatheredDecode,
    PagedDecode,
    decode_attention_kernel,
    decode_attention_sdpa,
    padded_slots_and_mask,
    paged_attention,
)
from inferlab.models.kv_cache import KVCache
from inferlab.models.testing import make_tiny_hf_model

needs_kernels = pytest.mark.skipif(
    not build.available(), reason=f"inferlab CPU kernels unavailable: {build.unavailable_reason()}"
)


def make_case(batch, heads, kv_heads, head_dim, lens, block_size=16, dtype=torch.float32, seed=0, spare_blocks=7):
    """Random caches; each request's blocks drawn without replacement from a shuffled pool."""
    g = torch.Generator().manual_seed(seed)
    need = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(need) + spare_blocks
    slots = num_blocks * block_size
    k_cache = torch.randn(kv_heads, slots, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(kv_heads, slots, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    rows, at = [], 0
    for k in need:
        rows.append(perm[at : at + k] + [0] * (max(need) - k))
        at += k
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, torch.tensor(rows, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


def sdpa_reference(q, k_cache, v_cache, tables, lens, block_size, scale):
    """The fallback path over the same block tables, in float32."""
    slots, mask = padded_slots_and_mask(tables, block_size, lens.long() - 1, 1, int(lens.max()))
    return decode_attention_sdpa(q.float(), k_cache.float(), v_cache.float(), slots, mask, scale)


def naive_reference(q, k_cache, v_cache, tables, lens, block_size, scale, bf16=False):
    """One sequence, one head at a time, straight from the definition. `bf16`: with bf16
    products: the scaled query and the probabilities rounded to bf16 (K and V are bf16 already),
    everything else float64, the probabilities normalised by their rounded sum."""
    b, h, d = q.shape
    group = h // k_cache.shape[0]
    out = torch.empty(b, h, d, dtype=torch.float64)
    for i in range(b):
        n = int(lens[i])
        slots = torch.tensor([int(tables[i, p // block_size]) * block_size + p % block_size for p in range(n)])
        for j in range(h):
            k = k_cache[j // group, slots].double()
            v = v_cache[j // group, slots].double()
            if bf16:
                s = k @ (q[i, j].float() * scale).bfloat16().double()
                p = torch.exp(s - s.max()).bfloat16().double()
                p = p / p.sum()
            else:
                p = torch.softmax(k @ q[i, j].double() * scale, 0)
            out[i, j] = p @ v
    return out


LENS_ONE = [1, 15, 16, 17, 300]
LENS_33 = (LENS_ONE * 7)[:33]


# ---- the fallback (always runs) ----


def test_sdpa_fallback_matches_definition():
    q, kc, vc, tables, lens = make_case(5, 6, 2, 24, LENS_ONE)
    got = sdpa_reference(q, kc, vc, tables, lens, 16, 0.3)
    torch.testing.assert_close(got.double(), naive_reference(q, kc, vc, tables, lens, 16, 0.3), atol=1e-5, rtol=1e-5)


def test_padded_slots_and_mask_layout():
    tables = torch.tensor([[3, 1], [2, 0]])
    slots, mask = padded_slots_and_mask(tables, 4, torch.tensor([5, 1]), 2, 7)
    assert slots.tolist() == [[12, 13, 14, 15, 4, 5, 6], [8, 9, 10, 11, 0, 1, 2]]
    assert mask.shape == (2, 1, 2, 7)
    assert mask[0, 0, 0].tolist() == [True] * 6 + [False]  # query at position 5 sees 0..5
    assert mask[0, 0, 1].tolist() == [True] * 7
    assert mask[1, 0, 0].tolist() == [True, True] + [False] * 5


# ---- the kernel against the reference ----


@needs_kernels
@pytest.mark.parametrize("head_dim", [64, 128, 80, 20])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("lens", [LENS_ONE, LENS_33], ids=["batch5", "batch33"])
def test_kernel_matches_sdpa(head_dim, group, lens):
    kv_heads = 2
    q, kc, vc, tables, ctx = make_case(len(lens), kv_heads * group, kv_heads, head_dim, lens, seed=head_dim + group)
    scale = head_dim**-0.5
    got = decode_attention_kernel(q, kc, vc, tables, ctx, 16, scale)
    torch.testing.assert_close(got, sdpa_reference(q, kc, vc, tables, ctx, 16, scale), atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("n", LENS_ONE)
def test_kernel_batch_one(n):
    q, kc, vc, tables, ctx = make_case(1, 9, 3, 64, [n], seed=n)
    got = decode_attention_kernel(q, kc, vc, tables, ctx, 16, 0.125)
    torch.testing.assert_close(got, sdpa_reference(q, kc, vc, tables, ctx, 16, 0.125), atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_kernel_other_block_sizes_and_int64_tables(block_size):
    q, kc, vc, tables, ctx = make_case(6, 8, 2, 64, [1, 4, 5, 6, 33, 97], block_size=block_size)
    tables = tables.long()
    got = decode_attention_kernel(q, kc, vc, tables, ctx.long(), block_size, 0.2)
    torch.testing.assert_close(
        got, sdpa_reference(q, kc, vc, tables, ctx, block_size, 0.2), atol=1e-5, rtol=1e-5
    )


@needs_kernels
def test_kernel_reads_only_the_context():
    """Everything outside the requests' contexts is NaN: the output must not see it."""
    lens = [1, 17, 40]
    q, kc, vc, tables, ctx = make_case(3, 6, 3, 64, lens)
    ref = decode_attention_kernel(q, kc, vc, tables, ctx, 16, 0.125)
    used = torch.zeros(kc.shape[1], dtype=torch.bool)
    for i, n in enumerate(lens):
        for p in range(n):
            used[int(tables[i, p // 16]) * 16 + p % 16] = True
    kc[:, ~used] = float("nan")
    vc[:, ~used] = float("nan")
    got = decode_attention_kernel(q, kc, vc, tables, ctx, 16, 0.125)
    assert torch.isfinite(got).all()
    assert torch.equal(got, ref)


@needs_kernels
def test_kernel_large_scores_stay_finite():
    """Scores in the hundreds: a softmax without the max subtraction would overflow."""
    q, kc, vc, tables, ctx = make_case(2, 4, 2, 64, [50, 300])
    q = q * 40
    got = decode_attention_kernel(q, kc, vc, tables, ctx, 16, 0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, sdpa_reference(q, kc, vc, tables, ctx, 16, 0.125), atol=1e-4, rtol=1e-4)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_16bit_caches(dtype):
    q, kc, vc, tables, ctx = make_case(33, 9, 3, 64, LENS_33, dtype=dtype)
    got = decode_attention_kernel(q, kc, vc, tables, ctx, 16, 0.125)
    assert got.dtype == dtype
    # fp32 arithmetic on the 16-bit values, rounded once at the end: within one rounding step.
    torch.testing.assert_close(got, sdpa_reference(q, kc, vc, tables, ctx, 16, 0.125).to(dtype))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_float32_query_on_16bit_cache(dtype):
    """A 16-bit cache under a float32 model: the query and output stay float32."""
    q, kc, vc, tables, ctx = make_case(8, 8, 2, 128, LENS_ONE + [2, 31, 64], dtype=dtype)
    q = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    got = decode_attention_kernel(q, kc, vc, tables, ctx, 16, 0.1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, sdpa_reference(q, kc, vc, tables, ctx, 16, 0.1), atol=1e-5, rtol=1e-5)


needs_bf16_dot = pytest.mark.skipif(
    not build.kernel_info().bf16_dot,
    reason=f"bf16 decode attention needs the kernels' avx512 variant (AVX512_BF16); this process has "
           f"{build.kernel_info().variant}")


def bf16_reference(q, k_cache, v_cache, tables, lens, block_size, scale):
    """decode attention with bf16 products, from the definition (naive_reference's bf16 flavour)."""
    return naive_reference(q, k_cache, v_cache, tables, lens, block_size, scale, bf16=True)


@needs_kernels
@needs_bf16_dot
@pytest.mark.parametrize("head_dim,group", [(64, 3), (64, 1), (64, 4), (128, 2), (128, 5)])
def test_kernel_bf16_dot_rounds_as_prefill_attention(head_dim, group):
    """bf16_dot (a bfloat16 cache beside bf16 products): the kernel's result is the bf16-rounded
    definition's, far closer to it than float32 arithmetic on the same cache is."""
    q, kc, vc, tables, ctx = make_case(33, 2 * group, 2, head_dim, LENS_33, dtype=torch.bfloat16, seed=head_dim + group)
    q = torch.randn(q.shape, generator=torch.Generator().manual_seed(group))
    scale = head_dim**-0.5
    got = decode_attention_kernel(q, kc, vc, tables, ctx, 16, scale, bf16_dot=True)
    exact = decode_attention_kernel(q, kc, vc, tables, ctx, 16, scale)
    want = bf16_reference(q, kc, vc, tables, ctx, 16, scale)
    torch.testing.assert_close(got.double(), want, atol=2e-3, rtol=1e-2)
    assert (got.double() - want).abs().mean() < 0.1 * (exact.double() - want).abs().mean()


@needs_kernels
@needs_bf16_dot
def test_kernel_bf16_dot_other_head_dims_stay_float32():
    """At a head_dim with no vdpbf16ps pass (80) bf16_dot runs the float32 arithmetic."""
    q, kc, vc, tables, ctx = make_case(5, 6, 2, 80, LENS_ONE, dtype=torch.bfloat16)
    q = q.float()
    got = decode_attention_kernel(q, kc, vc, tables, ctx, 16, 0.1, bf16_dot=True)
    assert torch.equal(got, decode_attention_kernel(q, kc, vc, tables, ctx, 16, 0.1))


@needs_kernels
def test_kernel_bf16_dot_needs_a_bf16_cache_and_the_instruction():
    q, kc, vc, tables, ctx = make_case(2, 4, 2, 64, [3, 20], dtype=torch.float16)
    with pytest.raises((ValueError, RuntimeError), match="bf16_dot needs a bfloat16 cache"):
        decode_attention_kernel(q.float(), kc, vc, tables, ctx, 16, 0.1, bf16_dot=True)


LENS_LONG = [1, 511, 512, 513, 1024, 1500, 2049]  # one, two, three and five partitions of 512


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 20])
def test_kernel_long_contexts_in_partitions(dtype, head_dim):
    """Contexts past 512 positions run as partitions on every thread and are merged: the same
    attention as one pass, to float32 rounding."""
    q, kc, vc, tables, ctx = make_case(len(LENS_LONG), 6, 2, head_dim, LENS_LONG, dtype=dtype, seed=head_dim)
    q = q.float()
    got = decode_attention_kernel(q, kc, vc, tables, ctx, 16, head_dim**-0.5)
    torch.testing.assert_close(got, sdpa_reference(q, kc, vc, tables, ctx, 16, head_dim**-0.5), atol=1e-5, rtol=1e-5)


@needs_kernels
def test_kernel_long_context_is_batch_invariant():
    """A long context's partitions depend on its length alone: alone or in a batch, the same bits."""
    q, kc, vc, tables, ctx = make_case(5, 6, 2, 64, [700, 1300, 20, 2000, 513], seed=1)
    full = decode_attention_kernel(q, kc, vc, tables, ctx, 16, 0.1)
    for i in range(5):
        n = (int(ctx[i]) + 15) // 16
        alone = decode_attention_kernel(q[i:i + 1], kc, vc, tables[i:i + 1, :n], ctx[i:i + 1], 16, 0.1)
        assert torch.equal(full[i:i + 1], alone), i


@needs_kernels
def test_kernel_batch_invariant():
    """A request's output does not depend on what else is in the batch."""
    q, kc, vc, tables, ctx = make_case(33, 9, 3, 64, LENS_33)
    full = decode_attention_kernel(q, kc, vc, tables, ctx, 16, 0.125)
    alone = decode_attention_kernel(q[8:9], kc, vc, tables[8:9, :2], ctx[8:9], 16, 0.125)  # 17 tokens: 2 blocks
    assert torch.equal(full[8:9], alone)


@needs_kernels
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "context_lens": torch.tensor([0, 3], dtype=torch.int32)}, "at least its own token"),
        (lambda a: {**a, "context_lens": torch.tensor([5, 33], dtype=torch.int32)}, "needs more than"),
        (lambda a: {**a, "block_tables": torch.tensor([[99, 0], [1, 2]], dtype=torch.int32)}, "outside the cache"),
        (lambda a: {**a, "q": a["q"][:, :5]}, "not a multiple"),
        (lambda a: {**a, "q": a["q"].double()}, "q must be float32 or the cache's dtype"),
        (lambda a: {**a, "v_cache": a["v_cache"].half()}, "share one dtype"),
        (lambda a: {**a, "block_tables": a["block_tables"].float()}, "int32 or int64"),
        (lambda a: {**a, "block_size": 7}, "does not divide"),
    ],
)
def test_kernel_rejects_bad_input(change, message):
    q, kc, vc, tables, ctx = make_case(2, 6, 2, 64, [5, 20])
    args = dict(q=q, k_cache=kc, v_cache=vc, block_tables=tables, context_lens=ctx, block_size=16, scale=0.1)
    with pytest.raises(ValueError, match=message):
        decode_attention_kernel(**change(args))


# ---- paged_attention picks the path the metadata asks for ----


@needs_kernels
def test_paged_attention_kernel_and_fallback_agree():
    lens = [3, 16, 17, 60]
    q, kc, vc, tables, ctx = make_case(4, 6, 2, 32, lens)
    new_k = torch.randn(4, 2, 32)
    new_v = torch.randn(4, 2, 32)
    slot_mapping = torch.tensor([int(tables[i, (n - 1) // 16]) * 16 + (n - 1) % 16 for i, n in enumerate(lens)])
    slots, mask = padded_slots_and_mask(tables, 16, ctx.long() - 1, 1, max(lens))
    sdpa_meta = AttentionMetadata(slot_mapping, 4, GatheredDecode(slots, mask), None)
    kernel_meta = AttentionMetadata(slot_mapping, 4, PagedDecode(tables, ctx, 16), None)
    a = paged_attention(q, new_k, new_v, KVCache(kc.clone(), vc.clone()), sdpa_meta, 0.2)
    b = paged_attention(q, new_k, new_v, KVCache(kc.clone(), vc.clone()), kernel_meta, 0.2)
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


# ---- the engine, kernel on and off ----


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    """6 query heads over 2 KV heads of 64 (the default model's group of 3 and head size)."""
    return make_tiny_hf_model(
        tmp_path_factory.mktemp("gqa"), arch="llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=64
    )


def _generate(path, monkeypatch, use_kernel):
    """Greedy outputs with the "paged" or the "sdpa" attention backend; decode steps go through
    paged_attention (the "fused" forward: no whole-step kernel)."""
    seen = []
    real = attention.paged_attention

    def spy(q, k, v, cache, meta, scale, **kw):
        if meta.decode is not None:
            seen.append(isinstance(meta.decode, PagedDecode))
        return real(q, k, v, cache, meta, scale, **kw)

    monkeypatch.setattr("inferlab.models.decoder.paged_attention", spy)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=48, num_kv_blocks=128, decoder_backend="fused",
              attention_backend="paged" if use_kernel else "sdpa")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 16, 17, 40, 70)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, params)
    assert seen and all(x == use_kernel for x in seen)  # the path asked for is the path taken
    return outs


@needs_kernels
def test_engine_same_tokens_with_and_without_kernel(gqa_model, monkeypatch):
    on = _generate(gqa_model, monkeypatch, True)
    off = _generate(gqa_model, monkeypatch, False)
    assert_same_greedy(on, off)


def test_engine_fallback_runs(gqa_model, monkeypatch):
    outs = _generate(gqa_model, monkeypatch, False)
    assert all(len(o.outputs[0].token_ids) == 10 for o in outs)


def test_meta_to_moves_every_tensor_and_keeps_the_rest():
    """The runner builds metadata on the host and moves it once for a GPU. Moved to the "meta"
    device here (no data, but a real move), every tensor field must arrive there and the rest
    stay as they were."""
    from dataclasses import fields

    from inferlab.models.attention import AttentionMetadata, ContinuingChunk, PrefillBatch, meta_to

    decode = PagedDecode(torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([20]), 16)
    prefill = PrefillBatch(continuing=(ContinuingChunk(1, 2, 16),), block_tables=torch.tensor([[0, 3]]),
                           block_size=16, causal_bias=torch.zeros(2, 20))
    meta = AttentionMetadata(torch.tensor([5, 6, 7]), 1, decode, prefill)
    moved = meta_to(meta, torch.device("meta"))
    assert moved.slot_mapping.device.type == "meta"
    for before, after in ((decode, moved.decode), (prefill, moved.prefill)):
        for f in fields(before):
            old, new = getattr(before, f.name), getattr(after, f.name)
            if isinstance(old, torch.Tensor):
                assert new.device.type == "meta" and new.shape == old.shape and new.dtype == old.dtype, f.name
            else:
                assert new == old, f.name
    assert moved.num_decode_tokens == 1
