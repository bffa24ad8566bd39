"""`inferlab simulate --disaggregate P:D`: prefill and decode pools with each request's K/V sent
over a link, against P + D colocated replicas. Hand-computable cases: the transfer adds exactly
its time to TTFT, one link sends one request at a time, and decode steps carry no prompt chunks
(so ITL no longer jumps when a long prompt arrives)."""

from __future__ import annotations

import math

import pytest

from inferlab.cli import main
from inferlab.config import CacheConfig, SchedulerConfig
from inferlab.engine.request import Request, SamplingParams
from inferlab.engine.scheduler import Scheduler
from inferlab.plan.cost_model import ConstantCost, LinearCost
from inferlab.plan.fleet_sim import Disaggregation, KVLink, comparison_row, simulate_fleet
from inferlab.plan.simulator import SimWorkload

STEP = 0.010
SCHED = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=2100)


def fleet(wl, cost, num_blocks=400, dis=None, replicas=2):
    return simulate_fleet(wl, SCHED, CacheConfig(block_size=16), num_blocks, cost, replicas=replicas,
                          policy="least-load", disaggregation=dis)  # fmt: skip


def ttft(t):
    return t.token_times[0] - t.send_time


def test_the_transfer_adds_exactly_its_time_to_ttft():
    wl = SimWorkload(num_prompts=1, input_len=100, output_len=5, vocab_size=5000)
    # 100 tokens × 1,000 bytes = 1e5 bytes at 8 Gbit/s (1e9 bytes/s) = 0.1 ms, + 2 ms latency.
    dis = Disaggregation(1, 1, KVLink(8.0, latency_s=0.002), kv_bytes_per_token=1000.0)
    colo, dis_r = fleet(wl, ConstantCost(STEP)), fleet(wl, ConstantCost(STEP), dis=dis)
    c, d = colo.traces[0], dis_r.traces[0]
    assert ttft(c) == pytest.approx(STEP)
    assert ttft(d) == pytest.approx(STEP + 0.0021, abs=1e-12)
    assert dis_r.kv_transfer_s == [pytest.approx(0.0021, abs=1e-12)]
    gaps = [b - a for a, b in zip(d.token_times, d.token_times[1:])]
    assert gaps == pytest.approx([STEP] * 4)  # decode steps only, as colocated
    assert len(d.token_times) == 5 and d.end_time - c.end_time == pytest.approx(0.0021, abs=1e-12)
    assert dis_r.per_replica == {"prefill-0": 1, "decode-0": 1}


def test_one_link_sends_one_request_at_a_time():
    wl = SimWorkload(num_prompts=2, input_len=100, output_len=3, vocab_size=5000)
    # 3e7 bytes per request at 1e9 bytes/s: 30 ms each. One prefill replica: the first prompt's
    # step ends at 10 ms (the second arrived during it), the second's at 20 ms; the second
    # transfer waits for the first: link busy 10-40 then 40-70 ms, each + 1 ms latency.
    one = Disaggregation(1, 1, KVLink(8.0, latency_s=0.001), kv_bytes_per_token=3e5)
    r = fleet(wl, ConstantCost(STEP), dis=one)
    assert [ttft(t) for t in r.traces] == pytest.approx([0.041, 0.071])
    assert r.kv_transfer_s == pytest.approx([0.031, 0.051])  # 20 ms of it queueing for the link
    two = fleet(wl, ConstantCost(STEP), dis=Disaggregation(2, 1, one.link, one.kv_bytes_per_token))
    assert [ttft(t) for t in two.traces] == pytest.approx([0.041, 0.041])  # a replica and a link each


def test_decode_steps_carry_no_prompt_chunks():
    # 2 ms a step + 50 µs per prompt token + 0.2 ms per decode token: a 512-token prompt chunk
    # in a step holds every decoding sequence's next token for 25.6 ms more.
    cost = LinearCost(intercept_s=0.002, per_prefill_token_s=50e-6, per_decode_token_s=2e-4, per_context_token_s=0.0)
    wl = SimWorkload(num_prompts=40, input_len=2000, output_len=32, request_rate=20.0, vocab_size=5000, seed=1)
    colo = fleet(wl, cost)
    dis = fleet(wl, cost, dis=Disaggregation(1, 1, KVLink(400.0), kv_bytes_per_token=1000.0))
    itl = [b - a for t in dis.traces for a, b in zip(t.token_times[1:], t.token_times[2:])]
    assert max(itl) <= 0.002 + 2e-4 * SCHED.max_num_seqs + 1e-12  # never more than a full decode step
    colo_itl = [b - a for t in colo.traces for a, b in zip(t.token_times, t.token_times[1:])]
    assert max(colo_itl) >= 0.002 + 512 * 50e-6  # colocated: some token waited for a prompt chunk
    rc, rd = comparison_row(colo, None, 2.0), comparison_row(dis, None, 2.0)
    assert rd["p99_itl_ms"] < rc["p99_itl_ms"] / 3
    assert rc["usd_per_hour"] == rd["usd_per_hour"] == 4.0  # same GPUs, same bill
    assert all(len(t.token_times) == 32 for t in dis.traces)


def test_a_decode_pool_short_of_memory_preempts_and_still_finishes_every_reply():
    wl = SimWorkload(num_prompts=12, input_len=200, output_len=40, vocab_size=5000)
    # 30 blocks of 16 = 480 tokens: two 240-token sequences at most per decode replica.
    r = fleet(wl, ConstantCost(STEP), num_blocks=30,
              dis=Disaggregation(2, 1, KVLink(100.0), kv_bytes_per_token=1000.0))  # fmt: skip
    assert all(len(t.token_times) == 40 and t.finish_reason == "length" for t in r.traces)
    assert r.per_replica["decode-0"] == 12


def test_add_computed_request_admits_a_decode_or_changes_nothing():
    sched = Scheduler(SCHED, CacheConfig(block_size=16), num_blocks=8, clock=lambda: 1.5)
    req = Request("r", list(range(1, 101)), SamplingParams(max_tokens=4, temperature=0.0), output_token_ids=[7])
    assert sched.add_computed_request(req, 100)  # 7 blocks for 100 tokens
    so = sched.schedule()
    [s] = so.scheduled
    assert (s.start_pos, s.token_ids, s.sample) == (100, [7], True)  # a decode, not a prefill
    big = Request("b", list(range(1, 101)), SamplingParams(max_tokens=4), output_token_ids=[7])
    free = sched.kv_cache_manager.num_free_blocks
    assert not sched.add_computed_request(big, 100)  # one block left
    assert sched.kv_cache_manager.num_free_blocks == free and "b" not in sched.requests
    assert big.num_computed_tokens == 0
    with pytest.raises(ValueError, match="computed tokens"):
        sched.add_computed_request(Request("c", [1, 2], SamplingParams(), output_token_ids=[3]), 3)


def cli(*extra):
    return ["simulate", "--model", "llama-3.1-8b", "--hardware", "h100", "--num-blocks", "400", "--input-len", "300",
            "--output-len", "8", "--num-prompts", "30", "--request-rate", "50", *extra]  # fmt: skip


def test_cli_prints_colocated_and_disaggregated_rows(capsys):
    assert main(cli("--disaggregate", "2:1", "--kv-transfer-gbps", "100", "--goodput", "ttft:500",
                    "--usd-per-hour", "3")) == 0  # fmt: skip
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if line.startswith(("3 colocated", "2P:1D"))]
    assert rows == ["3", "2P:1D"]
    assert "131,072 bytes/token" in out and "9.00" in out  # Llama-3.1-8B's K/V in bf16; 3 GPUs × $3


@pytest.mark.parametrize("extra, message", [
    (("--disaggregate", "3"), "P:D"),
    (("--disaggregate", "0:2", "--kv-transfer-gbps", "10"), "P >= 1"),
    (("--disaggregate", "2:2"), "--kv-transfer-gbps"),
    (("--disaggregate", "2:2", "--kv-transfer-gbps", "0"), "--kv-transfer-gbps"),
    (("--kv-transfer-gbps", "10"), "--disaggregate"),
    (("--disaggregate", "2:2", "--kv-transfer-gbps", "10", "--replicas", "3"), "P + D"),
])  # fmt: skip
def test_cli_bad_input_is_one_line(capsys, extra, message):
    assert main(cli(*extra)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_link_rejects_nonsense():
    with pytest.raises(ValueError):
        KVLink(math.inf)
    with pytest.raises(ValueError):
        KVLink(10.0, latency_s=-1.0)
