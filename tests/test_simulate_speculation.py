"""`inferlab simulate` with speculative decoding: the real scheduler and its rule, drafts right
with the given acceptance per position, verified as the engine verifies; the bench's
acceptance figures in the report; bad flags as one line."""

from __future__ import annotations

import pytest

from inferlab.bench.report import validate_report
from inferlab.cli import main
from inferlab.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from inferlab.plan.cost_model import ConstantCost, LinearCost
from inferlab.plan.sim_report import simulation_report
from inferlab.plan.sim_speculation import startup_step_cost
from inferlab.plan.simulator import SimWorkload, simulate

ALWAYS = SpeculativeConfig("ngram", 4, 4, 2, adaptive=False)


def run(acceptance, num_prompts=1, output_len=11, spec=ALWAYS, cost=None, concurrency=None):
    workload = SimWorkload(num_prompts=num_prompts, input_len=8, output_len=output_len, max_concurrency=concurrency)
    sched = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=256, max_model_len=8 + output_len)
    return workload, simulate(workload, sched, CacheConfig(block_size=4), 2000, cost or ConstantCost(0.010),
                              speculative_config=spec, acceptance=acceptance)


def test_drafts_always_right_make_steps_of_k_plus_one_tokens_by_hand():
    # The prefill's step yields the first token (10 ms); then two steps verify 4 drafts each and
    # yield 5 tokens each: 11 tokens at 10, 20, 30 ms, streamed as chunks of 1, 5 and 5.
    _, res = run((1.0,))
    t = res.traces[0]
    assert t.token_times == pytest.approx([0.01] + [0.02] * 5 + [0.03] * 5)
    assert t.to_record().chunk_tokens == [1, 5, 5]
    assert (res.spec.num_drafts, res.spec.num_draft_tokens, res.spec.num_accepted_tokens) == (2, 8, 8)


def test_drafts_never_right_cost_a_step_per_token():
    _, res = run((0.0,))
    assert len(res.traces[0].token_times) == 11 and len(res.steps) == 11
    assert res.spec.num_accepted_tokens == 0 and res.spec.num_drafts == 9  # the last token has no room for drafts


def test_acceptance_per_position_is_the_one_given():
    _, res = run((0.8, 0.5), num_prompts=40, output_len=60)
    drafts, pos = res.spec.num_drafts, res.spec.accepted_per_pos
    assert pos[0] / drafts == pytest.approx(0.8, abs=0.05)
    assert pos[1] / pos[0] == pytest.approx(0.5, abs=0.06) and pos[2] / pos[1] == pytest.approx(0.5, abs=0.08)


def test_the_engine_rule_drafts_at_one_stream_and_not_at_32_when_rows_are_dear():
    # A CPU-like step: 20 ms plus 2 ms a row. Drafts kept half the time pay at one stream (a row
    # is a tenth of the step) and not at 32 (a row costs about what it may save).
    cost = LinearCost(intercept_s=0.020, per_prefill_token_s=0.0005, per_decode_token_s=0.002, per_context_token_s=0.0)
    adaptive = SpeculativeConfig("ngram", 4, 4, 2)
    _, one = run((0.5,), num_prompts=2, output_len=64, spec=adaptive, cost=cost, concurrency=1)
    _, many = run((0.5,), num_prompts=32, output_len=64, spec=adaptive, cost=cost, concurrency=32)
    assert one.spec.num_drafts > 50
    assert many.spec.num_drafts < 0.02 * sum(len(t.token_times) for t in many.traces)


def test_the_rule_starts_from_the_cost_models_step_cost():
    # A GPU-like step: 20 ms plus 0.2 ms a row (b / a = 1/100). The engine would measure that at
    # start-up; read off the cost model, drafts kept half the time pay at 32 streams too. With the
    # rule's prior (a row at 1/16 of the step) they looked as dear as the tokens they may save.
    cost = LinearCost(intercept_s=0.020, per_prefill_token_s=0.0005, per_decode_token_s=0.0002, per_context_token_s=0.0)
    assert startup_step_cost(cost, 40, 32) == pytest.approx((0.020, 0.0002))
    assert startup_step_cost(ConstantCost(0.010), 40, 32) is None  # no slope: the rule keeps its prior
    adaptive = SpeculativeConfig("ngram", 4, 4, 2)
    _, many = run((0.5,), num_prompts=32, output_len=64, spec=adaptive, cost=cost, concurrency=32)
    assert many.spec.num_drafts > 0.3 * sum(len(t.token_times) for t in many.traces)


def test_the_report_carries_the_bench_acceptance_figures():
    workload, res = run((1.0,))
    sched = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=256, max_model_len=19)
    doc = simulation_report(res, workload, sched, CacheConfig(block_size=4), ConstantCost(0.010),
                            model_name="m", speculation="speculative decoding (test)")
    validate_report(doc)
    spec = doc["runs"][0]["server_metrics"]["speculative"]
    assert spec["acceptance_rate"] == 1.0 and spec["mean_acceptance_length"] == 5.0
    assert spec["acceptance_per_position"] == [1.0] * 4
    assert "speculative decoding (test)" in doc["simulation"]["assumptions"]


def cli(*extra):
    return ["simulate", "--model", "llama-3.1-8b", "--hardware", "h100", "--num-blocks", "400", "--input-len", "64",
            "--output-len", "32", "--num-prompts", "4", "--concurrency", "1", *extra]  # fmt: skip


def test_cli_prints_the_acceptance(capsys):
    assert main(cli("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}',
                    "--spec-acceptance", "0.9")) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "spec decode mean acceptance length" in out and "speculative decoding (ngram, K = 4" in out


@pytest.mark.parametrize("extra, message", [
    (("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'), "--spec-acceptance"),
    (("--spec-acceptance", "0.5"), "needs --speculative-config"),
    (("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}', "--spec-acceptance", "1.5"),
     "[0, 1]"),
    (("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}', "--spec-acceptance", "x"),
     "numbers"),
    (("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}', "--spec-acceptance", "0.5",
      "--replicas", "2"), "one replica"),
    (("--speculative-config", '{"method": "magic", "num_speculative_tokens": 4}', "--spec-acceptance", "0.5"), "magic"),
])  # fmt: skip
def test_cli_bad_input_is_one_line(capsys, extra, message):
    assert main(cli(*extra)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
