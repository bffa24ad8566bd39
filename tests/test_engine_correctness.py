"""The engine against Hugging Face transformers' own implementation, and batch invariance.

Greedy token ids must equal transformers' on the same weights (float32), whatever the
batch, the chunking and preemption do to the order of work.
"""

from __future__ import annotations

import pytest
import torch

from inferlab import LLM, SamplingParams
from inferlab.models.testing import load_reference_model, make_tiny_hf_model

ARCHES = ["llama", "llama3", "mistral", "qwen2", "qwen3"]


def hf_greedy(ref, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=ARCHES)
def tiny(request, tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp(request.param), arch=request.param)
    return request.param, path


def test_greedy_matches_transformers(tiny):
    arch, path = tiny
    ref = load_reference_model(path)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=64, num_kv_blocks=256)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 23, 70)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(ref, p, 12), arch


def test_logits_match_transformers(tiny):
    """float32 logits within 1e-4 relative of transformers' on a prefill + decode path."""
    arch, path = tiny
    ref = load_reference_model(path)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    prompt = list(range(3, 40))
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5))[0]
    ids = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0].float()
    ref_lp = torch.log_softmax(ref_logits, -1)
    for i, (chosen, top) in enumerate(out.outputs[0].logprobs):
        row = ref_lp[len(prompt) - 1 + i]
        assert chosen.token_id == int(row.argmax())
        assert abs(chosen.logprob - float(row[chosen.token_id])) <= 1e-4 * max(1.0, abs(float(row[chosen.token_id])))
        assert [t.token_id for t in top] == row.topk(5).indices.tolist()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("inv"), arch="llama")


def test_batch_invariance_float32(llama_dir):
    """One greedy request: alone, in a batch of 16 mixed lengths with small prefill chunks,
    and after preemption: the same tokens."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    g = torch.Generator().manual_seed(7)
    target = torch.randint(3, 250, (45,), generator=g).tolist()
    others = [torch.randint(3, 250, (int(n),), generator=g).tolist() for n in torch.randint(2, 90, (15,), generator=g)]

    alone = LLM(str(llama_dir), dtype="float32", num_kv_blocks=256).generate(target, params)[0].outputs[0].token_ids

    chunked = LLM(str(llama_dir), dtype="float32", max_num_batched_tokens=16, num_kv_blocks=256)
    outs = chunked.generate(others[:7] + [target] + others[7:], params)
    assert outs[7].outputs[0].token_ids == alone

    # 30 blocks of 16 tokens cannot hold 16 sequences of ~65 tokens: preemption must happen.
    tight = LLM(str(llama_dir), dtype="float32", max_num_batched_tokens=64, num_kv_blocks=30, enable_prefix_caching=False)
    outs = tight.generate(others[:7] + [target] + others[7:], params)
    assert tight.engine.get_stats().num_preemptions > 0
    assert outs[7].outputs[0].token_ids == alone
    # Each preemption is counted on its request too.
    assert sum(o.metrics.num_preemptions for o in outs) == tight.engine.get_stats().num_preemptions


def test_prefix_cache_reuses_blocks(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prefix = list(range(10, 110))  # 100 tokens = 6 full blocks of 16
    first = llm.generate(prefix + [5, 6, 7], params)[0]
    assert first.num_cached_tokens == 0
    second = llm.generate(prefix + [5, 6, 7], params)[0]
    assert second.num_cached_tokens == 96
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.metrics.timings()["prompt_n"] == 103 - 96
    # Opting out computes everything again and still agrees.
    third = llm.generate(prefix + [5, 6, 7], params, use_prefix_cache=False)[0]
    assert third.num_cached_tokens == 0
    assert third.outputs[0].token_ids == first.outputs[0].token_ids
    # A different salt shares nothing.
    salted = llm.generate(prefix + [5, 6, 7], params, cache_salt="tenant-b")[0]
    assert salted.num_cached_tokens == 0
