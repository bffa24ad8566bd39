"""Speculative decoding with temperature > 0: verification is rejection sampling, so the output
distribution is the sampler's. Seeded requests give the very tokens they give without drafts;
unseeded ones, the same token histogram (a chi-square test that a broken accept rule fails)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from inferlab import LLM, SamplingParams
from inferlab.engine import model_runner
from inferlab.models.testing import make_tiny_hf_model

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1, "adaptive": False}
A, B, C, D = 40, 41, 42, 43  # the tokens the histogram test allows
PROMPT = [A, B, C, A, B, C, A, B, C, A, B]  # periodic: prompt lookup drafts at every step


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("llama"), arch="llama")
    kw = {"dtype": "float32", "num_kv_blocks": 1024, "max_num_seqs": 600, "seed": 7}
    return LLM(str(path), **kw), LLM(str(path), speculative_config=SPEC, **kw)


SEEDED = [
    dict(temperature=0.8),
    dict(temperature=1.0, top_k=5, top_p=0.9),
    dict(temperature=0.7, min_p=0.05, repetition_penalty=1.3),
    dict(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={A: 3.0, B: 3.0, C: 3.0}),
    dict(temperature=1.2, allowed_token_ids=[A, B, C, D], logit_bias={A: 2.0}, min_tokens=6),
]


@pytest.mark.parametrize("params", SEEDED, ids=lambda p: ",".join(p))
def test_seeded_sampling_gives_the_same_tokens_with_and_without_drafts(engines, params):
    """Row j of a verification draws the uniform output position m + j draws without drafts,
    from the distribution decoding one at a time would meet: a seed fixes the tokens."""
    base, spec = engines
    before = spec.engine.get_stats()
    sp = [SamplingParams(max_tokens=24, ignore_eos=True, seed=s, **params) for s in range(6)]
    want = [o.outputs[0].token_ids for o in base.generate([PROMPT] * 6, sp)]
    got = [o.outputs[0].token_ids for o in spec.generate([PROMPT] * 6, sp)]
    assert got == want
    after = spec.engine.get_stats()
    assert after.spec_num_draft_tokens > before.spec_num_draft_tokens


def _histogram(llm: LLM, n: int) -> Counter:
    """Counts of output tokens 1 and 2 (as one symbol: the first is sampled after the prefill,
    before any draft) over n unseeded requests, the sampling settings shaped so that drafts
    are often, not always, accepted."""
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0, allowed_token_ids=[A, B, C, D],
                            logit_bias={A: 1.5, B: 1.0})
    outs = llm.generate([PROMPT] * n, params)
    return Counter(tuple(o.outputs[0].token_ids[1:]) for o in outs)


def chi_square_p_value(a: Counter, b: Counter, min_expected: float = 5.0) -> float:
    """Pearson's two-sample chi-square test of homogeneity; cells with fewer than
    `min_expected` expected counts are pooled into one. The p-value is the regularised upper
    incomplete gamma Q(df / 2, X² / 2) (torch.special.gammaincc; no scipy)."""
    na, nb = sum(a.values()), sum(b.values())
    cells = sorted(set(a) | set(b))
    kept, pooled = [], [0, 0]
    for c in cells:
        tot = a[c] + b[c]
        if min(tot * na, tot * nb) / (na + nb) < min_expected:
            pooled[0] += a[c]
            pooled[1] += b[c]
        else:
            kept.append((a[c], b[c]))
    if sum(pooled):
        kept.append((pooled[0], pooled[1]))
    stat = 0.0
    for oa, ob in kept:
        tot = oa + ob
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    df = len(kept) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_chi_square_statistic_sanity():
    same = Counter({"x": 500, "y": 300, "z": 200})
    assert chi_square_p_value(same, same) == pytest.approx(1.0)
    # 2x2 with X² = 8.0 → p = 0.00468 (df 1).
    assert chi_square_p_value(Counter(x=60, y=40), Counter(x=40, y=60)) == pytest.approx(0.00468, abs=1e-4)


N = 600


def test_rejection_sampling_keeps_the_token_distribution(engines, monkeypatch):
    base, spec = engines
    want = _histogram(base, N)
    before = spec.engine.get_stats()
    got = _histogram(spec, N)
    after = spec.engine.get_stats()
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    # Meaningful only if many drafts were both accepted and rejected.
    assert 0.1 * drafted < accepted < 0.9 * drafted, (accepted, drafted)
    p_value = chi_square_p_value(got, want)
    print(f"rejection sampling: {accepted}/{drafted} drafts accepted, chi-square p = {p_value:.3f}")
    assert p_value > 1e-3

    # The same test fails for broken accept rules: every draft kept; and a draft checked
    # against the token sampled one position later.
    def accept_all(drafts, targets):
        return list(drafts) + [targets[len(drafts)]]

    def off_by_one(drafts, targets):
        a = 0
        while a < len(drafts) and drafts[a] == targets[a + 1]:
            a += 1
        return list(drafts[:a]) + [targets[a]]

    for broken in (accept_all, off_by_one):
        monkeypatch.setattr(model_runner, "accept_greedy", broken)
        p_broken = chi_square_p_value(_histogram(spec, N), want)
        print(f"{broken.__name__}: chi-square p = {p_broken:.2g}")
        assert p_broken < 1e-3, broken.__name__
