"""Calibrating the step cost on our engine: the fit recovers known coefficients, the profiling
workload has the shapes it promises, the engine's steps are recorded through `step_observer`
(on a tiny model), and `inferlab simulate --calibrate-engine` writes a profile `--calibrate`
reads back."""

from __future__ import annotations

import json

import numpy as np
import pytest

from inferlab.cli import main
from inferlab.plan.args import auto_compute_precision
from inferlab.plan.cost_model import LinearCost, StepSample, fit_linear, load_cost_model, load_profile
from inferlab.plan.engine_profile import (
    ProfileSpec,
    Ramp,
    StepRecorder,
    overhead_summary,
    profile_engine,
    step_kind,
)
from inferlab.plan.hardware import HardwareSpec
from inferlab.plan.roofline import StepShape

# A CPU-like truth: batched steps pay 75 ms, a one-token step 25 ms less.
TRUE = LinearCost(0.075, 1.8e-3, 2.5e-3, 2e-6, single_token_step_s=-0.025, per_attention_pair_s=1e-6)


def shapes():
    lone = [StepShape.from_chunks([(0, p, False)]) for p in (32, 64, 128, 256, 512, 1024)]
    decodes = [StepShape.from_chunks([(c - 1, 1, True)] * b) for b in (1, 2, 4, 8, 16, 32) for c in (130, 520)]
    mixed = [StepShape.from_chunks([(129, 1, True)] * b + [(0, 64, False)]) for b in (1, 4, 16)]
    many = [StepShape.from_chunks([(0, 128, False)] * n) for n in (8, 16)]
    return lone + decodes + mixed + many


def test_fit_recovers_known_coefficients_including_the_one_token_step():
    fit = fit_linear([StepSample(s, TRUE.step_time(s)) for s in shapes()])
    assert fit.coefficients == pytest.approx(TRUE.coefficients, rel=1e-6, abs=1e-12)
    assert fit.fit["max_rel_err"] == pytest.approx(0.0, abs=1e-9)
    assert fit.fit["weighting"] == "relative"


def test_noisy_fit_stays_close_and_reports_its_errors():
    rng = np.random.default_rng(0)
    samples = [StepSample(s, TRUE.step_time(s) * (1 + rng.normal(0, 0.03))) for s in shapes() * 3]
    fit = fit_linear(samples)
    decode1 = StepShape.decode(1, 130)
    decode32 = StepShape.decode(32, 130)
    for shape in (decode1, decode32, StepShape.from_chunks([(0, 1024, False)])):
        assert fit.step_time(shape) == pytest.approx(TRUE.step_time(shape), rel=0.05)
    assert 0.01 < fit.fit["median_rel_err"] < fit.fit["max_rel_err"] < 0.2
    assert fit.fit["r2"] > 0.99


def test_relative_weighting_keeps_the_short_steps_right():
    # A truth the linear model cannot follow exactly (matmuls get cheaper per token in big
    # steps): an absolute fit bends towards the multi-second prefills and misses the decodes.
    def truth(s):
        return 0.05 + 0.002 * s.num_decode_tokens + 0.0025 * s.num_prefill_tokens - 4e-7 * s.num_prefill_tokens ** 2

    samples = [StepSample(s, truth(s)) for s in shapes()]
    decodes = [s for s in samples if s.shape.num_prefill_tokens == 0]

    def worst_decode_error(fit):
        return max(abs(fit.step_time(s.shape) - s.step_time_s) / s.step_time_s for s in decodes)

    rel, ab = fit_linear(samples, relative=True), fit_linear(samples, relative=False)
    assert worst_decode_error(rel) < worst_decode_error(ab)
    assert rel.fit["max_rel_err"] < ab.fit["max_rel_err"]


def test_attention_pairs_tell_one_long_prompt_from_many_short_ones():
    fit = fit_linear([StepSample(s, TRUE.step_time(s)) for s in shapes()])
    one_long, eight_short = StepShape.from_chunks([(0, 1024, False)]), StepShape.from_chunks([(0, 128, False)] * 8)
    assert one_long.num_tokens == eight_short.num_tokens and one_long.context_tokens == eight_short.context_tokens
    gap = fit.step_time(one_long) - fit.step_time(eight_short)
    assert gap == pytest.approx(1e-6 * (one_long.attention_pairs - eight_short.attention_pairs), rel=1e-6)
    assert gap > 0.4  # ~460k more (query, key) pairs at 1 µs each


def test_a_negative_per_context_cost_is_fixed_at_zero():
    # Steps whose time falls as context grows (pure noise): the context term must not go negative.
    samples = [StepSample(StepShape(0, b, b, b * c, 0), 0.05 + 0.002 * b - 1e-6 * b * c)
               for b in (1, 2, 4, 8) for c in (100, 800)]
    fit = fit_linear(samples)
    assert fit.per_context_token_s == 0.0
    assert any("context tokens: fitted below zero" in n for n in fit.fit["notes"])


def test_one_token_term_needs_a_sample_to_spare():
    s = [StepSample(StepShape(0, b, b, 100 * b, 0), 0.05 + 0.002 * b) for b in (1, 8, 32)]
    fit = fit_linear(s)
    assert fit.single_token_step_s == 0.0
    assert any("one-token step: too few" in n for n in fit.fit["notes"])


def test_cost_models_saved_without_the_one_token_term_still_load(tmp_path):
    old = {"schema": "inferlab.cost-model/1", "kind": "linear", "intercept_s": 0.01, "per_prefill_token_s": 1e-4,
           "per_decode_token_s": 1e-3, "per_context_token_s": 0.0}
    (tmp_path / "old.json").write_text(json.dumps(old))
    m = load_cost_model(tmp_path / "old.json")
    assert m.single_token_step_s == 0.0
    assert m.step_time(StepShape.decode(1, 10)) == pytest.approx(0.011)


# ------------------------------------------------------------------ the profiling workload


def test_ramp_levels_and_lengths():
    r = Ramp(32, 128)
    assert r.levels() == [32, 16, 8, 4, 2, 1]
    assert [r.max_tokens(i, 3) for i in (0, 1, 2, 3, 4, 15, 16, 31)] == [19, 16, 13, 13, 10, 7, 4, 4]


def test_sized_spec_and_its_bounds():
    spec = ProfileSpec.sized(32, 1024)
    assert spec.prefill_lens == (32, 64, 128, 256, 512, 1024)
    assert spec.ramps == (Ramp(32, 128), Ramp(16, 512))
    assert (spec.bursts, spec.burst_len) == ((4, 8, 16), 128)
    assert spec.max_batch == 33  # the ramp plus the prompt that joins it
    assert spec.max_model_len == 1025
    small = ProfileSpec.sized(4, 48)
    assert small.prefill_lens == (32, 48)
    assert small.ramps == (Ramp(4, 48),)
    assert small.bursts == () and small.burst_len == 48
    with pytest.raises(ValueError, match="sizes must be >= 1"):
        ProfileSpec.sized(0, 64)
    with pytest.raises(ValueError, match="repeats"):
        ProfileSpec(repeats=0)


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from inferlab import LLM
    from inferlab.models.testing import make_tiny_hf_model

    path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m")
    spec = ProfileSpec.sized(4, 48)
    llm = LLM(str(path), max_num_seqs=spec.max_batch, max_model_len=spec.max_model_len,
              enable_prefix_caching=False, num_threads=1)
    return path, llm.engine


def test_recorded_steps_have_the_profiled_shapes(tiny_engine):
    _, engine = tiny_engine
    seen = []
    engine.step_observer = lambda so, ro: seen.append(so.num_scheduled_tokens)
    spec = ProfileSpec.sized(4, 48, bursts=(2,))
    samples = profile_engine(engine, spec)
    assert engine.step_observer is not None and not engine.has_unfinished_requests()
    engine.step_observer = None
    # the previous observer still saw every step: the unrecorded warm-up (16 prompt tokens, 3 out), then ours
    assert seen == [16, 1, 1] + [s.shape.num_tokens for s in samples]
    prefills = [s.shape for s in samples if step_kind(s) == "prefill"]
    # the lone prefills first, one step each, then a burst of 2 prompts, then the ramp's 4 prompts of 48
    assert [(p.num_prefill_tokens, p.num_seqs) for p in prefills] == [(32, 1), (48, 1), (96, 2), (192, 4)]
    decodes = [s.shape for s in samples if step_kind(s) == "decode"]
    assert {d.num_decode_tokens for d in decodes} == {4, 2, 1}
    assert all(d.context_tokens > 48 * d.num_decode_tokens for d in decodes)
    mixed = [s.shape for s in samples if step_kind(s) == "mixed"]
    # when the batch halves, a 48-token prompt joins the remaining decodes for one step
    assert [(m.num_prefill_tokens, m.num_decode_tokens) for m in mixed] == [(48, 2), (48, 1)]
    for s in samples:
        assert s.forward_time_s is not None and 0 < s.forward_time_s <= s.step_time_s
    over = overhead_summary(samples)
    assert over is not None and over.n == len(samples) and 0 <= over.share < 1


def test_recorder_restores_the_observer_and_profile_checks_the_engine(tiny_engine):
    _, engine = tiny_engine
    with StepRecorder(engine) as rec:
        assert engine.step_observer is not None
        rec.step()  # nothing to run: no sample
    assert engine.step_observer is None and rec.samples == []
    with pytest.raises(ValueError, match="raise max_num_seqs"):
        profile_engine(engine, ProfileSpec.sized(8, 48))
    with pytest.raises(ValueError, match="context window"):
        profile_engine(engine, ProfileSpec.sized(4, 4096))


def test_calibrate_engine_command(tiny_engine, tmp_path, capsys):
    path, _ = tiny_engine
    prof, cost = tmp_path / "profile.json", tmp_path / "cost.json"
    argv = ["simulate", "--calibrate-engine", "--model", str(path), "--profile-out", str(prof),
            "--profile-max-batch", "2", "--profile-max-prefill", "32", "--num-threads", "1", "--dtype", "float32",
            "--save-cost-model", str(cost)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "R²" in out and "relative error" in out and "engine overhead" in out
    doc = json.loads(prof.read_text())
    assert doc["meta"]["threads"] == 1 and doc["meta"]["dtype"] == "float32"
    samples = load_profile(prof)
    assert samples and all(s.forward_time_s is not None for s in samples)
    assert load_cost_model(cost).fit["n"] == len(samples)
    # the profile then drives a simulation
    assert main(["simulate", "--model", "smollm2-135m", "--calibrate", str(prof), "--num-blocks", "64",
                 "--input-len", "16", "--output-len", "4", "--concurrency", "2", "--num-prompts", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["simulation"]["cost_model"] == "LinearCost"


def test_calibrate_engine_needs_a_profile_path(capsys):
    assert main(["simulate", "--calibrate-engine"]) == 2
    assert "--profile-out" in capsys.readouterr().err


# ------------------------------------------------------------------ the roofline's compute precision


def test_auto_compute_precision_follows_the_measured_cpu():
    no_bf16 = HardwareSpec("cpu", 1e10, 2e10, {"bf16": 2e8, "fp32": 2e10}, kind="measured", source="test")
    assert auto_compute_precision(no_bf16) == "fp32"
    native = HardwareSpec("cpu", 1e10, 2e10, {"bf16": 4e10, "fp32": 2e10}, kind="measured", source="test")
    assert auto_compute_precision(native) == "bf16"
    sheet = HardwareSpec("gpu", 1e10, 2e10, {"bf16": 1e12, "fp32": 2e12}, kind="cited", source="test")
    assert auto_compute_precision(sheet) == "bf16"


def test_plan_compute_dtype_flag(tmp_path, capsys):
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps(HardwareSpec("this cpu", 16e9, 20e9, {"bf16": 2e8, "fp32": 2e10},
                                          kind="measured", source="test").to_dict()))
    base = ["plan", "--model", "smollm2-135m", "--hardware-file", str(hw), "--input-len", "128", "--output-len", "8",
            "--json"]

    def ttft(extra):
        assert main(base + extra) == 0
        figs = {f["name"]: f["value"] for f in json.loads(capsys.readouterr().out)["plan"]["figures"]}
        return figs["ttft"]

    auto, fp32, bf16 = ttft([]), ttft(["--compute-dtype", "fp32"]), ttft(["--compute-dtype", "bf16"])
    assert auto == fp32
    assert bf16 == pytest.approx(fp32 * 100, rel=0.05)  # compute-bound prefill at 1/100 the rate


def test_roofline_efficiencies_make_the_roofline_match_the_fit():
    from inferlab.plan.cost_model import roofline_efficiencies
    from inferlab.plan.model_spec import builtin_model
    from inferlab.plan.roofline import Roofline

    hw = HardwareSpec("cpu", 16e9, 20e9, {"fp32": 50e9}, kind="measured", source="test")
    model = builtin_model("smollm2-135m")
    peak = Roofline(model, hw, "fp32", "fp32", compute_precision="fp32")
    cost = LinearCost(0.0, 8e-3, 3e-3, 0.0, single_token_step_s=0.06 - 3e-3)  # a 60 ms lone decode
    mem, comp = roofline_efficiencies(cost, peak, context=128)
    assert 0 < mem < 1 and 0 < comp < 1
    tuned = Roofline(model, hw, "fp32", "fp32", compute_precision="fp32", memory_efficiency=mem,
                     compute_efficiency=comp)
    assert tuned.decode_step(1, 128).time_s == pytest.approx(0.06, rel=1e-6)
    assert tuned.matmul_flops_per_token / tuned.effective_compute == pytest.approx(8e-3, rel=1e-6)
    faster_than_peak = LinearCost(0.0, 1e-3, 3e-3, 0.0, single_token_step_s=0.01)
    assert roofline_efficiencies(faster_than_peak, peak, context=128)[1] == 1.0
