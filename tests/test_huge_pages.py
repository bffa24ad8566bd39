"""models/huge_pages.py: the weights and the K/V cache in 2 MiB-aligned mappings advised for huge
pages, holding the same values as before; small tensors left where they are."""

from __future__ import annotations

import pytest
import torch

from inferlab.models import huge_pages
from inferlab.models.huge_pages import HUGE_PAGE, MIN_BYTES, HugeArena, empty_huge, zeros_huge
from inferlab.models.kv_cache import allocate_kv_cache

needs_madvise = pytest.mark.skipif(not huge_pages.can_advise(), reason="needs madvise(MADV_HUGEPAGE) (Linux)")


def advised(ptr: int) -> bool:
    """Whether the mapping holding address ptr was advised MADV_HUGEPAGE ("hg" in its VmFlags)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head == "VmFlags:":
            return "hg" in line.split()[1:]
    return False


@needs_madvise
def test_empty_huge_is_aligned_advised_and_writable():
    t = empty_huge((3, 1 << 20), torch.bfloat16)  # 6 MiB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert advised(t.data_ptr())
    t.fill_(1.5)
    assert float(t.float().sum()) == 1.5 * t.numel()


@needs_madvise
def test_zeros_huge_and_small_tensors():
    z = zeros_huge((5, 1 << 18), torch.float32)
    assert advised(z.data_ptr()) and not z.any()
    small = empty_huge((1 << 18,), torch.float32)  # 1 MiB, less than a huge page: torch's own allocation
    assert not advised(small.data_ptr())


@needs_madvise
def test_arena_copies_keep_values_and_share_chunks():
    g = torch.Generator().manual_seed(0)
    arena = HugeArena(chunk_bytes=4 * HUGE_PAGE)
    srcs = [torch.randn(300, 577, generator=g).to(dt) for dt in (torch.float32, torch.bfloat16, torch.float16)]
    srcs.append(torch.randint(-128, 127, (513, 1025), generator=g, dtype=torch.int8))
    copies = [arena.copy(s) for s in srcs]
    expected = [s.clone() for s in srcs]
    for s, c in zip(srcs, copies):
        assert c.dtype == s.dtype and c.shape == s.shape and torch.equal(c, s)
        assert c.data_ptr() != s.data_ptr() and c.data_ptr() % 64 == 0 and advised(c.data_ptr())
    assert copies[1].data_ptr() == copies[0].data_ptr() + -(-srcs[0].nbytes // 64) * 64  # one after another
    big = torch.ones(5 * HUGE_PAGE, dtype=torch.uint8)  # larger than a chunk: a chunk of its own
    big_copy = arena.copy(big)
    assert torch.equal(big_copy, big) and big_copy.data_ptr() % HUGE_PAGE == 0
    tiny = torch.ones(8)
    assert arena.copy(tiny) is tiny
    del arena, srcs, big, big_copy  # the copies keep their chunks alive
    scratch = [torch.full((1 << 20,), 7, dtype=torch.int32) for _ in range(8)]  # reuse anything freed
    assert all(torch.equal(c, e) for c, e in zip(copies, expected)) and scratch


@needs_madvise
def test_kv_cache_on_huge_pages():
    caches = allocate_kv_cache(2, 3, 64, 16384, torch.float16)  # 6 MiB each of K and V
    for c in caches:
        assert advised(c.k.data_ptr()) and advised(c.v.data_ptr())
        assert c.k.shape == (3, 16384, 64) and not c.k.any() and not c.v.any()
    q = allocate_kv_cache(1, 3, 64, 16384, torch.int8)[0]
    assert advised(q.k.data_ptr()) and q.k_scale is not None and q.k_scale.shape == (3, 16384)
    assert not q.k_scale.any() and not q.k.any()


@needs_madvise
def test_model_weights_move_to_huge_pages(tmp_path, monkeypatch):
    """The large weights land in advised mappings, hold the values a model that kept them where
    they were loaded holds, and the two generate the same greedy tokens."""
    from inferlab import LLM, SamplingParams
    from inferlab.models.decoder import DecoderModel
    from inferlab.models.testing import make_tiny_hf_model

    path = make_tiny_hf_model(tmp_path, arch="llama", hidden_size=256, intermediate_size=512,
                              num_attention_heads=4, num_key_value_heads=2)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 6, 7, 8]}]
    llm = LLM(str(path), weight_dtype="float16", enable_prefix_caching=False)
    m = llm.engine.runner.model
    moved = [lin.weight for lin in m._linears() if lin.weight.nbytes >= MIN_BYTES]
    assert moved and all(advised(w.data_ptr()) for w in moved)
    tokens = llm.generate(prompt, greedy)[0].outputs[0].token_ids
    assert len(tokens) == 8

    monkeypatch.setattr(DecoderModel, "_weights_to_huge_pages", lambda self: None)  # the weights stay put
    ref = LLM(str(path), weight_dtype="float16", enable_prefix_caching=False)
    kept = [lin.weight for lin in ref.engine.runner.model._linears() if lin.weight.nbytes >= MIN_BYTES]
    assert len(kept) == len(moved) and not any(advised(w.data_ptr()) for w in kept)
    assert all(torch.equal(a, b) for a, b in zip(moved, kept))
    assert ref.generate(prompt, greedy)[0].outputs[0].token_ids == tokens
