"""The router's scoring core (no HTTP): engine-identical block hashes, the prefix index, the
policies' decisions (bounded load, ties, stale metrics, rendezvous) and the fleet's accounting."""

from __future__ import annotations

import pytest
from engine_factories import make_request

from inferlab.engine.kv_cache_manager import KVCacheManager
from inferlab.router.fleet import Fleet
from inferlab.router.hashing import block_hashes, max_hit_blocks
from inferlab.router.health import Circuit, HealthConfig, ReplicaHealth
from inferlab.router.policies import (
    CacheAware,
    LeastLoad,
    ReplicaView,
    RoundRobin,
    RouteRequest,
    Session,
    make_policy,
)
from inferlab.router.prefix_index import AllCleared, BlockRemoved, BlockStored, PrefixIndex
from inferlab.router.replica import ReplicaInfo, ReplicaMetrics


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------------- hashes
@pytest.mark.parametrize("salt", [None, "tenant-a"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_block_hashes_are_the_engines(salt, block_size):
    prompt = [(i * 7919) % 50_000 for i in range(70)]
    kv = KVCacheManager(64, block_size)
    req = make_request("r", prompt, cache_salt=salt)
    kv.update_block_hashes(req)
    assert block_hashes(prompt, block_size, salt) == list(req.block_hashes)
    assert len(req.block_hashes) == 70 // block_size


def test_predicted_cached_tokens_equal_the_engines_hit():
    """Send A to a replica; B shares A's first 37 tokens: the router predicts what the engine finds."""
    B = 4
    a = list(range(100, 150))
    b = a[:37] + list(range(900, 920))
    kv = KVCacheManager(64, B)
    ra = make_request("a", a)
    assert kv.allocate_slots(ra, ra.num_tokens) is not None
    ra.num_computed_tokens = ra.num_tokens
    kv.mark_written()
    _, engine_hit = kv.get_computed_blocks(make_request("b", b))

    clock = Clock()
    fleet = Fleet(["r0"], make_policy("cache-aware"), clock=clock)
    fleet.probe_ok("r0", info=ReplicaInfo(block_size=B, known=True))
    req_a = fleet.request(a)
    fleet.dispatch(fleet.route(req_a), req_a)
    d = fleet.route(fleet.request(b))
    assert d.predicted_cached_tokens == engine_hit == 36


def test_max_hit_blocks_keeps_the_last_token_uncached():
    assert max_hit_blocks(32, 16) == 1
    assert max_hit_blocks(33, 16) == 2
    assert max_hit_blocks(0, 16) == 0


# ---------------------------------------------------------------------- prefix index
def test_index_match_is_a_chain_and_entries_expire():
    idx = PrefixIndex(ttl_s=10, max_blocks=100)
    idx.add_speculative("r", [1, 2, 3], now=0)
    assert idx.match("r", [1, 2, 3, 4], now=5) == 3
    assert idx.match("r", [9, 2, 3], now=5) == 0  # a chain: no first block, nothing
    assert idx.match("other", [1, 2], now=5) == 0
    assert idx.match("r", [1, 2, 3], now=10.5) == 0  # expired
    assert idx.size("r") == 2  # dropped lazily, the rest later


def test_index_lru_bound_drops_a_prefix_from_its_tail():
    idx = PrefixIndex(ttl_s=100, max_blocks=5)
    idx.add_speculative("r", [1, 2, 3], now=0)
    idx.add_speculative("r", [7, 8, 9], now=1)  # 6 entries > 5: the oldest prompt's last block goes
    assert idx.size("r") == 5
    assert idx.match("r", [1, 2, 3], now=2) == 2
    assert idx.match("r", [7, 8, 9], now=2) == 3
    idx.set_capacity("r", 2)  # a replica with 2 blocks of KV cannot hold more
    assert idx.size("r") == 2
    assert idx.evictions == 4


def test_index_kv_event_seam():
    idx = PrefixIndex(ttl_s=1, max_blocks=100)
    idx.apply(BlockStored("r", (1, 2, 3)))
    assert idx.match("r", [1, 2, 3], now=1e9) == 3  # confirmed: no TTL
    idx.apply(BlockRemoved("r", (2,)))
    assert idx.match("r", [1, 2, 3], now=0) == 1
    idx.apply(AllCleared("r"))
    assert idx.match("r", [1], now=0) == 0


# ---------------------------------------------------------------------- policies
def test_least_load_ties_rotate_and_load_wins():
    p = LeastLoad()
    views = [ReplicaView("a"), ReplicaView("b"), ReplicaView("c")]
    picks = [p.choose(RouteRequest(), views).replica for _ in range(6)]
    assert sorted(picks) == ["a", "a", "b", "b", "c", "c"]
    views = [ReplicaView("a", in_flight=2), ReplicaView("b", in_flight=1), ReplicaView("c", in_flight=1, queued_prefill_tokens=50)]
    assert {p.choose(RouteRequest(), views).replica for _ in range(4)} == {"b"}


def test_stale_metrics_are_unknown_not_zero():
    """'b' last said it was idle, but that report is stale: it counts as busy as the busiest
    fresh replica, so the fresh, lightly loaded 'a' wins."""
    views = [ReplicaView("a", external_load=1.0), ReplicaView("b", external_load=None), ReplicaView("c", external_load=3.0)]
    assert LeastLoad().choose(RouteRequest(), views).replica == "a"
    clock = Clock()
    fleet = Fleet(["x"], LeastLoad(), metrics_max_age_s=2.0, clock=clock)
    fleet.probe_ok("x", metrics=ReplicaMetrics(scraped_at=clock.t, running=5))
    state = fleet.replicas["x"].state
    assert state.external_load(clock.t + 1) == 5
    assert state.external_load(clock.t + 3) is None


def test_the_routers_own_requests_that_ended_since_the_scrape_are_not_someone_elses():
    """The report counted the router's 5 requests and 3 from another client; the 5 end before
    the next scrape. Other clients' load stays 3 (not 8 - 0), so an idle replica holding the
    prefix does not look busy for up to a scrape period."""
    clock = Clock()
    fleet = Fleet(["x"], LeastLoad(), metrics_max_age_s=2.0, clock=clock)
    state = fleet.replicas["x"].state
    tickets = [state.acquire(100, 100, clock.t) for _ in range(5)]
    fleet.probe_ok("x", metrics=ReplicaMetrics(scraped_at=clock.t, running=8))
    assert state.external_load(clock.t) == 3
    for t in tickets:
        state.release(t)
    assert state.external_load(clock.t + 1) == 3
    state.acquire(100, 100, clock.t + 1)  # sent after the scrape: the report could not have seen it
    assert state.external_load(clock.t + 1) == 3


def test_round_robin_cycles():
    p = RoundRobin()
    views = [ReplicaView("a"), ReplicaView("b")]
    assert [p.choose(RouteRequest(), views).replica for _ in range(4)] == ["a", "b", "a", "b"]


def test_cache_aware_prefers_the_cached_replica_until_it_saturates():
    p = CacheAware(load_factor=1.5, min_cap=4)
    req = RouteRequest(prompt_tokens=1000)
    hot = ReplicaView("hot", in_flight=2, decoding=2, cached_tokens=992)
    cold = ReplicaView("cold")
    d = p.choose(req, [hot, cold])
    assert (d.replica, d.reason, d.predicted_cached_tokens) == ("hot", "prefix_hit", 992)
    # the owner carries 9 of 9 requests: cap = max(4, ceil(1.5 * 10 / 2)) = 8 < 10 → spill
    hot = ReplicaView("hot", in_flight=9, decoding=9, cached_tokens=992)
    d = p.choose(req, [hot, cold])
    assert (d.replica, d.reason) == ("cold", "prefix_spill")
    # no replica holds anything: by predicted TTFT (the queued prefill decides)
    d = p.choose(req, [ReplicaView("a", in_flight=1, queued_prefill_tokens=5000), ReplicaView("b", in_flight=1)])
    assert (d.replica, d.reason) == ("b", "no_prefix")


def test_cache_aware_trades_cache_against_queue():
    """A longer prefix on a replica with a long prefill queue loses to an idle replica."""
    p = CacheAware()
    req = RouteRequest(prompt_tokens=600)
    owner = ReplicaView("owner", in_flight=3, queued_prefill_tokens=3000, cached_tokens=512, prefill_rate=1000)
    idle = ReplicaView("idle", prefill_rate=1000)
    assert p.choose(req, [owner, idle]).replica == "idle"
    owner = ReplicaView("owner", in_flight=1, queued_prefill_tokens=50, cached_tokens=512, prefill_rate=1000)
    assert p.choose(req, [owner, idle]).replica == "owner"


def test_hot_prefix_spreads_in_the_fleet_when_its_owner_saturates():
    clock = Clock()
    fleet = Fleet(["r0", "r1", "r2"], CacheAware(load_factor=1.25, min_cap=2), clock=clock)
    for n in fleet.replicas:
        fleet.probe_ok(n, info=ReplicaInfo(block_size=16, known=True))
    prompt = list(range(5000, 5000 + 512))
    req = fleet.request(prompt)
    tickets = []
    for _ in range(30):
        d = fleet.route(req)
        tickets.append(fleet.dispatch(d, req))
    per = {n: r.state.in_flight for n, r in fleet.replicas.items()}
    assert max(per.values()) <= 13 and min(per.values()) >= 7, per  # bounded: ~10 each, not 30 on one
    for t in tickets:
        fleet.finish(t, "ok")
    assert all(r.state.in_flight == 0 for r in fleet.replicas.values())


def test_rendezvous_moves_about_one_nth_of_sessions_when_a_replica_is_added():
    p = Session(min_cap=10**9)  # no load bound: pure placement
    names = [f"http://r{i}" for i in range(4)]
    keys = [f"user-{i}" for i in range(2000)]
    before = {k: p.choose(RouteRequest(session_key=k), [ReplicaView(n) for n in names]).replica for k in keys}
    after = {k: p.choose(RouteRequest(session_key=k), [ReplicaView(n) for n in [*names, "http://r4"]]).replica
             for k in keys}  # fmt: skip
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "http://r4" for k in moved)  # only to the new replica
    assert 0.15 < len(moved) / len(keys) < 0.25  # ~1/5


def test_session_is_sticky_then_bounded_by_load():
    p = Session(load_factor=1.25, min_cap=2)
    views = [ReplicaView("a"), ReplicaView("b")]
    home = p.choose(RouteRequest(session_key="alice"), views)
    assert home.reason == "session"
    assert p.choose(RouteRequest(session_key="alice"), views).replica == home.replica
    loaded = [ReplicaView(v.name, in_flight=5 if v.name == home.replica else 0) for v in views]
    d = p.choose(RouteRequest(session_key="alice"), loaded)
    assert d.replica != home.replica and d.reason == "session_spill"
    assert p.choose(RouteRequest(), views).reason == "no_session"


# ---------------------------------------------------------------------- health and accounting
def test_circuit_breaker_ejects_half_opens_and_recovers():
    h = ReplicaHealth(HealthConfig(failure_threshold=2, ejection_s=1.0, max_ejection_s=4.0))
    assert not h.routable(0)  # not ready before a probe said so
    h.probe_ok()
    assert h.routable(0)
    assert not h.request_failed(0)
    assert h.request_failed(0)  # second in a row: ejected
    assert not h.routable(0.5)
    assert h.routable(1.0) and h.circuit is Circuit.HALF_OPEN
    h.on_dispatch()
    assert not h.routable(1.0)  # one trial at a time
    assert h.request_failed(1.1)  # the trial failed: open again, 2 s now
    assert not h.routable(2.5) and h.routable(3.2)
    h.on_dispatch()
    h.request_ok()
    assert h.circuit is Circuit.CLOSED and h.routable(3.3)
    assert h.request_failed(4, fatal=True)  # fatal: at once


def test_fleet_skips_unready_and_excluded_and_always_releases():
    clock = Clock()
    fleet = Fleet(["a", "b"], LeastLoad(), clock=clock)
    assert fleet.route(RouteRequest()) is None  # nobody probed yet
    fleet.probe_ok("a")
    fleet.probe_ok("b")
    d = fleet.route(RouteRequest(), exclude=["a"])
    assert d.replica == "b"
    t = fleet.dispatch(d, RouteRequest(prompt_tokens=100))
    assert fleet.replicas["b"].state.queued_prefill_tokens(clock.t) == 100
    fleet.first_token(t)
    assert fleet.replicas["b"].state.decoding(clock.t) == 1
    assert fleet.finish(t, "fatal")  # ejected
    assert not fleet.finish(t, "ok")  # released once only
    assert fleet.replicas["b"].state.in_flight == 0
    assert fleet.states() == {"a": "healthy", "b": "ejected"}
    fleet.probe_failed("a")
    assert fleet.route(RouteRequest()) is None


def test_plain_request_prefill_ends_by_prediction():
    clock = Clock()
    fleet = Fleet(["a"], LeastLoad(), prefill_rate=1000.0, clock=clock)
    fleet.probe_ok("a")
    req = RouteRequest(prompt_tokens=500)
    fleet.dispatch(fleet.route(req), req, streamed=False)
    st = fleet.replicas["a"].state
    assert st.queued_prefill_tokens(clock.t) == 500
    clock.t += 0.6  # 500 tokens at 1000/s: past the predicted prefill
    assert st.queued_prefill_tokens(clock.t) == 0 and st.decoding(clock.t) == 1


def test_first_token_calibrates_the_prefill_rate():
    clock = Clock()
    fleet = Fleet(["a"], LeastLoad(), prefill_rate=1000.0, clock=clock)
    fleet.probe_ok("a")
    st = fleet.replicas["a"].state
    for _ in range(30):
        req = RouteRequest(prompt_tokens=400)
        t = fleet.dispatch(fleet.route(req), req)
        clock.t += 0.1  # 4000 tokens/s
        fleet.first_token(t)
        fleet.finish(t, "ok")
    assert 3500 < st.prefill_rate < 4100


def test_a_restarted_replica_is_readmitted_with_an_empty_index():
    clock = Clock()
    fleet = Fleet(["a", "b"], CacheAware(), health=HealthConfig(ejection_s=1.0), clock=clock)
    for n in ("a", "b"):
        fleet.probe_ok(n, info=ReplicaInfo(block_size=4, known=True))
    req = fleet.request(list(range(40)))
    t = fleet.dispatch(fleet.route(req), req)
    home = t.replica
    assert fleet.index.size(home) == 10
    assert fleet.finish(t, "fatal")  # SIGKILLed mid-stream: ejected at once
    assert fleet.index.size(home) == 0
    fleet.probe_failed(home)
    clock.t += 5
    assert home not in [r.name for r in fleet.routable()]  # down: no traffic
    fleet.probe_ok(home)  # restarted
    assert home in [r.name for r in fleet.routable()]  # half-open: one trial
    trial = fleet.dispatch(fleet.route(req, exclude=[n for n in ("a", "b") if n != home]), req)
    assert home not in [r.name for r in fleet.routable()]  # while the trial runs
    fleet.finish(trial, "ok")
    assert fleet.states()[home] == "healthy"
