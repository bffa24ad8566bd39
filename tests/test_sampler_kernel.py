"""The one-call sampling kernel (kernels/csrc/sampler.cpp) against the sampler's definition
(engine/sampler.py): on a fine grid of uniforms a token of probability q gets q * N of N draws,
to within one; greedy rows are torch.argmax; masked tokens are never drawn; and the whole Sampler
gives the same tokens through the kernel as through the torch operators."""

from __future__ import annotations

import pytest
import torch
from test_sampler import GRID, N, counts, reference

from inferlab.engine.outputs import ScheduledRequest
from inferlab.engine.request import SamplingParams
from inferlab.engine.sampler import CANDIDATES, Sampler
from inferlab.kernels import build

pytestmark = pytest.mark.skipif(not build.available(), reason=f"kernels unavailable: {build.unavailable_reason()}")


def fused(logits, temperature, top_k, top_p, min_p, u):
    n = logits.shape[0]

    def col(v, dtype):
        return torch.tensor(v if isinstance(v, list) else [v] * n, dtype=dtype)

    return torch.ops.inferlab.sample_rows(logits.contiguous(), col(temperature, torch.float32),
                                          col(top_k, torch.long), col(top_p, torch.float32),
                                          col(min_p, torch.float32), u)


@pytest.mark.parametrize(
    "top_k,top_p,min_p,scale",
    [
        (40, 1.0, 0.0, 3.0),    # top-k only
        (0, 0.9, 0.0, 3.0),     # top-p only, the nucleus among the candidates
        (40, 0.95, 0.05, 3.0),  # llama.cpp's defaults
        (0, 0.99, 0.0, 0.05),   # a flat row: the nucleus reaches past the candidates
        (300, 0.9, 0.0, 0.05),  # a top-k larger than the candidate count
        (2000, 1.0, 0.0, 1.0),  # a top-k past the heap's range (partial sort)
        (0, 1.0, 0.1, 2.0),     # no truncation: the whole vocabulary, min-p
        (0, 1.0, 0.0, 1.0),     # plain softmax
    ],
)
@pytest.mark.parametrize("vocab", [1000, 5003])  # 5003: not a multiple of the kernel's 8 lanes or 64-value blocks
def test_kernel_draws_follow_the_definition(top_k, top_p, min_p, scale, vocab):
    assert vocab > CANDIDATES
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(top_k + vocab)) * scale
    want = reference(logits, top_k, top_p, min_p)
    got = counts(fused(logits.expand(N, -1), 1.0, top_k, top_p, min_p, GRID), vocab)
    assert ((got > 0) <= (want > 0)).all()  # nothing outside the kept set
    assert (got - want * N).abs().max() <= 1.0


def test_temperature_scales_the_logits_and_zero_is_argmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 700, generator=g) * 2
    got = counts(fused(logits.expand(N, -1), 0.5, 0, 1.0, 0.0, GRID), 700)
    want = torch.softmax(logits[0] / 0.5, dim=0)
    assert (got - want * N).abs().max() <= 1.0
    ties = torch.zeros(3, 50)
    ties[0, [7, 30]] = 5.0  # two equal maxima: the first, as torch.argmax
    ties[1, 49] = 1.0
    ties[2] = -1.0
    assert fused(ties, 0.0, 40, 0.9, 0.1, torch.zeros(3, dtype=torch.float64)).tolist() == \
        ties.argmax(dim=-1).tolist() == [7, 49, 0]


def test_masked_tokens_are_never_drawn_and_edges_pick_a_weighted_token():
    logits = torch.full((1, 300), float("-inf"))
    logits[0, [3, 150, 299]] = torch.tensor([0.0, 1.0, -0.5])
    u = torch.tensor([0.0, 1e-12, 0.5, 1.0 - 1e-12, 1.0], dtype=torch.float64)
    for top_k, top_p in [(0, 1.0), (40, 1.0), (0, 0.9), (0, 0.999)]:
        got = fused(logits.expand(len(u), -1), 1.0, top_k, top_p, 0.0, u)
        assert set(got.tolist()) <= {3, 150, 299}, (top_k, top_p)


def test_a_batch_mixes_rows_of_every_kind():
    vocab = 600
    g = torch.Generator().manual_seed(7)
    rows = [(5, 1.0, 0.0, 2.0, 1.0), (0, 0.5, 0.0, 2.0, 0.7), (0, 0.999, 0.0, 0.01, 1.3), (20, 0.8, 0.2, 1.0, 1.0),
            (0, 1.0, 0.05, 1.0, 0.9)]
    logits = torch.stack([torch.randn(vocab, generator=g) * s for *_, s, _ in rows])
    m = N // len(rows)
    u = (torch.arange(m, dtype=torch.float64) + 0.5) / m
    rep = [r for r in rows for _ in range(m)]
    got = fused(logits.repeat_interleave(m, dim=0), [r[4] for r in rep], [r[0] for r in rep], [r[1] for r in rep],
                [r[2] for r in rep], u.repeat(len(rows)))
    for i, (k, p, q, _, t) in enumerate(rows):
        want = reference(logits[i : i + 1] / t, k, p, q)
        c = counts(got[i * m : (i + 1) * m], vocab)
        assert ((c > 0) <= (want > 0)).all(), i
        assert (c - want * m).abs().max() <= 1.0, i


def test_bad_input_is_refused():
    with pytest.raises(RuntimeError, match="float32"):
        fused(torch.zeros(2, 10, dtype=torch.float64), 1.0, 0, 1.0, 0.0, torch.zeros(2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="one parameter per row"):
        torch.ops.inferlab.sample_rows(torch.zeros(2, 10), torch.ones(3), torch.zeros(2, dtype=torch.long),
                                       torch.ones(2), torch.zeros(2), torch.zeros(2, dtype=torch.float64))


def test_the_sampler_gives_the_same_tokens_through_the_kernel():
    """Seeded requests of every kind: the same tokens from Sampler(fused=True) as from the torch
    operators (both draw the same uniforms), on peaked rows like a model's."""
    g = torch.Generator().manual_seed(3)
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05), dict(temperature=1.0),
             dict(temperature=0.7, top_p=0.9), dict(temperature=1.2, top_k=5), dict(temperature=0.6, min_p=0.1)]
    rows = [ScheduledRequest(str(i), [1], 0, [0], True, SamplingParams(seed=i, **kinds[i % len(kinds)]), [1, 2],
                             list(range(i % 7))) for i in range(96)]
    same = total = 0
    for _ in range(5):
        logits = torch.randn(len(rows), 2000, generator=g) * 4
        a = Sampler(seed=0, fused=False)(logits.clone(), rows).token_ids
        b = Sampler(seed=0, fused=True)(logits.clone(), rows).token_ids
        same += sum(x == y for x, y in zip(a, b))
        total += len(a)
    assert same >= total - 1  # float32 sums in another order may move one draw across a boundary


def test_one_sampler_follows_its_rows_when_their_parameters_change():
    """Sampler keeps the kernel's per-row parameter tensors while the rows' values stay the same
    (a decode batch's requests): the same Sampler over a run of batches whose rows change kind,
    count or one field gives each batch the tokens a fresh Sampler gives it."""
    g = torch.Generator().manual_seed(5)
    kinds = [dict(temperature=0.0), dict(temperature=2.0), dict(temperature=2.0, top_k=2), dict(temperature=2.0, top_p=0.3),
             dict(temperature=2.0, min_p=0.5)]
    kept = Sampler(seed=0, fused=True)
    moved = 0
    for step, (kind, n) in enumerate([(0, 6), (1, 6), (1, 6), (2, 6), (3, 6), (4, 6), (0, 6), (1, 5), (1, 7), (0, 7)]):
        rows = [ScheduledRequest(str(i), [1], 0, [0], True, SamplingParams(seed=100 * step + i, **kinds[kind]), [1, 2],
                                 []) for i in range(n)]
        logits = torch.randn(n, 50, generator=g)
        got = kept(logits.clone(), rows).token_ids
        assert got == Sampler(seed=0, fused=True)(logits.clone(), rows).token_ids
        moved += got != logits.argmax(dim=-1).tolist()
    assert moved >= 4  # the hot rows drew tokens other than the argmax: a stale greedy setting would show
