"""`inferlab perplexity`'s arithmetic on hand-computed cases: chunking, scored positions,
PPL and its ±, the KL-divergence statistics and the base file's identity checks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from inferlab.engine.request import Logprob
from inferlab.quality.base_file import BaseIdentity, load_base, save_base, tokens_sha256
from inferlab.quality.kld import KldAccumulator, base_rows, mean_and_error, percentile, token_stats
from inferlab.quality.perplexity import PerplexityAccumulator, TextTooShortError, make_chunks, scored_nll
from inferlab.quality.scoring import score_chunks


def test_chunks_are_whole_contexts_with_bos_at_each_start():
    tokens = list(range(100, 100 + 8 * 3 + 5))  # 3 whole chunks of 8 and a remainder
    chunking, chunks = make_chunks(tokens, 8, bos_token_id=1)
    assert chunking.n_chunks == 3 and chunking.first == 4 and chunking.scored_per_chunk == 3
    assert chunks == [[1] + tokens[1:8], [1] + tokens[9:16], [1] + tokens[17:24]]
    assert make_chunks(tokens, 8)[1][1] == tokens[8:16]  # no BOS when the vocabulary adds none
    assert make_chunks(tokens, 8, max_chunks=2)[0].n_chunks == 2


def test_a_text_shorter_than_two_contexts_is_refused_with_its_counts():
    with pytest.raises(TextTooShortError, match=r"has 15 tokens.*context of 8 needs at least 16"):
        make_chunks(list(range(15)), 8)
    assert make_chunks(list(range(16)), 8)[0].n_chunks == 2


def _entries(chunk: list[int], logprob_of) -> list:
    """vLLM-shaped prompt logprobs: None, then {token: Logprob, other: Logprob} per position."""
    out = [None]
    for p in range(1, len(chunk)):
        out.append({chunk[p]: Logprob(chunk[p], logprob_of(p)), 10**6: Logprob(10**6, -0.01)})
    return out


def test_only_the_second_half_is_scored_each_from_its_own_position():
    chunking, (chunk,) = make_chunks(list(range(10, 26)), 8, max_chunks=1)
    nll = scored_nll(_entries(chunk, lambda p: -0.1 * p), chunking)
    # positions 5, 6, 7 (first = 4 predicts 5; position 7 is the last token of the chunk)
    assert np.allclose(nll, [0.5, 0.6, 0.7])


def test_ppl_and_its_error_by_hand():
    acc = PerplexityAccumulator()
    acc.add(np.array([1.0, 2.0]))
    acc.add(np.array([3.0, 4.0]))
    assert acc.count == 4 and acc.ppl == pytest.approx(math.exp(2.5))
    # E[x²] - E[x]² = 7.5 - 6.25 = 1.25; standard error sqrt(1.25 / 3), times PPL.
    assert acc.ppl_error == pytest.approx(math.exp(2.5) * math.sqrt(1.25 / 3))
    same = PerplexityAccumulator()
    same.add(np.array([2.0, 2.0, 2.0]))
    assert math.isnan(same.ppl_error)


class _FakeOut:
    def __init__(self, prompt_logprobs):
        self.prompt_logprobs = prompt_logprobs
        self.prompt_logprob_rows = None


class _FakeLLM:
    """Scores token t at position p with logprob -(t % 5 + 1) / 10 - p / 100; counts the calls."""

    def __init__(self):
        self.calls: list[int] = []

    def generate(self, prompts, params, use_prefix_cache=True):
        assert params.max_tokens == 1 and params.prompt_logprobs == 0 and not use_prefix_cache
        self.calls.append(len(prompts))
        return [_FakeOut(_entries(c, lambda p, c=c: -((c[p] % 5) + 1) / 10 - p / 100)) for c in prompts]


def test_perplexity_over_a_fake_logprob_source_equals_the_hand_sum():
    tokens = list(range(40))
    chunking, chunks = make_chunks(tokens, 8)  # 5 chunks
    llm = _FakeLLM()
    acc = PerplexityAccumulator()
    for s in score_chunks(llm, chunks, chunking, chunks_per_step=2):
        acc.add(s.nll)
    assert llm.calls == [2, 2, 1]
    want = [((t % 5) + 1) / 10 + p / 100 for i in range(5) for p, t in zip(range(5, 8), tokens[8 * i + 5 : 8 * i + 8])]
    assert acc.count == 15
    assert acc.ppl == pytest.approx(math.exp(sum(want) / 15))


def _log(p):
    p = np.asarray(p, dtype=np.float64)
    return np.log(p / p.sum(axis=-1, keepdims=True)).astype(np.float32)


def test_kld_of_a_hand_made_pair_whole_and_top_k_with_a_rest_bin():
    base = _log([[0.5, 0.3, 0.15, 0.05]])
    q = _log([[0.35, 0.45, 0.1, 0.1]])
    target = np.array([1])
    full = token_stats(q, target, base_rows(base, target, top_k=4))
    want = 0.5 * math.log(0.5 / 0.35) + 0.3 * math.log(0.3 / 0.45) + 0.15 * math.log(0.15 / 0.1) + 0.05 * math.log(0.05 / 0.1)
    assert full.kld[0] == pytest.approx(want, rel=1e-5)
    assert full.p_diff[0] == pytest.approx(0.45 - 0.3, rel=1e-5)
    assert full.nll[0] == pytest.approx(-math.log(0.45)) and full.nll_base[0] == pytest.approx(-math.log(0.3))
    assert not full.same_top[0]  # Q's most likely token is 1, the base's 0
    top2 = token_stats(q, target, base_rows(base, target, top_k=2))
    # Bins {0}, {1}, {2, 3}: the rest has 0.2 under the base and 0.2 under Q.
    want2 = 0.5 * math.log(0.5 / 0.35) + 0.3 * math.log(0.3 / 0.45) + 0.2 * math.log(0.2 / 0.2)
    assert top2.kld[0] == pytest.approx(want2, rel=1e-5)
    assert top2.kld[0] <= full.kld[0]  # a lower bound (log-sum inequality)


def test_mean_error_and_percentiles_like_llama_perplexity():
    assert mean_and_error(np.arange(10.0)) == (4.5, 0.0)  # 10 values or fewer: no error
    x = np.arange(11.0)
    assert mean_and_error(x)[1] == pytest.approx(math.sqrt((np.mean(x * x) - 25.0) / 10))
    v = np.array([0.0, 1.0, 2.0, 3.0, 4.0])
    assert percentile(v, 0.9) == pytest.approx(3.6) and percentile(v, 0.1) == pytest.approx(0.4)
    assert percentile(v, 0.0) == 0.0 and percentile(v, 1.0) == 4.0


def test_kld_summary_by_hand_on_twenty_tokens():
    rng = np.random.default_rng(0)
    base = _log(rng.random((20, 6)) + 0.05)
    q = _log(rng.random((20, 6)) + 0.05)
    targets = rng.integers(0, 6, 20)
    acc = KldAccumulator()
    acc.add(token_stats(q[:12], targets[:12], base_rows(base[:12], targets[:12], 6)))
    acc.add(token_stats(q[12:], targets[12:], base_rows(base[12:], targets[12:], 6)))
    s = acc.summary()
    pb, pq = np.exp(base.astype(np.float64)), np.exp(q.astype(np.float64))
    kld = (pb * (np.log(pb) - np.log(pq))).sum(axis=1)
    assert s.count == 20 and s.kld[0] == pytest.approx(kld.mean(), rel=1e-5)
    assert s.kld[1] == pytest.approx(kld.std() / math.sqrt(19), rel=1e-4)
    assert s.kld_percentiles["median"] == pytest.approx(np.median(kld), rel=1e-5)
    assert s.kld_percentiles["max"] == pytest.approx(kld.max(), rel=1e-5)
    assert s.kld_percentiles["99.0"] == pytest.approx(np.quantile(kld, 0.99), rel=1e-5)
    i = np.arange(20)
    dp = pq[i, targets] - pb[i, targets]
    assert s.p_diff_rms[0] == pytest.approx(math.sqrt((dp * dp).mean()), rel=1e-5)
    assert s.same_top[0] == pytest.approx(np.mean(pq.argmax(1) == pb.argmax(1)))
    nq, nb = -np.log(pq[i, targets]), -np.log(pb[i, targets])
    assert s.ppl[0] == pytest.approx(math.exp(nq.mean()), rel=1e-5)
    assert s.ln_ppl_ratio[0] == pytest.approx(nq.mean() - nb.mean(), rel=1e-5)
    se = lambda x: x.std() / math.sqrt(19)  # noqa: E731
    cov = (np.mean(nq * nb) - nq.mean() * nb.mean()) / 19
    assert s.ln_ppl_ratio[1] == pytest.approx(math.sqrt(se(nq) ** 2 + se(nb) ** 2 - 2 * cov), rel=1e-4)


def test_base_file_round_trip_and_refusals(tmp_path):
    chunks = [[1, 2, 3, 4], [5, 6, 7, 8]]
    ident = BaseIdentity(6, 4, 2, tokens_sha256(chunks), "m")
    rows = base_rows(_log(np.random.default_rng(1).random((2, 6)) + 0.1), np.array([2, 3]), 3)
    path = tmp_path / "base.safetensors"
    save_base(path, ident, rows, 3)
    back = load_base(path, BaseIdentity(6, 4, 2, tokens_sha256(chunks), "another model, same tokens"))
    assert np.array_equal(back.top_ids, rows.top_ids) and np.allclose(back.rest_logprob, rows.rest_logprob)
    with pytest.raises(ValueError, match="vocab size 6 in the base, 8 here"):
        load_base(path, BaseIdentity(8, 4, 2, ident.tokens_sha256))
    with pytest.raises(ValueError, match="token ids hash"):
        load_base(path, BaseIdentity(6, 4, 2, tokens_sha256([[1, 2, 3, 4], [5, 6, 7, 9]])))
    with pytest.raises(ValueError, match="n_ctx 4 in the base, 8 here"):
        load_base(path, BaseIdentity(6, 8, 2, ident.tokens_sha256))
    (tmp_path / "junk").write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match="cannot be read|not an inferlab"):
        load_base(tmp_path / "junk", ident)
