"""The simulator drives the real Scheduler: hand-computable timings with a constant step cost,
the roofline's own numbers for one request, preemption when blocks are scarce, and a report
the bench's own validator accepts."""

from __future__ import annotations

import math

import pytest

from inferlab.bench.arrivals import LoadSpec, arrival_offsets
from inferlab.bench.metrics import summarize
from inferlab.bench.report import validate_report
from inferlab.config import CacheConfig, SchedulerConfig
from inferlab.plan.compare import load_bench_runs
from inferlab.plan.cost_model import ConstantCost, RooflineCost
from inferlab.plan.hardware import builtin_hardware
from inferlab.plan.model_spec import builtin_model
from inferlab.plan.roofline import Roofline
from inferlab.plan.sim_report import simulation_report
from inferlab.plan.simulator import SimWorkload, simulate

STEP = 0.010


def run(num_prompts=4, input_len=8, output_len=4, *, max_concurrency=None, request_rate=math.inf,
        max_num_seqs=8, budget=64, block_size=4, num_blocks=100, cost=None, **wl):
    workload = SimWorkload(num_prompts=num_prompts, input_len=input_len, output_len=output_len,
                           max_concurrency=max_concurrency, request_rate=request_rate, **wl)
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                            max_model_len=input_len + output_len)
    cache = CacheConfig(block_size=block_size)
    return workload, simulate(workload, sched, cache, num_blocks, cost or ConstantCost(STEP))


def test_closed_loop_constant_cost_by_hand():
    # 2 clients, 4 requests of 8 + 4 tokens, every step 10 ms. Clients 1 and 2 send at 0: one
    # prefill step (first tokens at 10 ms), three decode steps (done at 40 ms); the next two
    # are sent at 40 ms and finish at 80 ms.
    wl, res = run(max_concurrency=2)
    assert [t.send_time for t in res.traces] == [0.0, 0.0, pytest.approx(0.04), pytest.approx(0.04)]
    for t in res.traces:
        assert t.token_times == pytest.approx([t.send_time + STEP * k for k in (1, 2, 3, 4)])
        assert t.finish_reason == "length"
    s = summarize(res.records(), res.duration_s, max_concurrency=2)
    assert res.duration_s == pytest.approx(0.08)
    assert s.latency["ttft"].mean == pytest.approx(10.0)
    assert s.latency["tpot"].mean == pytest.approx(10.0)
    assert s.latency["e2el"].mean == pytest.approx(40.0)
    assert s.output_throughput == pytest.approx(16 / 0.08)
    assert s.completed == 4 and s.total_output_tokens == 16
    assert len(res.steps) == 8


def test_queueing_in_the_engine_counts_in_ttft():
    # Everything sent at 0, but only 2 sequences may run: the last two wait 40 ms for a place.
    _, res = run(max_num_seqs=2)
    ttfts = [t.token_times[0] - t.send_time for t in res.traces]
    assert ttfts == pytest.approx([0.01, 0.01, 0.05, 0.05])
    s = summarize(res.records(), res.duration_s)
    assert s.latency["ttft"].mean == pytest.approx(30.0)
    assert s.latency["e2el"].mean == pytest.approx((40 + 40 + 80 + 80) / 4)


def test_chunked_prefill_takes_steps():
    # A 40-token prompt under a 16-token budget: chunks of 16, 16, 8 → first token after 3 steps.
    _, res = run(num_prompts=1, input_len=40, output_len=2, budget=16, num_blocks=20)
    t = res.traces[0]
    assert t.token_times == pytest.approx([0.03, 0.04])
    assert [s.num_prefill_tokens for s in res.steps] == [16, 16, 8, 0]
    assert [s.num_decode_tokens for s in res.steps] == [0, 0, 0, 1]


def test_preemption_when_blocks_are_scarce():
    # Two requests of 8 + 8 tokens need 4 blocks of 4 each; 6 blocks hold both prompts but not
    # both replies, so the newer request is preempted (recomputed later) and both still finish.
    _, res = run(num_prompts=2, input_len=8, output_len=8, num_blocks=6)
    assert res.num_preemptions >= 1
    assert any(t.num_preemptions >= 1 for t in res.traces)
    assert all(len(t.token_times) == 8 and t.finish_reason == "length" for t in res.traces)
    assert any(s.num_preempted for s in res.steps)
    # ... and none with room for both
    _, roomy = run(num_prompts=2, input_len=8, output_len=8, num_blocks=8)
    assert roomy.num_preemptions == 0
    # preemption costs time: recomputation makes the run longer
    assert res.duration_s > roomy.duration_s


def test_a_request_larger_than_the_cache_is_a_value_error():
    with pytest.raises(ValueError, match="needs 3 KV blocks; the cache has 2"):
        run(num_prompts=1, input_len=8, output_len=4, num_blocks=2)


def test_poisson_releases_follow_the_bench_schedule():
    wl, res = run(num_prompts=6, request_rate=5.0, seed=3)
    expected = arrival_offsets(6, LoadSpec(5.0), 3)
    assert [t.send_time for t in res.traces] == pytest.approx(list(expected))
    assert all(t.token_times[0] > t.send_time for t in res.traces)


def test_eos_probability_shortens_replies_and_default_never_stops():
    _, res = run(num_prompts=20, output_len=30, num_blocks=400, eos_probability=0.3)
    assert any(t.finish_reason == "stop" and len(t.token_times) < 30 for t in res.traces)
    _, res = run(num_prompts=5, output_len=30, num_blocks=400)
    assert all(len(t.token_times) == 30 for t in res.traces)


def test_shared_prefix_hits_the_prefix_cache():
    _, res = run(num_prompts=3, input_len=16, output_len=2, max_concurrency=1, shared_prefix_len=12)
    assert res.traces[0].num_cached_tokens == 0
    assert all(t.num_cached_tokens == 12 for t in res.traces[1:])  # 3 full blocks of 4


def test_roofline_cost_for_one_request_matches_the_plan_by_hand():
    model, hw = builtin_model("llama-3.1-8b"), builtin_hardware("h100")
    rf = Roofline(model, hw)
    P, O = 512, 6
    _, res = run(num_prompts=1, input_len=P, output_len=O, budget=4096, block_size=16, num_blocks=1000,
                 cost=RooflineCost(rf), vocab_size=model.vocab_size)
    t = res.traces[0]
    assert t.token_times[0] == pytest.approx(rf.prefill(P).time_s)
    # decode step j computes position P + j − 1 and reads P + j tokens of K/V
    expected = rf.prefill(P).time_s + sum(rf.decode_step(1, P + j).time_s for j in range(1, O))
    assert t.end_time == pytest.approx(expected)


def test_report_has_the_bench_schema_and_compares(tmp_path):
    wl, res = run(max_concurrency=2)
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=12)
    doc = simulation_report(res, wl, sched, CacheConfig(block_size=4), ConstantCost(STEP), model_name="toy",
                            usd_per_hour=1.0)
    validate_report(doc)
    assert doc["schema"] == "inferlab.bench/1"
    summary = doc["runs"][0]["summary"]
    assert summary["mean_ttft_ms"] == pytest.approx(10.0)
    assert summary["output_throughput"] == pytest.approx(200.0)
    assert doc["runs"][0]["requests"]["output_tokens"] == [4, 4, 4, 4]
    assert doc["simulation"]["kind"] == "simulated"
    assert any("10 ms" in a for a in doc["simulation"]["assumptions"])
    gauges = doc["runs"][0]["server_metrics"]["gauges"]
    assert gauges["running"]["max"] == 2
    import json

    path = tmp_path / "sim.json"
    path.write_text(json.dumps(doc, default=str))
    (brun,) = load_bench_runs(path)
    assert brun.kind == "simulated" and brun.max_concurrency == 2 and brun.input_len == 8


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_prompts=0), "num-prompts"),
    (dict(shared_prefix_len=99), "shared prefix"),
    (dict(eos_probability=1.0), "EOS probability"),
    (dict(max_concurrency=0), "max-concurrency"),
])
def test_bad_workloads(kwargs, message):
    base = dict(num_prompts=1, input_len=8, output_len=4)
    base.update(kwargs)
    with pytest.raises(ValueError, match=message):
        SimWorkload(**base)


def test_request_latency_keeps_a_replacement_out_of_the_running_step():
    # 2 clients, 3 requests of 8 + 4 tokens, an 8-token budget, 10 ms steps. r0 prefills in step 1,
    # r1's prompt is chunked 7 + 1 behind r0's decodes, so r0 finishes after 4 steps and r1 after 6.
    # r2 is sent when r0 finishes. With no latency it joins step 5 at once: chunks 7 + 1 ->
    # first token 2 steps after it was sent. A real server has started step 5 before r2 arrives:
    # with 1 ms, r2 waits for step 6 -> first token 3 steps after it was sent. (With 1 ms every
    # time also moves by 1 ms: the first requests reach the idle engine at 1 ms.)
    kw = dict(num_prompts=3, max_concurrency=2, budget=8)
    _, now = run(**kw)
    _, late = run(**kw, request_latency_s=0.001)
    for res, d in ((now, 0.0), (late, 0.001)):
        assert res.traces[0].end_time == pytest.approx(d + 0.04)
        assert res.traces[1].end_time == pytest.approx(d + 0.06)
        assert res.traces[2].send_time == pytest.approx(d + 0.04)
    assert now.traces[2].token_times == pytest.approx([0.06, 0.07, 0.08, 0.09])
    assert late.traces[2].token_times == pytest.approx([0.071, 0.081, 0.091, 0.101])
    # an idle engine starts as soon as the request arrives: TTFT = latency + one step
    _, one = run(num_prompts=1, request_latency_s=0.001)
    assert one.traces[0].token_times[0] - one.traces[0].send_time == pytest.approx(0.011)
    with pytest.raises(ValueError, match="request latency"):
        run(request_latency_s=-1.0)
