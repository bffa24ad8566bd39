"""`inferlab simulate --replicas N --router POLICY`: the router's own core over simulated
replicas (the real scheduler and prefix cache each, KV events into the router's index).
Cache-aware keeps K system prompts where they are cached, round-robin and least-load scatter
them; the router's predicted cached tokens equal the replicas' when nothing is evicted."""

from __future__ import annotations

import math

import pytest

from inferlab.cli import main
from inferlab.config import CacheConfig, SchedulerConfig
from inferlab.plan.cost_model import LinearCost
from inferlab.plan.fleet_sim import simulate_fleet
from inferlab.plan.simulator import SimWorkload

# 2 ms a step + 50 µs per prefill token + 0.2 ms per decode token: prefill is what costs.
COST = LinearCost(intercept_s=0.002, per_prefill_token_s=50e-6, per_decode_token_s=2e-4, per_context_token_s=0.0)


def run(policy: str, *, replicas: int = 4, prefixes: int = 8, num_blocks: int = 200, prompts: int = 160,
        rate: float = math.inf, concurrency: int | None = 8, kv_poll_s: float = 0.05):  # fmt: skip
    wl = SimWorkload(num_prompts=prompts, input_len=300, output_len=8, shared_prefix_len=256, vocab_size=5000,
                     request_rate=rate, max_concurrency=concurrency, seed=3, request_latency_s=0.001)  # fmt: skip
    sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=308)
    return simulate_fleet(wl, sched, CacheConfig(block_size=16), num_blocks, COST, replicas=replicas, policy=policy,
                          num_shared_prefixes=prefixes, kv_poll_s=kv_poll_s)  # fmt: skip


def test_cache_aware_beats_round_robin_and_least_load_on_shared_prompts():
    # 8 system prompts of 16 blocks, 4 replicas of 60 blocks: each replica can keep ~3 of them.
    res = {p: run(p, num_blocks=60).summary() for p in ("cache-aware", "round-robin", "least-load")}
    ca, rr, ll = res["cache-aware"], res["round-robin"], res["least-load"]
    assert ca["cached_token_share"] > rr["cached_token_share"] + 0.15
    assert ca["cached_token_share"] > ll["cached_token_share"] + 0.15
    assert ca["ttft_p50_ms"] < rr["ttft_p50_ms"] and ca["ttft_p50_ms"] < ll["ttft_p50_ms"]
    assert all(r["requests"] == 160 for r in res.values())


def test_predicted_cached_tokens_equal_the_replicas_without_evictions():
    r = run("cache-aware", num_blocks=2000, concurrency=1)  # one at a time: each sees the last one's blocks
    s = r.summary()
    assert s["predicted_cached_token_share"] == pytest.approx(s["cached_token_share"])
    assert s["cached_token_share"] > 0.7


def test_sixteen_replicas_and_every_policy_finish():
    for policy in ("cache-aware", "least-load", "round-robin", "session"):
        r = run(policy, replicas=16, prefixes=16, prompts=200, concurrency=32)
        assert len(r.traces) == 200 and sum(r.per_replica.values()) == 200
        assert all(t.finish_reason == "length" for t in r.traces)
    rr = run("round-robin", replicas=16, prompts=64)
    assert set(rr.per_replica.values()) == {4}  # exactly in turn


def test_cli_prints_a_row_per_policy(capsys):
    argv = ["simulate", "--model", "llama-3.1-8b", "--hardware", "h100", "--num-blocks", "400", "--input-len", "300",
            "--output-len", "8", "--num-prompts", "40", "--concurrency", "8", "--replicas", "3", "--shared-prefixes",
            "4", "--shared-prefix-len", "256", "--router", "cache-aware,round-robin"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "3 replicas" in out
    rows = [line.split()[0] for line in out.splitlines() if line.startswith(("cache-aware", "round-robin", "least"))]
    assert rows == ["cache-aware", "round-robin"]


def test_cli_refuses_an_unknown_policy(capsys):
    argv = ["simulate", "--model", "llama-3.1-8b", "--hardware", "h100", "--num-blocks", "400", "--replicas", "2",
            "--router", "fastest"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--router" in err and "Traceback" not in err
