"""The Ray Serve path's plain parts, without a cluster: flags, the autoscaling policy on queued
tokens, and the request router's ranking on the router issue's scoring core."""

from __future__ import annotations

import builtins
from types import SimpleNamespace

import pytest

from inferlab.cli import main
from inferlab.ray_serve.autoscale import QueuedTokensPolicy
from inferlab.ray_serve.launch import INSTALL, ScaleConfig, import_ray
from inferlab.ray_serve.scoring import Candidate, Scorer


@pytest.mark.parametrize("flags,message", [
    (["--replicas", "0"], "--replicas must be >= 1, got 0"),
    (["--replicas", "-3"], "--replicas must be >= 1, got -3"),
    (["--replicas", "2", "--max-replicas", "3"], "give either --replicas or --min-replicas/--max-replicas"),
    (["--min-replicas", "1"], "autoscaling needs both --min-replicas and --max-replicas"),
    (["--min-replicas", "3", "--max-replicas", "2"], "--max-replicas (2) must be >= --min-replicas (3)"),
    (["--min-replicas", "0", "--max-replicas", "2"], "--min-replicas must be >= 1, got 0"),
    (["--replicas", "2", "--replica-cpus", "0"], "--replica-cpus must be > 0"),
    (["--replicas", "2", "--routing-policy", "fastest"], "--routing-policy must be one of"),
    (["--ray-address", "auto"], "--ray-address needs --replicas"),
])  # fmt: skip
def test_bad_replica_flags_are_one_line_errors(flags, message, capsys):
    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_ray_missing_says_how_to_install(monkeypatch, capsys):
    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ValueError, match="pip install 'inferlab\\[ray\\]'"):
        import_ray()
    assert main(["serve", "--replicas", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"inferlab serve: error: {INSTALL}"


def test_scale_config_defaults():
    cfg = ScaleConfig(min_replicas=1, max_replicas=3).validate()
    assert cfg.autoscale and cfg.replica_cpus == 1.0
    assert not ScaleConfig(replicas=2).validate().autoscale


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def ctx(queued: list[float], current: int, lo: int = 1, hi: int = 3):
    return SimpleNamespace(aggregated_metrics={"queued_tokens": {f"r{i}": q for i, q in enumerate(queued)}},
                           capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi,
                           target_num_replicas=current, policy_state={})  # fmt: skip


def test_autoscaling_follows_queued_tokens_up_at_once_down_after_the_delay():
    clock = Clock()
    policy = QueuedTokensPolicy(target_queued_tokens=100, downscale_delay_s=5, clock=clock)
    n = 1
    timeline = []
    # a ramp: idle, 150 then 400 queued tokens, then idle again; one decision per second
    for t, queued in enumerate([0, 0, 150, 150, 400, 400, 150, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]):
        clock.t = float(t)
        per_replica = [queued / n] * n
        n, state = policy(ctx(per_replica, n))
        timeline.append(n)
        assert state["inferlab"]["queued_tokens"] == pytest.approx(queued)
    assert timeline[:2] == [1, 1]
    assert timeline[2] == 2  # up at once
    assert max(timeline) == 3  # capped by max_replicas (400 tokens would want 4)
    up = timeline.index(3)
    assert timeline[up + 1 : up + 5] == [3, 3, 3, 3]  # not down on the first quiet ticks
    assert timeline[-1] == 1 and sorted(timeline[up:], reverse=True) == timeline[up:]  # one step at a time
    assert all(b - a >= -1 for a, b in zip(timeline, timeline[1:]))


def test_autoscaling_ignores_request_counts():
    """A hundred tiny requests' worth of tokens is less than one long prompt's."""
    policy = QueuedTokensPolicy(target_queued_tokens=1000, downscale_delay_s=0, clock=Clock())
    assert policy(ctx([100 * 3], 1))[0] == 1
    assert policy(ctx([8000], 1, hi=8))[0] == 8


def test_bad_policy_target():
    with pytest.raises(ValueError, match="target_queued_tokens"):
        QueuedTokensPolicy(target_queued_tokens=0)


def stats(**kw):
    return {"block_size": 4, "prefix_caching": True, "queued_tokens": 0, "running": 0, **kw}


def test_scorer_keeps_a_prefix_on_its_replica_and_spreads_the_rest():
    scorer = Scorer()
    cands = [Candidate("a", stats()), Candidate("b", stats())]
    prompt = list(range(100, 140))
    first = scorer.rank({"token_ids": prompt}, cands)
    assert sorted(first) == ["a", "b"]
    again = [scorer.rank({"token_ids": prompt[:36] + [7, 8, 9, 10]}, cands)[0] for _ in range(3)]
    assert again == [first[0]] * 3 and scorer.last.reason == "prefix_hit"
    # no prompt known: by load, the less loaded first
    busy = [Candidate("a", stats(), ongoing=5), Candidate("b", stats(), ongoing=0)]
    assert scorer.rank(None, busy)[0] == "b"
    # the owner of the prefix under a heavy load: the prefix spills to the other
    loaded = [Candidate(first[0], stats(queued_tokens=50_000), ongoing=9), Candidate(first[1], stats(), ongoing=0)]
    assert scorer.rank({"token_ids": prompt}, loaded)[0] == first[1]


def test_scorer_discounts_load_that_finished_since_the_report():
    """A report taken while a request ran there (queued tokens, one running) is stale once Serve
    counts nothing ongoing: the prefix stays with its owner; load still there still counts."""
    scorer = Scorer()
    prompt = list(range(100, 164))
    owner = scorer.rank({"token_ids": prompt}, [Candidate("a", stats()), Candidate("b", stats())])[0]
    other = "b" if owner == "a" else "a"
    seen = stats(queued_tokens=64, running=1, in_flight=1)
    done = [Candidate(owner, seen, ongoing=0), Candidate(other, stats(in_flight=0), ongoing=0)]
    assert scorer.rank({"token_ids": prompt[:60] + [1, 2, 3, 4]}, done)[0] == owner
    assert scorer.last.reason == "prefix_hit"
    still = [
        Candidate(owner, stats(queued_tokens=640, running=4, in_flight=4), ongoing=4),
        Candidate(other, stats(in_flight=0), ongoing=0),
    ]
    assert scorer.rank({"token_ids": prompt[:60] + [5, 6, 7, 8]}, still)[0] == other
    assert Scorer.live_share(Candidate(owner, stats(in_flight=4), ongoing=1)) == 0.25
    assert Scorer.live_share(Candidate(owner, stats(), ongoing=0)) == 1.0  # no in_flight reported


def test_scorer_forgets_a_dead_replica():
    scorer = Scorer()
    cands = [Candidate("a", stats()), Candidate("b", stats())]
    prompt = list(range(40))
    owner = scorer.rank({"token_ids": prompt}, cands)[0]
    scorer.forget(owner)
    assert scorer.index.size(owner) == 0


def test_a_downscale_decision_is_held_until_serve_moves():
    """Serve applies its own downscale delay: the policy must keep asking, not ask once."""
    clock = Clock()
    policy = QueuedTokensPolicy(target_queued_tokens=100, downscale_delay_s=3, clock=clock)
    decisions = []
    for t in range(8):
        clock.t = float(t)
        decisions.append(policy(ctx([0, 0], 2))[0])  # the target stays 2 while Serve waits
    assert decisions == [2, 2, 2, 1, 1, 1, 1, 1]
