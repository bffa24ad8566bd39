"""The sampler's draws: inverse-CDF sampling against the exact probabilities, and top-k /
top-p / min-p over a candidate set against the full-vocabulary definition (including the rows
whose nucleus reaches past the candidates). Deterministic: the uniforms are a fine grid, so a
token with probability q gets q * N of N draws, to within one."""

from __future__ import annotations

import pytest
import torch

from inferlab.engine import sampler as sampler_mod
from inferlab.engine.sampler import CANDIDATES, apply_min_p, apply_top_k_top_p, inverse_cdf, sample_truncated

N = 4000
GRID = (torch.arange(N, dtype=torch.float64) + 0.5) / N


def counts(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab)


def test_inverse_cdf_gives_each_index_its_probability():
    w = torch.tensor([0.1, 0.0, 0.25, 0.05, 0.6]) * 3.0  # not normalised
    got = counts(inverse_cdf(w.expand(N, -1), GRID), 5)
    want = w / w.sum() * N
    assert (got - want).abs().max() <= 1.0
    assert got[1] == 0  # a zero weight is never drawn


def test_inverse_cdf_edges_never_pick_a_zero_weight():
    w = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0, 0.0]] * 4)
    u = torch.tensor([0.0, 1e-12, 1.0 - 1e-12, 1.0], dtype=torch.float64)  # 1.0: u * total == total
    got = inverse_cdf(w, u)
    assert got.tolist() == [1, 1, 3, 3]


def reference(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The definition: mask to top-k then the top-p nucleus over the whole vocabulary, softmax,
    then min-p."""
    probs = torch.softmax(apply_top_k_top_p(logits, [top_k], [top_p]), dim=-1)
    if min_p > 0:
        probs = apply_min_p(probs, probs.max(dim=-1, keepdim=True).values, torch.tensor([[min_p]]))
    return probs[0] / probs[0].sum()


@pytest.mark.parametrize(
    "top_k,top_p,min_p,scale",
    [
        (40, 1.0, 0.0, 3.0),    # top-k only
        (0, 0.9, 0.0, 3.0),     # top-p only, a peaked row: the nucleus is among the candidates
        (40, 0.95, 0.05, 3.0),  # llama.cpp's defaults
        (0, 0.99, 0.0, 0.05),   # a flat row: the nucleus reaches past the candidates (fallback)
        (300, 0.9, 0.0, 0.05),  # a top-k larger than the candidate count
        (0, 1.0, 0.1, 2.0),     # no truncation at all: the whole vocabulary (the fallback)
    ],
)
def test_truncated_sampling_follows_the_definition(top_k, top_p, min_p, scale, monkeypatch):
    vocab = 1000
    assert vocab > CANDIDATES
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(top_k + int(top_p * 100))) * scale
    fallback = []
    real = sampler_mod.apply_top_k_top_p
    monkeypatch.setattr(sampler_mod, "apply_top_k_top_p", lambda *a: fallback.append(1) or real(*a))
    want = reference(logits, top_k, top_p, min_p)  # the real apply_top_k_top_p, not the spy
    got = counts(sample_truncated(logits.expand(N, -1), [top_k] * N, [top_p] * N,
                                  torch.full((N, 1), min_p), GRID), vocab)
    assert ((got > 0) <= (want > 0)).all()  # nothing outside the kept set
    assert (got - want * N).abs().max() <= 1.0
    assert bool(fallback) == (top_k == 0 and top_p >= 0.99)  # only a nucleus past the candidates needs the full sort


def test_a_batch_mixes_rows_of_every_kind():
    """Rows with different parameters in one call each follow their own definition."""
    vocab = 600
    g = torch.Generator().manual_seed(7)
    rows = [(5, 1.0, 0.0, 2.0), (0, 0.5, 0.0, 2.0), (0, 0.999, 0.0, 0.01), (20, 0.8, 0.2, 1.0)]
    logits = torch.stack([torch.randn(vocab, generator=g) * s for *_, s in rows])
    m = N // 4
    u = (torch.arange(m, dtype=torch.float64) + 0.5) / m
    batch = logits.repeat_interleave(m, dim=0)
    tk = [r[0] for r in rows for _ in range(m)]
    tp = [r[1] for r in rows for _ in range(m)]
    mp = torch.tensor([r[2] for r in rows for _ in range(m)]).unsqueeze(1)
    got = sample_truncated(batch, tk, tp, mp, u.repeat(4))
    for i, (k, p, q, _) in enumerate(rows):
        want = reference(logits[i : i + 1], k, p, q)
        c = counts(got[i * m : (i + 1) * m], vocab)
        assert ((c > 0) <= (want > 0)).all(), i
        assert (c - want * m).abs().max() <= 1.0, i


def test_sampler_draws_follow_the_temperature_scaled_softmax():
    """The whole Sampler on temperature-only rows: frequencies over many rows (the sampler's own
    generator) match softmax(logits / T)."""
    from types import SimpleNamespace

    from inferlab.engine.request import SamplingParams
    from inferlab.engine.sampler import Sampler

    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0, 1.5])
    rows = [SimpleNamespace(sampling_params=SamplingParams(temperature=0.7), output_token_ids=[], prompt_token_ids=[1],
                            eos_token_ids=[]) for _ in range(20000)]
    out = Sampler(seed=3)(logits.expand(len(rows), -1).clone(), rows)
    freq = counts(torch.tensor(out.token_ids), 6).double() / len(rows)
    assert (freq - torch.softmax(logits / 0.7, dim=0)).abs().max() < 0.015


def _row(prompt, output, **params):
    from inferlab.engine.outputs import ScheduledRequest
    from inferlab.engine.request import SamplingParams

    return ScheduledRequest(request_id="r", token_ids=[], start_pos=0, block_ids=[], sample=True,
                            sampling_params=SamplingParams(**params), prompt_token_ids=list(prompt),
                            output_token_ids=list(output), eos_token_ids=())  # fmt: skip


def test_apply_penalties_follows_the_definitions_by_hand():
    from inferlab.engine.sampler import apply_penalties

    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]] * 3)
    rows = [
        _row([0, 1], [2], repetition_penalty=2.0),  # seen: 0, 1, 2 (prompt and output)
        _row([0], [2, 2, 3], presence_penalty=0.5, frequency_penalty=0.25),  # output counts: 2:2, 3:1
        _row([0], [2], temperature=1.0),  # no penalties: untouched
    ]
    out = apply_penalties(logits.clone(), rows)
    assert out[0].tolist() == [1.0, -4.0, 0.5, 0.5, 3.0]  # positive / 2, negative * 2, unseen kept
    assert out[1].tolist() == [2.0, -2.0, 1.0 - 0.5 - 2 * 0.25, 0.5 - 0.5 - 0.25, 3.0]
    assert out[2].tolist() == logits[2].tolist()


def test_plain_greedy_is_exactly_when_the_sampler_would_take_the_raw_argmax():
    """ModelRunner skips the logits (DecoderModel.greedy_tokens) only for a step whose every row
    takes the argmax of its raw logits: any row sampling, asking for logprobs, biased, penalised,
    held by min_tokens or a grammar keeps the step on the sampler."""
    from types import SimpleNamespace

    from inferlab.engine.sampler import plain_greedy

    plain = _row([0], [1], temperature=0.0)
    assert plain_greedy([plain, _row([0], [1, 2, 3], temperature=0.0, min_tokens=3)])  # min_tokens met
    for other in (
        _row([0], [1], temperature=0.7),
        _row([0], [1], temperature=0.0, logprobs=2),
        _row([0], [1], temperature=0.0, logit_bias={3: 5.0}),
        _row([0], [1], temperature=0.0, allowed_token_ids=[1, 2]),
        _row([0], [1], temperature=0.0, repetition_penalty=1.1),
        _row([0], [1], temperature=0.0, min_tokens=3),  # EOS still masked
        SimpleNamespace(sampling_params=plain.sampling_params, output_token_ids=[1], grammar=object()),
    ):
        assert not plain_greedy([plain, other])
