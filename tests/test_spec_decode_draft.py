"""Draft-model speculation through the real engine: a tiny draft sharing the target's tokenizer
proposes K tokens per step with its own KV cache, rolled back with the target's. float32 greedy
output identical to no speculation (a draft that always agrees, one that mostly does not), under
chunked prefill and preemption; seeded sampling (n > 1 too) the same tokens; another vocabulary refused."""

from __future__ import annotations

import pytest
from same_outputs import assert_same_greedy
from test_spec_decode_engine import prompts

from inferlab import LLM, SamplingParams
from inferlab.models.testing import make_tiny_hf_model

KW = {"dtype": "float32", "num_kv_blocks": 256}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    target = make_tiny_hf_model(root / "target", arch="llama")
    other = make_tiny_hf_model(root / "other", arch="llama", seed=3, num_hidden_layers=1)
    return str(target), str(other)


@pytest.fixture(scope="module")
def base(models):
    return LLM(models[0], **KW)


def spec(draft: str, k: int = 4) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k, "adaptive": False}


@pytest.mark.parametrize("which", ["itself", "other"])
def test_same_greedy_tokens_and_logprobs(models, base, which):
    target, other = models
    llm = LLM(target, speculative_config=spec(target if which == "itself" else other), **KW)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    want = base.generate(prompts(), params)
    got = llm.generate(prompts(), params)
    assert_same_greedy(got, want, top_ids=True)
    stats = llm.engine.get_stats()
    assert stats.spec_num_draft_tokens > 0
    if which == "itself":  # the target as its own draft: every draft accepted, the bonus token too
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
        assert stats.spec_accepted_per_pos[0] == stats.spec_num_drafts and len(stats.spec_accepted_per_pos) == 4
    else:  # rejections, so the draft's K/V was rolled back
        assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_chunked_prefill_and_preemption(models, base):
    target, _ = models
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = base.generate(prompts(), params)
    small = LLM(target, dtype="float32", num_kv_blocks=14, max_num_batched_tokens=16,
                speculative_config=spec(target, k=3))
    got = small.generate(prompts(), params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = small.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.spec_num_accepted_tokens > 0
    # Blocks all back once every request is done (the draft's too).
    assert small.engine.draft_proposer is not None and not small.engine.draft_proposer.state
    assert len(small.engine.draft_proposer.free_blocks) == small.engine.draft_proposer.runner.num_blocks


def test_seeded_sampling_gives_the_same_tokens(models, base):
    target, other = models
    llm = LLM(target, speculative_config=spec(other), **KW)
    sp = [SamplingParams(temperature=0.9, top_k=20, max_tokens=20, ignore_eos=True, seed=s, n=1 + s % 2)
          for s in range(4)]
    ps = prompts()[:4]
    assert ([[c.token_ids for c in o.outputs] for o in llm.generate(ps, sp)]
            == [[c.token_ids for c in o.outputs] for o in base.generate(ps, sp)])


def test_a_draft_with_another_vocabulary_is_refused_naming_both(models, tmp_path):
    target, _ = models
    wide = make_tiny_hf_model(tmp_path / "wide", arch="llama", vocab_size=512)
    with pytest.raises(ValueError, match=r"draft model .*wide.* 512 .*target .* 384"):
        LLM(target, speculative_config=spec(str(wide)), **KW)


@pytest.mark.parametrize("bad, message", [
    ({"method": "draft_model", "num_speculative_tokens": 4}, "needs a model"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 4, "prompt_lookup_max": 3}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 4, "model": "x"}, "'model' not read by method 'ngram'"),
])
def test_config_errors(bad, message):
    from inferlab.config import SpeculativeConfig

    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(bad)
