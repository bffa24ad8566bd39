"""Prompt logprobs (vLLM's `prompt_logprobs`) on the real engine, against a full forward.

The reference is transformers' own model: log_softmax over one plain forward of the whole
prompt. The engine's values come from its prefill's own logits, so they must agree however the
prefill was cut into chunks, with a prefix-cache hit available, with n > 1 and after preemption.
"""

from __future__ import annotations

import pytest
import torch

from inferlab import LLM, SamplingParams
from inferlab.models.testing import load_reference_model, make_tiny_hf_model

K = 3


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("plp"), arch="llama")


@pytest.fixture(scope="module")
def reference(llama_dir):
    ref = load_reference_model(llama_dir)

    def log_softmax(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(ref(torch.tensor([prompt])).logits[0].float(), dim=-1)

    return log_softmax


def prompts(n: int, seed: int = 3, lo: int = 20, hi: int = 80) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (int(m),), generator=g).tolist() for m in torch.randint(lo, hi, (n,), generator=g)]


def assert_matches(prompt_logprobs, prompt: list[int], ref_lp: torch.Tensor, k: int = K) -> None:
    """One entry per prompt token: None, then {prompt token first, then the top k} as the reference has them."""
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for p in range(1, len(prompt)):
        entry, row = prompt_logprobs[p], ref_lp[p - 1]
        tok = prompt[p]
        assert next(iter(entry)) == tok  # the prompt token comes first
        chosen = entry[tok]
        want = float(row[tok])
        assert abs(chosen.logprob - want) <= 1e-4 * max(1.0, abs(want)), (p, chosen.logprob, want)
        assert chosen.rank == int((row > row[tok]).sum()) + 1
        top = sorted((lp for t, lp in entry.items() if lp.rank is not None and lp.rank <= k), key=lambda lp: lp.rank)
        if tok not in row.topk(k).indices.tolist():
            assert len(entry) == k + 1
        assert [lp.token_id for lp in top] == row.topk(k).indices.tolist()
        assert all(lp.decoded_token is not None for lp in entry.values())


@pytest.mark.parametrize(
    "engine_kw",
    [
        {},
        {"max_num_batched_tokens": 16},  # chunked prefill: several steps per prompt
        {"long_prefill_token_threshold": 5},
        {"long_prefill_token_threshold": 1},  # one-token chunks: the runner's decode rows
    ],
    ids=["whole", "budget16", "threshold5", "threshold1"],
)
def test_prompt_logprobs_equal_a_full_forward(llama_dir, reference, engine_kw):
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=256, **engine_kw)
    batch = prompts(4)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=K)
    # A plain request in the same batch: it asks for nothing and gets nothing.
    outs = llm.generate(batch + [batch[0]], [params] * 4 + [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)])
    for prompt, out in zip(batch, outs):
        assert_matches(out.prompt_logprobs, prompt, reference(prompt))
    assert outs[4].prompt_logprobs is None
    assert outs[4].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_a_prefix_cache_hit_still_returns_them(llama_dir, reference):
    """The same prompt twice: the second request could hit every full block, but a request
    asking for prompt logprobs recomputes its prompt; a plain repeat still hits."""
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=256, block_size=16)
    prompt = prompts(1, seed=5, lo=70, hi=71)[0]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=K)
    first = llm.generate(prompt, params)[0]
    second = llm.generate(prompt, params)[0]
    assert second.num_cached_tokens == 0
    assert_matches(second.prompt_logprobs, prompt, reference(prompt))
    assert [{t: lp.logprob for t, lp in e.items()} if e else e for e in second.prompt_logprobs] == [
        {t: lp.logprob for t, lp in e.items()} if e else e for e in first.prompt_logprobs
    ]
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
    assert plain.num_cached_tokens == 64  # the logprob requests' blocks did enter the cache
    assert plain.prompt_logprobs is None


def test_n_children_report_each_position_once(llama_dir, reference):
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=16)
    prompt = prompts(1, seed=9)[0]
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, prompt_logprobs=K))[0]
    assert len(out.outputs) == 3
    assert_matches(out.prompt_logprobs, prompt, reference(prompt))


def test_preemption_does_not_duplicate_entries(llama_dir, reference):
    # 12 blocks of 16 tokens cannot hold 6 sequences of ~90 tokens at once: requests are
    # preempted and recompute their prompts, reporting those positions again.
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=12, block_size=16, max_num_batched_tokens=32,
              enable_prefix_caching=False)  # fmt: skip
    batch = prompts(6, seed=11, lo=40, hi=60)
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=1))
    assert llm.engine.get_stats().num_preemptions > 0
    for prompt, out in zip(batch, outs):
        assert_matches(out.prompt_logprobs, prompt, reference(prompt), k=1)


def test_plain_requests_compute_logits_for_sampled_rows_only(llama_dir, monkeypatch):
    """Only requests asking pay: without prompt_logprobs the lm_head sees one row per sampled request."""
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=16)
    model = llm.engine.runner.model
    rows: list[int] = []
    real = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda h: (rows.append(h.shape[0]), real(h))[1])
    llm.generate(prompts(3), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert rows and max(rows) <= 3
    rows.clear()
    prompt = prompts(1, seed=2, lo=40, hi=41)[0]
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    assert sum(rows) == 39 + 1  # every position that predicts a prompt token, plus the one sample


def test_prompt_logprobs_range_is_checked():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-2)  # -1 is whole rows (below)


@pytest.mark.parametrize("engine_kw", [{}, {"max_num_batched_tokens": 16}], ids=["whole", "budget16"])
def test_prompt_logprobs_minus_one_gives_whole_rows(llama_dir, reference, engine_kw):
    """prompt_logprobs=-1: the prompt token's logprob alone in the entries, and every position's
    whole log-softmax row (what perplexity's KL divergence reads), however the prefill was cut."""
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=256, **engine_kw)
    batch = prompts(3, seed=5)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=-1)
    outs = llm.generate(batch + [batch[0]], [params] * 3 + [SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)])
    for prompt, out in zip(batch, outs):
        ref = reference(prompt)
        assert_matches(out.prompt_logprobs, prompt, ref, k=0)
        rows = out.prompt_logprob_rows
        assert rows is not None and rows.shape == (len(prompt) - 1, ref.shape[1])
        assert torch.allclose(torch.from_numpy(rows), ref[:-1], atol=1e-4)
    assert outs[3].prompt_logprob_rows is None
