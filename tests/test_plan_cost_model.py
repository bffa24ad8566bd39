"""Step cost models: the shape of a real step, the least-squares calibration, files."""

from __future__ import annotations

import json

import pytest

from inferlab.engine.outputs import ScheduledRequest, SchedulerOutput
from inferlab.engine.request import SamplingParams
from inferlab.plan.cost_model import (
    ConstantCost,
    LinearCost,
    StepSample,
    fit_linear,
    load_cost_model,
    load_profile,
    save_cost_model,
    shape_of,
    write_profile,
)
from inferlab.plan.roofline import StepShape


def sched(rid, start, n, prompt_len):
    return ScheduledRequest(rid, list(range(n)), start, [0], True, SamplingParams(), list(range(prompt_len)), [])


def test_shape_of_a_mixed_step():
    so = SchedulerOutput(
        scheduled=[
            sched("decode", 20, 1, 10),  # one token past its 10-token prompt: a decode
            sched("chunk", 16, 8, 40),  # a prompt chunk at 16..23
            sched("last-prompt-token", 4, 1, 5),  # the prompt's last token: still prefill
        ],
        num_scheduled_tokens=10,
    )
    s = shape_of(so)
    assert (s.num_prefill_tokens, s.num_decode_tokens, s.num_seqs) == (9, 1, 3)
    assert s.context_tokens == 21 + 24 + 5
    assert s.attention_pairs == 21 + (8 * 16 + 36) + 5


TRUE = LinearCost(0.002, 1e-5, 2e-4, 3e-8)


def samples():
    shapes = [StepShape(p, d, max(d, 1), c, 0) for p, d, c in
              [(512, 0, 512), (0, 8, 4000), (0, 32, 20000), (256, 4, 3000), (1024, 16, 9000), (0, 1, 100)]]
    return [StepSample(s, TRUE.step_time(s)) for s in shapes]


def test_fit_recovers_the_coefficients():
    fit = fit_linear(samples(), source="synthetic")
    for name in ("intercept_s", "per_prefill_token_s", "per_decode_token_s", "per_context_token_s"):
        assert getattr(fit, name) == pytest.approx(getattr(TRUE, name), rel=1e-6, abs=1e-12)
    assert fit.fit["r2"] == pytest.approx(1.0)
    assert fit.fit["n"] == 6
    assert fit.kind == "measured"


def test_fit_leaves_unmeasured_columns_at_zero_and_says_so():
    decode_only = [s for s in samples() if s.shape.num_prefill_tokens == 0]
    fit = fit_linear(decode_only)
    assert fit.per_prefill_token_s == 0.0
    assert any("prefill tokens: no sample" in n for n in fit.fit["notes"])
    assert fit.per_decode_token_s == pytest.approx(TRUE.per_decode_token_s, rel=1e-6)


def test_fit_needs_enough_samples():
    with pytest.raises(ValueError, match="at least 2"):
        fit_linear(samples()[:1])
    with pytest.raises(ValueError, match="at least 4 measured steps"):
        fit_linear(samples()[3:5])


def test_profile_and_cost_model_files(tmp_path):
    write_profile(samples(), tmp_path / "profile.json")
    back = load_profile(tmp_path / "profile.json")
    assert [s.step_time_s for s in back] == [s.step_time_s for s in samples()]
    # a bare list works too
    (tmp_path / "bare.json").write_text(json.dumps([s.to_dict() for s in samples()]))
    assert len(load_profile(tmp_path / "bare.json")) == 6
    (tmp_path / "bad.json").write_text(json.dumps([{"num_decode_tokens": 1}]))
    with pytest.raises(ValueError, match="profile sample"):
        load_profile(tmp_path / "bad.json")
    fit = fit_linear(samples())
    save_cost_model(fit, tmp_path / "cost.json")
    again = load_cost_model(tmp_path / "cost.json")
    assert again.step_time(StepShape(10, 3, 4, 900, 0)) == pytest.approx(fit.step_time(StepShape(10, 3, 4, 900, 0)))


def test_constant_cost():
    assert ConstantCost(0.01).step_time(StepShape(0, 3, 3, 30, 30)) == 0.01
    assert ConstantCost(0.01).step_time(StepShape(0, 0, 0, 0, 0)) == 0.0
    with pytest.raises(ValueError):
        ConstantCost(0)
