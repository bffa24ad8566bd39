"""KV events from the engine's block pool to the router's prefix index (no HTTP here: the wire
shapes are round-tripped through JSON): the log's order, bounds, gaps and epochs; the index
equal to the pool's cached blocks after a mixed workload with hits, evictions, uncached
failures, resets, a log too short for a slow follower, and a restart."""

from __future__ import annotations

import json
import random

import pytest
from engine_factories import make_request

from inferlab.engine.kv_cache_manager import KVCacheManager
from inferlab.engine.kv_events import KVEventLog, page_json, snapshot_json
from inferlab.router.fleet import Fleet
from inferlab.router.kv_sync import BadFeed, KVSync, parse_page, parse_snapshot
from inferlab.router.policies import make_policy
from inferlab.router.prefix_index import PrefixIndex
from inferlab.router.replica import ReplicaInfo


def wire(obj: dict) -> dict:
    return json.loads(json.dumps(obj))


def follow(log: KVEventLog, kv: KVSync, limit: int = 1000) -> None:
    """What the router's prober does each round, over the same JSON shapes."""
    for _ in range(100):
        if not kv.synced:
            kv.apply_snapshot(parse_snapshot(wire(snapshot_json(log.snapshot(), log.block_size))))
        page = parse_page(wire(page_json(log.since(kv.seq, limit), log.block_size)))
        if kv.apply_page(page) and len(page.events) < limit:
            return
    raise AssertionError("the follower never caught up")


# ---------------------------------------------------------------------- the log
def test_log_numbers_records_and_reports_gaps():
    log = KVEventLog(capacity=3)
    assert log.since(0).events == () and not log.since(0).gap
    log.stored([1, 2])
    log.removed([2])
    log.cleared()
    log.stored([5])
    page = log.since(1)
    assert [(r.seq, r.kind, r.block_hashes) for r in page.events] == [(2, "removed", (2,)), (3, "cleared", ()),
                                                                      (4, "stored", (5,))]  # fmt: skip
    assert log.since(0).gap  # record 1 fell out of the bounded log
    assert log.since(9).gap  # ahead of the log: a follower of an earlier life
    assert log.since(4).events == () and log.since(2, limit=1).events[0].seq == 3
    snap = log.snapshot()
    assert (snap.seq, set(snap.block_hashes)) == (4, {5})
    assert KVEventLog().epoch != KVEventLog().epoch


def test_pool_without_a_log_records_nothing():
    kv = KVCacheManager(8, 4)
    assert kv.block_pool.events is None
    r = make_request("a", list(range(12)))
    assert kv.allocate_slots(r, r.num_tokens) is not None  # no log: the hooks are skipped


def test_bad_feed_is_refused():
    with pytest.raises(BadFeed):
        parse_page({"epoch": "e", "seq": 1, "events": [{"seq": 1, "type": "exploded"}]})
    with pytest.raises(BadFeed):
        parse_snapshot({"epoch": "e", "seq": 1, "block_hashes": ["not hex"]})


# ---------------------------------------------------------------------- the feed
class Workload:
    """A KV cache manager driven like the scheduler drives it: prompts from a few shared
    system prefixes plus private tails, prefix hits, evictions (few blocks), steps that fail
    before their K/V is written (uncache), and an occasional reset."""

    def __init__(self, seed: int, num_blocks: int = 24, block_size: int = 4, capacity: int = 64):
        self.rng = random.Random(seed)
        self.kv = KVCacheManager(num_blocks, block_size)
        self.log = KVEventLog(capacity, block_size=block_size)
        self.kv.block_pool.events = self.log
        self.live: list = []
        self.n = 0
        self.systems = [[1000 * s + i for i in range(12)] for s in range(3)]

    def step(self) -> None:
        rng, kv = self.rng, self.kv
        roll = rng.random()
        if self.live and (roll < 0.4 or len(self.live) > 3):
            kv.free(self.live.pop(rng.randrange(len(self.live))))
            return
        if roll > 0.985:
            kv.reset_prefix_cache()
            return
        self.n += 1
        prompt = rng.choice(self.systems) + [rng.randrange(50_000) for _ in range(rng.randrange(1, 10))]
        req = make_request(f"r{self.n}", prompt, cache_salt=rng.choice([None, None, "tenant-b"]))
        hits, num_hit = kv.get_computed_blocks(req)
        if kv.allocate_slots(req, req.num_tokens - num_hit, hits) is None:
            return
        if rng.random() < 0.1:
            kv.free(req)  # the step failed before it ran: its fresh blocks leave the cache
            return
        kv.mark_written()
        req.num_computed_tokens = req.num_tokens
        self.live.append(req)

    def cached(self) -> set[int]:
        return set(self.kv.block_pool.cached_blocks)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_index_equals_the_pools_cached_blocks(seed):
    w = Workload(seed)
    index = PrefixIndex()
    kv = KVSync("r", index)
    for i in range(600):
        w.step()
        # A slow follower now and then (after 40 steps the short log has dropped what it needs).
        if i % (40 if i % 200 < 100 else 3) == 0:
            follow(w.log, kv, limit=7)
            assert index.confirmed("r") == w.cached()
    follow(w.log, kv)
    assert index.confirmed("r") == w.cached()
    assert w.kv.block_pool.num_evictions > 20 and kv.events > 200
    assert kv.resyncs > 1 and kv.gaps >= 1  # gaps happened and were healed from the snapshot

    # A restart: a new engine (a new log, a new epoch) whose cache starts empty.
    index.add_speculative("r", [7, 8, 9], now=0)
    w2 = Workload(seed + 10)
    for _ in range(50):
        w2.step()
    follow(w2.log, kv)
    assert kv.epoch == w2.log.epoch
    assert index.confirmed("r") == w2.cached()
    assert index.match("r", [7, 8, 9], now=1) == 0  # what was guessed for the old process is gone


def test_a_seq_hole_forces_a_resync():
    log = KVEventLog()
    index = PrefixIndex()
    kv = KVSync("r", index)
    log.stored([1, 2])
    follow(log, kv)
    log.stored([3])
    log.removed([1])
    page = parse_page(wire(page_json(log.since(kv.seq), 16)))
    page = type(page)(page.epoch, page.seq, page.events[1:])  # record 2 lost on the way
    assert not kv.apply_page(page) and not kv.synced
    assert index.confirmed("r") == {1, 2}  # nothing of the broken page applied
    follow(log, kv)
    assert index.confirmed("r") == {2, 3}


def test_fleet_uses_confirmed_blocks_and_a_short_ttl_for_followed_replicas():
    t = [1000.0]
    fleet = Fleet(["a", "b"], make_policy("cache-aware"), index=PrefixIndex(ttl_s=120), speculative_ttl_s=5,
                  clock=lambda: t[0])  # fmt: skip
    for n in ("a", "b"):
        fleet.probe_ok(n, info=ReplicaInfo(block_size=4, known=True))
    prompt = list(range(40))
    req = fleet.request(prompt)
    # b's events say it holds the prompt's first 5 blocks: the router sends it there.
    log = KVEventLog(block_size=4)
    log.stored(req.block_hashes[:5])
    follow(log, fleet.replicas["b"].kv)
    d = fleet.route(req)
    assert (d.replica, d.predicted_cached_tokens, d.reason) == ("b", 20, "prefix_hit")
    fleet.finish(fleet.dispatch(d, req), "ok")  # speculative for the other 5 blocks, on b's short TTL
    assert fleet.route(req).predicted_cached_tokens == 36  # all but the last token's block
    t[0] += 6
    assert fleet.route(req).predicted_cached_tokens == 20  # the guess expired; the confirmed stay
    fleet.forget("b")  # ejected / restarted
    assert not fleet.replicas["b"].kv.synced and fleet.index.num_confirmed("b") == 0
