"""Sweep logic without a server: which levels run, when saturation stops them, DistServe goodput."""

from __future__ import annotations

import asyncio

import pytest

from inferlab.bench.arrivals import LoadSpec
from inferlab.bench.metrics import RunSummary, parse_numbers
from inferlab.bench.runner import RunResult
from inferlab.bench.server_metrics import ServerMetricsSample, parse_metrics, summarize_samples
from inferlab.bench.sweep import SaturationRule, SweepPlan, parse_sweep, run_sweep


def summary(out_tps: float, errored: int = 0, attainment: float | None = None, n: int = 100) -> RunSummary:
    return RunSummary(
        num_requests=n, completed=n - errored, failed=errored, incomplete=0, timeout=0, duration_s=1.0,
        total_input_tokens=0, total_output_tokens=int(out_tps), request_throughput=0.0, output_throughput=out_tps,
        total_token_throughput=out_tps, latency={}, slo_attainment=attainment,
    )


def fake_levels(throughput, attainment=lambda level: None, errors=lambda level: 0, kind="concurrency"):
    """A run_level whose results are functions of the level; records the loads it was given."""
    seen: list[LoadSpec] = []

    async def run_level(k: int, load: LoadSpec):
        seen.append(load)
        level = load.request_rate if kind == "rate" else load.max_concurrency
        res = RunResult(load=load, records=[], duration_s=1.0, start_time=0.0)
        return res, summary(throughput(level), errors(level), attainment(level))

    return run_level, seen


def test_automatic_sweep_doubles_until_throughput_stops_growing():
    run_level, seen = fake_levels(lambda c: min(c * 100.0, 400.0))
    out = asyncio.run(run_sweep(SweepPlan("concurrency"), LoadSpec(), run_level))
    assert [p.level for p in out.points] == [1, 2, 4, 8]  # 8 gives no more than 4 did
    assert [load.max_concurrency for load in seen] == [1, 2, 4, 8]
    assert out.saturated_at == 8 and out.stopped_early
    assert "grew less than 10%" in out.stop_reason


def test_rate_sweep_stops_on_errors_and_keeps_other_knobs():
    run_level, seen = fake_levels(lambda r: r * 100.0, errors=lambda r: 20 if r >= 4 else 0, kind="rate")
    out = asyncio.run(run_sweep(SweepPlan("rate"), LoadSpec(burstiness=0.5, max_concurrency=64), run_level))
    assert [p.level for p in out.points] == [1, 2, 4]
    assert "20 of 100 requests did not complete" == out.stop_reason
    assert all(load.burstiness == 0.5 and load.max_concurrency == 64 for load in seen)


def test_slo_failure_saturates_and_distserve_goodput_is_reported():
    run_level, _ = fake_levels(lambda r: r * 100.0, attainment=lambda r: 1.0 if r <= 2 else 0.5, kind="rate")
    out = asyncio.run(run_sweep(SweepPlan("rate"), LoadSpec(), run_level, SaturationRule(slo_target=0.9)))
    assert out.saturated_at == 4
    assert out.distserve_goodput == 2
    assert out.to_dict()["distserve_goodput"] == 2


def test_explicit_levels_all_run_and_saturation_is_still_noted():
    run_level, _ = fake_levels(lambda c: min(c * 100.0, 200.0))
    out = asyncio.run(run_sweep(parse_sweep("concurrency:1,2,4,32"), LoadSpec(), run_level))
    assert [p.level for p in out.points] == [1, 2, 4, 32]
    assert out.saturated_at == 4 and not out.stopped_early


def test_automatic_sweep_has_a_step_limit():
    run_level, _ = fake_levels(lambda c: c * 100.0)
    out = asyncio.run(run_sweep(SweepPlan("concurrency", max_steps=3), LoadSpec(), run_level))
    assert [p.level for p in out.points] == [1, 2, 4] and out.saturated_at is None


def test_parse_sweep_and_levels():
    assert parse_sweep("rate") == SweepPlan("rate")
    assert parse_sweep("rate:0.5,1,2").levels == (0.5, 1.0, 2.0)
    assert parse_numbers("1,32", "--concurrency-levels", integer=True) == (1.0, 32.0)
    for bad in ("speed:1", "concurrency:1.5", "rate:0", "rate:x"):
        with pytest.raises(ValueError, match="--sweep"):
            parse_sweep(bad)


def test_parse_prometheus_metrics_vllm_and_llamacpp_names():
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 40\n'
        "# TYPE llamacpp:requests_deferred gauge\n"
        "llamacpp:requests_deferred 4\n"
        "# TYPE unrelated gauge\nunrelated 9\n"
    )
    assert parse_metrics(text) == {"running": 5.0, "kv_cache_usage": 0.25, "prefix_cache_hits": 40.0, "waiting": 4.0}


def test_spec_decode_counters_give_the_acceptance_figures():
    def text(drafts, tokens, accepted, per_pos):
        lines = ["# TYPE vllm:spec_decode_num_drafts counter", f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {drafts}',
                 "# TYPE vllm:spec_decode_num_draft_tokens counter", f"vllm:spec_decode_num_draft_tokens_total {tokens}",
                 "# TYPE vllm:spec_decode_num_accepted_tokens counter", f"vllm:spec_decode_num_accepted_tokens_total {accepted}",
                 "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter"]
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{j}"}} {n}' for j, n in enumerate(per_pos)]
        return "\n".join(lines) + "\n"

    before = parse_metrics(text(10, 30, 5, [4, 1, 0]))
    assert before["spec_accepted_pos_1"] == 1.0 and before["spec_drafts"] == 10.0
    after = parse_metrics(text(60, 180, 95, [44, 31, 20]))
    s = summarize_samples([ServerMetricsSample(0.0, before), ServerMetricsSample(1.0, after)])
    spec = s.to_dict()["speculative"]
    assert spec["acceptance_rate"] == pytest.approx(90 / 150)
    assert spec["mean_acceptance_length"] == pytest.approx(1 + 90 / 50)
    assert spec["acceptance_per_position"] == pytest.approx([40 / 50, 30 / 50, 20 / 50])
    assert summarize_samples([ServerMetricsSample(0.0, {"running": 1})]).speculative is None


def test_server_metric_samples_summarize_to_mean_max_and_deltas():
    samples = [
        ServerMetricsSample(0.0, {"running": 2, "waiting": 0, "prefix_cache_queries": 100, "prefix_cache_hits": 10}),
        ServerMetricsSample(0.5, {"running": 4, "waiting": 6, "prefix_cache_queries": 300, "prefix_cache_hits": 110}),
    ]
    s = summarize_samples(samples)
    assert s.gauges["running"] == {"mean": 3.0, "max": 4}
    assert s.gauges["waiting"] == {"mean": 3.0, "max": 6}
    assert s.counter_deltas == {"prefix_cache_queries": 200, "prefix_cache_hits": 100}
    assert s.prefix_cache_hit_rate == pytest.approx(0.5)
    assert not summarize_samples([]).available
