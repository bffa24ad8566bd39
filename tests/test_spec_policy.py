"""The "when it pays" rule (engine/spec_policy.py): drafts only where E(k)·S > (1 + MARGIN)·B·(b + c)·k,
with the step cost fitted from measured steps, the proposer's measured cost and each request's
acceptance per position; and the scheduler asking it (adaptive on) or not (off)."""

from __future__ import annotations

import math
import random

import pytest
from engine_factories import make_request, make_scheduler
from test_spec_decode_core import PROMPT, prefill

from inferlab.config import SpeculativeConfig
from inferlab.engine.outputs import ModelRunnerOutput
from inferlab.engine.spec_policy import (
    MARGIN,
    PROBE_EVERY,
    PROBE_MAX,
    SHADOW_MAX,
    SHADOW_SHARE,
    SpecPolicy,
    measured_step_cost,
)


def measured(a: float, b: float, k: int = 4, shadow: bool = False) -> SpecPolicy:
    """A policy that has seen decode steps of 1..40 rows costing exactly a + b·rows."""
    p = SpecPolicy(k, shadow_probes=shadow)
    for rows in list(range(1, 41)) * 3:
        p.observe_step(rows, a + b * rows)
    return p


def accepting(p: SpecPolicy, rid: str, rate: float, steps: int = 40) -> None:
    """Verdicts of 4 drafts per step whose positions are each kept with probability `rate`."""
    rng = random.Random(rid)
    for _ in range(steps):
        accepted = 0
        while accepted < 4 and rng.random() < rate:
            accepted += 1
        p.observe_verdict(rid, 4, accepted)


def test_the_step_cost_is_fitted_from_measured_steps():
    a, b = measured(0.010, 0.0005).step_cost()
    assert a == pytest.approx(0.010, rel=1e-6) and b == pytest.approx(0.0005, rel=1e-6)
    # Rows that never vary: the prior slope, the level from the measurements.
    p = SpecPolicy(4)
    for _ in range(10):
        p.observe_step(8, 0.015)
    a, b = p.step_cost()
    assert a + 8 * b == pytest.approx(0.015) and b == pytest.approx(a / 16)


def test_the_start_up_measure_takes_medians_of_the_two_row_groups():
    steps = [(1, 0.008), (1, 0.0081), (1, 0.050), (1, 0.0079)] + [(32, 0.040), (32, 0.041), (32, 0.039), (33, 0.2)]
    a, b = measured_step_cost(steps)
    assert b == pytest.approx((0.0405 - 0.00805) / (32.25 - 1)) and a == pytest.approx(0.00805 - b)  # the 50 and 200 ms steps ignored
    assert measured_step_cost([(32, 0.04)] * 5) is None  # no spread
    assert measured_step_cost([(1, 0.04), (32, 0.01)]) is None  # not a + b·T with b > 0


def test_with_rows_that_never_vary_the_start_up_measure_sets_the_row_cost():
    """32 streams in lock step: every step 32 rows, so no slope of their own. The prior b = a / 16
    makes a row look cheap; the fixed part measured at start-up (8 ms) gives the row what the
    steps cost beyond it, and drafts kept 89% of the time no longer pass at 32 streams."""
    def lockstep(base_cost: float | None) -> SpecPolicy:
        p = SpecPolicy(4)
        if base_cost is not None:
            p.base_cost, p.row_cost_ratio, p.base_ratio = base_cost, 1 / 12, 1 / 12
        for _ in range(50):
            p.observe_step(32, 0.0416)  # 8 ms + 1.05 ms x 32: a 2-core Zen 4 at ~250-token contexts
        accepting(p, "r", 0.89)
        return p

    a, b = lockstep(0.008).step_cost()
    assert a == pytest.approx(0.008) and b == pytest.approx(0.00105)
    assert lockstep(None).best_drafts("r", batch=32) > 0
    assert lockstep(0.008).best_drafts("r", batch=32) == 0
    assert lockstep(0.008).best_drafts("r", batch=1) > 0  # at one stream drafting still pays
    # A faster spell than at start-up: a row never a smaller share of a than start-up's b / a,
    # and the line still through the steps' mean.
    p = SpecPolicy(4, base_cost=0.008, row_cost_ratio=1 / 12, base_ratio=1 / 12)
    for _ in range(50):
        p.observe_step(32, 0.020)
    a, b = p.step_cost()
    assert b / a == pytest.approx(1 / 12) and a + 32 * b == pytest.approx(0.020)


def test_lock_step_after_varying_rows_is_modelled_through_its_own_mean():
    """Drafting workloads vary the rows and their slope fit may put most of a step on the rows
    (here b / a = 0.48); the lock-step steps after them (32 streams of chat, nothing drafted) must
    still be modelled at what they measure, not at that ratio times the start-up a."""
    p = SpecPolicy(4, shadow_probes=True, base_cost=0.008, row_cost_ratio=1 / 12, base_ratio=1 / 12)
    for i in range(200):
        rows = 32 + (i % 5) * 32
        p.observe_step(rows, 0.0025 + 0.0012 * rows)
    a, b = p.step_cost()
    assert b / a == pytest.approx(0.48)  # the slope fit
    for _ in range(400):
        p.observe_step(32, 0.040)
    a, b = p.step_cost()
    assert a + 32 * b == pytest.approx(0.040, rel=1e-2)
    assert (a, b) == pytest.approx((0.008, 0.001), rel=2e-2)
    # The shadow spacing follows the step measured: 32 searches of 0.2 ms against 0.25% of 40 ms.
    p.observe_proposal(0.0002 * 10, 0, num_requests=10)
    assert p.shadow_every(32) == math.ceil(32 * 0.0002 / (SHADOW_SHARE * (a + 32 * b)))


def test_shadow_probes_are_spaced_by_what_the_proposer_costs():
    """Shadows cost no row, only the proposer's search: every 16th step while that is cheap,
    fewer (up to every 128th) once a batch's searches would take more than 0.25% of the step,
    priced per request asked (a search costs the same whether it finds one draft or four)."""
    p = measured(0.008, 0.001, shadow=True)
    assert p.shadow_every(32) == PROBE_EVERY  # no proposal measured yet: free
    p.observe_proposal(0.0003 * 10, 10, num_requests=10)  # 0.3 ms a request, one draft each
    assert p.shadow_every(1) == PROBE_EVERY
    # 32 x 0.3 ms against 0.25% of a 40 ms step: every 96th step (priced as K x 0.3 ms a draft: the cap).
    assert p.shadow_every(32) == math.ceil(32 * 0.0003 / (SHADOW_SHARE * 0.040)) < SHADOW_MAX
    assert PROBE_EVERY < p.shadow_every(8) < p.shadow_every(32)
    p.observe_proposal(0.003 * 100, 100, num_requests=100)  # searches of 3 ms: as rare as allowed
    assert p.shadow_every(32) == SHADOW_MAX


def test_one_stream_speculates_even_at_modest_acceptance():
    p = measured(0.010, 0.0005)
    assert p.num_drafts("new", batch=1) == 4  # the prior: 1/2, and rows are cheap
    accepting(p, "r", 0.3)
    assert 1 <= p.num_drafts("r", batch=1) < 4  # fewer drafts, not none: one costs 5% of a step


def test_many_streams_speculate_only_what_is_mostly_accepted():
    p = measured(0.010, 0.0005)
    accepting(p, "chat", 0.2)
    accepting(p, "copy", 0.95)
    assert p.num_drafts("chat", batch=32) == 0
    assert p.num_drafts("copy", batch=32) >= 2
    # A new request of a workload whose drafts are rejected starts from that rate.
    q = measured(0.010, 0.0005)
    accepting(q, "chat", 0.1, steps=200)
    assert q.num_drafts("next", batch=32) == 0 < p.num_drafts("next", batch=1)


def test_a_request_kept_from_drafting_is_probed_now_and_then():
    p = measured(0.010, 0.0005)
    accepting(p, "chat", 0.1)
    every = p.probe_every(32)
    ks = [p.num_drafts("chat", batch=32) for _ in range(3 * every)]
    assert ks.count(1) == 3 and ks.count(0) == len(ks) - 3
    # Probes at 32 streams are rarer (each is a row of a dear step), but not never.
    assert PROBE_EVERY == p.probe_every(1) < p.probe_every(32) <= PROBE_MAX


def test_a_shadow_probe_costs_no_row_and_counts_as_the_verdict_verification_would_give():
    p, twin = measured(0.010, 0.0005, shadow=True), measured(0.010, 0.0005)
    for q in (p, twin):
        accepting(q, "chat", 0.1)
    plans = [p.plan("chat", batch=32) for _ in range(PROBE_EVERY)]
    assert plans.count((4, True)) == 1 and plans.count((0, False)) == PROBE_EVERY - 1
    assert p.num_drafts("other", batch=32) == 0  # nothing to verify, ever, from a shadow
    p.observe_shadow("chat", [5, 6, 7, 8])
    # While one is pending no other is proposed for the request.
    assert all(p.plan("chat", batch=32) == (0, False) for _ in range(2 * PROBE_EVERY))
    for token in (5, 6, 9, 7):  # two kept, the third is not: 4 drafts, 2 accepted
        p.observe_tokens("chat", [token])
    twin.observe_verdict("chat", 4, 2)
    assert p.acceptance("chat") == pytest.approx(twin.acceptance("chat"))
    assert p.plan("chat", batch=32) == (4, True)  # the next one is due at once
    p.observe_shadow("chat", [1, 2])
    p.observe_tokens("chat", [1, 2, 3])  # every draft matched, in one call
    twin.observe_verdict("chat", 2, 2)
    assert p.acceptance("chat") == pytest.approx(twin.acceptance("chat"))


def test_copying_seen_by_shadow_probes_turns_drafting_on_without_a_drafted_row_before():
    """A request whose history says drafts fail, that then copies: its shadow probes see the
    copy, and it drafts; no step before that carried a draft, and the metrics count none."""
    sched = make_scheduler(speculative_config=SpeculativeConfig("ngram", 4, 3, 1), block_size=4)
    for _ in range(50):
        sched.policy.observe_verdict("old", 4, 0)
    for rows in range(1, 40):
        sched.policy.observe_step(rows, 0.01 + 0.002 * rows)
    period = [10, 11, 12, 13, 14]
    r = make_request("r", period * 3, max_tokens=64)
    prefill(sched, r, first=10)
    decoded = 0
    for _ in range(2 * PROBE_EVERY):
        so = sched.schedule()
        if so.scheduled[0].num_draft_tokens:
            break
        sched.update_from_output(so, ModelRunnerOutput(["r"], [period[len(r.all_token_ids) % 5]]))
        decoded += 1
    else:
        pytest.fail("the copying request never drafted")
    assert decoded > 0 and sched.spec_stats.num_drafts == 0
    assert sched.policy.requests["r"].trials == [1, 1, 1, 1]  # a shadow of 4 drafts, all kept
    drafts = so.scheduled[0].token_ids[1:]
    assert drafts == [period[(len(r.all_token_ids) + j) % 5] for j in range(len(drafts))]


def test_acceptance_is_per_position():
    """Copying is all or nothing: a second draft is kept whenever the first was. One α over all
    positions would expect 0.8 + 0.64 + ... of 4 drafts; per position it is 0.8 x 4."""
    p = measured(0.010, 0.0005)
    rng = random.Random(1)
    for _ in range(200):
        p.observe_verdict("copy", 4, 4 if rng.random() < 0.8 else 0)
    alphas = p.acceptance("copy")
    assert alphas[0] == pytest.approx(0.8, abs=0.07) and min(alphas[1:]) > 0.97
    assert p.expected("copy")[3] == pytest.approx(4 * alphas[0], rel=0.05)
    # The engine-wide rate is the prior for a new request, and it follows the workload.
    for _ in range(2000):
        p.observe_verdict("chat", 4, 0)
    assert p.acceptance("new")[0] < 0.05


def test_a_costly_proposer_drafts_less():
    cheap, costly = measured(0.010, 0.0005), measured(0.010, 0.0005)
    for p in (cheap, costly):
        accepting(p, "r", 0.6)
    costly.observe_proposal(0.004 * 40, 40)  # 4 ms per draft token: 40% of a step
    assert cheap.num_drafts("r", batch=4) > costly.num_drafts("r", batch=4)


def test_the_rule_is_the_throughput_comparison():
    """The k chosen has (B + E(k)) / (S + (1 + MARGIN)·b·k) > B / S: drafts beat the step's own
    rate by the margin; none is chosen when no k does."""
    p = measured(0.010, 0.001)
    accepting(p, "r", 0.7)
    expected = p.expected("r")
    a, b = p.step_cost()
    chosen = set()
    for batch in (1, 4, 16, 32, 64):
        s = a + b * batch
        rates = {k: (batch + expected[k - 1]) / (s + (1 + MARGIN) * b * k) for k in range(1, 5)}
        k = p.best_drafts("r", batch)
        chosen.add(k)
        if k == 0:
            assert all(r <= batch / s for r in rates.values()), batch
        else:
            assert rates[k] > batch / s, batch
    assert 0 in chosen and len(chosen) > 1  # on at a small batch, off at a large one


def test_a_marginal_gain_is_not_taken():
    """A k that pays by less than the margin (E(k)·S just above B·b·k) is not drafted."""
    p = measured(0.010, 0.001)
    accepting(p, "r", 0.5, steps=400)
    a, b = p.step_cost()
    e1 = p.expected("r")[0]
    batch = int(e1 * a / (b * (1 + MARGIN / 2) - e1 * b))  # E(1)·S = (1 + MARGIN/2)·B·b
    s = a + b * batch
    assert e1 * s > batch * b  # one draft would pay, a little
    assert p.best_drafts("r", batch) == 0


def test_a_step_that_carries_prompt_tokens_verifies_no_drafts():
    """Beside a prefill a step is compute-bound: a draft's row there costs a prompt token's time
    and takes its budget. The copying request drafts again in the next decode-only step."""
    sched = make_scheduler(speculative_config=SpeculativeConfig("ngram", 4, 3, 1), block_size=4)
    for _ in range(50):
        sched.policy.observe_verdict("old", 4, 4)  # drafts have been kept: the rule drafts
    for rows in range(1, 40):
        sched.policy.observe_step(rows, 0.01 + 0.0005 * rows)
    r = make_request("r", PROMPT, max_tokens=32)
    prefill(sched, r)
    assert sched.policy.best_drafts("r", batch=1) > 0
    sched.add_request(make_request("new", [20, 21, 22, 23, 24], max_tokens=8))
    so = sched.schedule()
    by = {s.request_id: s for s in so.scheduled}
    assert by["r"].num_draft_tokens == 0 and len(by["new"].token_ids) == 5
    sched.update_from_output(so, ModelRunnerOutput(["r", "new"], [14, 25]))
    so = sched.schedule()  # decodes only
    assert {s.request_id: s.num_draft_tokens for s in so.scheduled}["r"] > 0


def test_the_scheduler_asks_the_policy_only_when_adaptive():
    for adaptive, want in ((True, 0), (False, 4)):
        sched = make_scheduler(speculative_config=SpeculativeConfig("ngram", 4, 3, 1, adaptive=adaptive), block_size=4)
        if sched.policy is not None:
            for _ in range(50):  # a history of rejected drafts
                sched.policy.observe_verdict("old", 4, 0)
            for rows in range(1, 40):
                sched.policy.observe_step(rows, 0.01 + 0.002 * rows)
        r = make_request("r", PROMPT, max_tokens=32)
        prefill(sched, r)
        so = sched.schedule()
        assert so.scheduled[0].num_draft_tokens == want, adaptive


def test_copying_seen_by_probes_alone_turns_drafting_on_at_32_streams():
    """Probes draft one token; if those are nearly always kept, deeper positions are expected to
    be too, and a copy workload drafts at 32 streams (where a rate of 0.5 everywhere would not)."""
    p = measured(0.0116, 0.00072)  # the Zen 5 figures: 34.6 ms for 32 rows, 0.72 ms a row
    assert p.num_drafts("fresh", batch=32) == 0
    for i in range(100):
        p.observe_verdict(f"probe{i}", 1, 1 if i % 25 else 0)
    assert p.best_drafts("next", batch=32) >= 2  # with 1/2 at the positions not seen: 1


def test_new_requests_probe_staggered():
    p = measured(0.0116, 0.00072)
    every = p.probe_every(32)
    first = {}
    for step in range(every):
        for i in range(32):
            if p.num_drafts(f"r{i}", batch=32) and i not in first:
                first[i] = step
    assert len(first) == 32 and len(set(first.values())) > 16  # each probes within the interval, not all at once


def test_a_step_is_planned_at_once_as_request_by_request():
    """plan_step gives each request what plan() would, in the same order (probes included), and
    settles those under the first-position bound without their full estimate."""
    one, many = measured(0.010, 0.0005, shadow=True), measured(0.010, 0.0005, shadow=True)
    for p in (one, many):
        accepting(p, "chat", 0.1)
        accepting(p, "copy", 0.98)
    ids = ["chat", "copy", "new"]
    for _ in range(3 * PROBE_MAX):
        assert many.plan_step(ids, batch=32) == [one.plan(rid, batch=32) for rid in ids]
    assert any(k for k, _ in many.plan_step(ids, batch=32))  # copying still drafts at 32 streams

    def no_estimate(request_id: str) -> list[float]:
        raise AssertionError(f"full estimate asked for {request_id}")
    many.expected = no_estimate  # type: ignore[method-assign]
    assert [k for k, shadow in many.plan_step(["chat"] * 5, batch=32) if not shadow] == [0] * 5
    with pytest.raises(AssertionError, match="copy"):
        many.plan_step(["copy"], batch=32)
