"""Speculative decoding through the real engine: float32 greedy output identical with and
without n-gram drafts, on tiny models (llama, qwen3) and the default model, under chunked
prefill, prefix-cache hits, preemption, n > 1, stop strings and max_tokens."""

from __future__ import annotations

import pytest
import torch
from same_outputs import assert_same_greedy

from inferlab import LLM, SamplingParams
from inferlab.models.testing import make_tiny_hf_model

# adaptive off: these tests count drafts, which the "when it pays" rule would vary with step timings.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1, "adaptive": False}


def prompts() -> list[list[int]]:
    """Random prompts, and ones that repeat a span (what prompt lookup drafts from)."""
    g = torch.Generator().manual_seed(1)
    rand = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 23, 70)]
    return rand + [rand[1] * 3, rand[0] * 6 + rand[2][:9]]


_PAIRS: dict[str, tuple[LLM, LLM]] = {}


def pair(arch: str, tmp_path_factory) -> tuple[LLM, LLM]:
    """(plain, with drafts) engines on one tiny model, built once per module (each costs a load
    and a warm-up)."""
    if arch not in _PAIRS:
        path = make_tiny_hf_model(tmp_path_factory.mktemp(arch), arch=arch)
        kw = {"dtype": "float32", "num_kv_blocks": 256}
        _PAIRS[arch] = (LLM(str(path), **kw), LLM(str(path), speculative_config=SPEC, **kw))
    return _PAIRS[arch]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    return pair(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return pair("llama", tmp_path_factory)


def test_same_greedy_tokens_and_logprobs(tiny):
    base, spec = tiny
    before = spec.engine.get_stats()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3)
    want = base.generate(prompts(), params)
    got = spec.generate(prompts(), params)
    assert_same_greedy(got, want, top_ids=True)
    stats = spec.engine.get_stats()
    accepted = stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    # The test means something only if drafts were both accepted and rejected (rolled back).
    assert 0 < accepted < stats.spec_num_draft_tokens - before.spec_num_draft_tokens
    assert stats.spec_accepted_per_pos[1] > (before.spec_accepted_per_pos or (0, 0))[1]  # runs of several
    assert sum(o.metrics.num_accepted_tokens for o in got) == accepted
    t = got[3].metrics.timings()
    assert t["draft_n"] >= t["draft_n_accepted"] > 0
    assert base.engine.get_stats().spec_num_drafts == 0


def test_chunked_prefill_and_preemption(llama):
    """Small steps (drafts trimmed to the budget, prompts chunked beside decodes) and a KV pool
    so small that requests are preempted and recomputed."""
    base, spec = llama
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = base.generate(prompts(), params)
    small = LLM(_model_dir(spec), dtype="float32", num_kv_blocks=14,
                max_num_batched_tokens=16, speculative_config=SPEC)
    got = small.generate(prompts(), params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = small.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.spec_num_accepted_tokens > 0


def _model_dir(llm: LLM) -> str:
    return str(llm.engine.config.load.model)


def test_the_when_it_pays_rule_keeps_the_output(llama):
    """Adaptive (the default): fewer or no drafts where they do not pay, the same tokens."""
    base, spec = llama
    llm = LLM(_model_dir(spec), dtype="float32", num_kv_blocks=256, speculative_config={**SPEC, "adaptive": True})
    policy = llm.engine.scheduler.policy
    assert policy is not None
    # The warm-up measured the decode step's fixed part and its cost per row for the rule, and
    # left nothing behind: no request, no block in use, no query or draft counted.
    assert policy.base_cost is not None and policy.base_cost > 0 and policy.row_cost_ratio > 0
    stats = llm.engine.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage, stats.prefix_cache_queries,
            stats.spec_num_drafts) == (0, 0, 0.0, 0, 0)
    # From here the rule follows the steps' measured times, and on a loaded 2-core host it chose no
    # drafts at all in 2 of 4 full runs: hold its cost model where a row costs 1% of a step's fixed
    # part, so that drafts pay and the run checks what it is for (drafts accepted, the same tokens).
    policy.observe_step = lambda num_rows, seconds: None
    policy.row_cost_ratio = 0.01
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = base.generate(prompts(), params)
    got = llm.generate(prompts(), params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.get_stats().spec_num_accepted_tokens > 0


def test_the_prefix_cache_never_serves_a_rejected_draft(llama):
    """A second request whose prompt is the first's prompt + output hits the blocks that the first
    request's decoding (with drafts accepted and rejected) cached: its output must equal that of
    the same model computing it with no cache at all."""
    base, spec = llama
    first = prompts()[3] + [5]  # a prompt of its own: nothing of it is cached yet
    before = spec.engine.get_stats()
    out = spec.generate(first, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))[0].outputs[0].token_ids
    after = spec.engine.get_stats()
    assert after.spec_num_draft_tokens - before.spec_num_draft_tokens > (
        after.spec_num_accepted_tokens - before.spec_num_accepted_tokens) > 0
    second = first + out[:50] + [7, 8]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    got = spec.generate(second, params)[0]
    assert got.num_cached_tokens >= 96 > len(first)  # blocks of the first request's output were hits
    want = base.generate(second, params, use_prefix_cache=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_n_greater_than_one_speculates_per_sequence(llama):
    base, spec = llama
    p = prompts()[3]
    want = base.generate(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0].token_ids
    got = spec.generate(p, SamplingParams(n=3, temperature=0, max_tokens=30, ignore_eos=True))[0]
    assert [c.token_ids for c in got.outputs] == [want] * 3
    assert got.metrics.num_accepted_tokens > 0


def test_stop_strings_and_max_tokens_inside_accepted_runs(llama):
    base, spec = llama
    p = prompts()[3]
    greedy = base.generate(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    text = greedy.text
    assert len(text) > 30, text
    # Every max_tokens: the same prefix (drafts are trimmed so that none lands past it).
    for m in (2, 3, 5, 8, 13, 21, 34):
        out = spec.generate(p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))[0].outputs[0]
        assert out.token_ids == greedy.token_ids[:m] and out.finish_reason == "length", m
    # Stop strings cut from many places of the text: text, tokens and reason as without drafts.
    steps_with_runs = 0
    for cut in range(4, len(text) - 3, max(1, len(text) // 6)):
        stop = text[cut : cut + 2]
        if not stop.strip():
            continue
        for include in (False, True):
            sp = SamplingParams(temperature=0, max_tokens=40, stop=[stop], include_stop_str_in_output=include,
                                ignore_eos=True)
            a = base.generate(p, sp)[0].outputs[0]
            b = spec.generate(p, sp)[0]
            steps_with_runs += b.metrics.num_accepted_tokens > 0
            c = b.outputs[0]
            assert (c.text, c.token_ids, c.finish_reason, c.stop_reason) == (
                a.text, a.token_ids, a.finish_reason, a.stop_reason), (stop, include)
            assert b.metrics.num_generated_tokens == len(c.token_ids)
    assert steps_with_runs > 0


TEXT = ("The committee met on Tuesday to review the budget for the new library. After a long discussion, the "
        "members agreed to fund the children's reading room and to repair the roof before winter.")


def test_default_model_copy_prompt_is_identical():
    messages = [{"role": "user", "content": f"Repeat this text exactly:\n\n{TEXT}"}]
    params = SamplingParams(temperature=0, max_tokens=48)
    want = LLM().chat(messages, params)[0]
    # The draft model: the default model drafting for itself (its name resolves to the same wheel),
    # adaptive off: the rule rightly finds that a draft as big as the target never pays.
    for spec in ({"method": "ngram", "num_speculative_tokens": 4}, {"method": "suffix", "num_speculative_tokens": 8},
                 {"method": "draft_model", "model": "SmolLM2-135M-Instruct", "num_speculative_tokens": 4,
                  "adaptive": False}):
        got = LLM(speculative_config=spec).chat(messages, params)[0]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, spec
        assert got.metrics.num_accepted_tokens > 10, spec  # the copy is mostly drafted
