"""Draft-model speculation through the real engine: a tiny draft sharing the target's tokenizer
proposes K tokens per step with its own KV cache, rolled back with the target's. float32 greedy
output identical to no speculation (a draft that always agrees, one that mostly does not), under
chunked prefill and preemption; sampled drafts (min(1, p/q)) keep the distribution, seeded runs repeat; another vocabulary refused."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
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


def test_seeded_sampling_is_reproducible(models):
    """Sampled drafts are drawn from the draft's q and verified by min(1, p/q) (not by sample and
    compare), so a seed fixes the tokens (another engine gives the same ones; n > 1 children
    their own) though not the tokens plain sampling gives."""
    target, other = models
    sp = [SamplingParams(temperature=0.9, top_k=20, max_tokens=20, ignore_eos=True, seed=s, n=1 + s % 2)
          for s in range(4)]
    ps = prompts()[:4]
    runs = [[[c.token_ids for c in o.outputs] for o in LLM(target, speculative_config=spec(other), **KW).generate(ps, sp)]
            for _ in range(2)]
    assert runs[0] == runs[1]
    assert runs[0][1][0] != runs[0][1][1]  # n = 2: two different children


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


# ---------------------------------------------------------------- sampled drafts: min(1, p/q), the residual


def _one_step_histogram(rule, p, q, n: int, seed: int) -> Counter:
    """The first token a verification step yields, for one draft drawn from q, n times."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q[0], n, replacement=True, generator=g).tolist()
    u = torch.rand(n, 3, dtype=torch.float64, generator=g)  # independent: one to accept, two to resample
    return Counter(rule(p, q, [x], u[i, :1], u[i, 1:])[0] for i, x in enumerate(drafts))


def test_rejection_sampling_against_q_gives_p_and_a_broken_residual_does_not(monkeypatch):
    """Chi-square goodness of fit of the step's first token to p (exact here: p is known)."""
    from inferlab.engine import rejection_sampler

    p = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.1, 0.5, 0.1, 0.1, 0.2]])  # very unlike p: many rejections

    def p_value(counts: Counter, n: int) -> float:
        stat = sum((counts[t] - n * float(p[0, t])) ** 2 / (n * float(p[0, t])) for t in range(4))
        assert counts[4] == 0  # p(4) = 0 is never output
        return float(torch.special.gammaincc(torch.tensor(1.5, dtype=torch.float64), torch.tensor(stat / 2.0)))

    n = 4000
    assert p_value(_one_step_histogram(rejection_sampler.rejection_sample, p, q, n, 0), n) > 1e-3
    monkeypatch.setattr(rejection_sampler, "residual_of", lambda p, q: p)  # the classic bug: resample from p
    assert p_value(_one_step_histogram(rejection_sampler.rejection_sample, p, q, n, 0), n) < 1e-3


def test_sampled_drafts_through_the_engine_keep_the_distribution(models, base):
    """A draft model at temperature 1: its drafts drawn from q, verified by min(1, p/q): the
    histogram of output tokens 1-2 matches plain sampling's; seeded runs repeat themselves."""
    from test_spec_decode_sampling import PROMPT, A, B, C, D, chi_square_p_value

    target, other = models
    llm = LLM(target, speculative_config=spec(other, k=2), max_num_seqs=600, **KW)
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0, allowed_token_ids=[A, B, C, D],
                            logit_bias={A: 1.5, B: 1.0})
    big = LLM(target, max_num_seqs=600, **KW)

    def hist(engine: LLM, n: int = 600) -> Counter:
        return Counter(tuple(o.outputs[0].token_ids[1:]) for o in engine.generate([PROMPT] * n, params))

    before = llm.engine.get_stats()
    got = hist(llm)
    after = llm.engine.get_stats()
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert 0.1 * drafted < accepted < 0.95 * drafted, (accepted, drafted)
    assert llm.engine.draft_proposer is not None
    p_value = chi_square_p_value(got, hist(big))
    print(f"draft model, sampled drafts: {accepted}/{drafted} accepted, chi-square p = {p_value:.3f}")
    assert p_value > 1e-3
    seeded = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, seed=s) for s in range(3)]
    first = [o.outputs[0].token_ids for o in llm.generate([PROMPT] * 3, seeded)]
    assert first == [o.outputs[0].token_ids for o in llm.generate([PROMPT] * 3, seeded)]
