"""KV events over HTTP: two real tiny-model replicas (`GET /kv_events`, `/kv_events/snapshot`)
behind the router; after a mixed workload (shared prefixes, private ones, evictions from a small
cache, streamed and plain) the router's confirmed index equals each replica's cached blocks, and
again after one replica restarts on the same port (a new epoch, an empty cache)."""

from __future__ import annotations

import contextlib
import json
import random

import httpx
import pytest
from server_harness import ServerThread, metric, scrape, wait_until

from inferlab.config import CacheConfig, EngineConfig, LoadConfig, SchedulerConfig
from inferlab.engine.llm_engine import LLMEngine
from inferlab.models.testing import make_tiny_hf_model
from inferlab.router.app import RouterSettings, build_router_app
from inferlab.server.app import ServerSettings, build_app
from inferlab.server.tenants import load_tenants


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("kv-events-tiny"), arch="llama")
    return EngineConfig(load=LoadConfig(model=str(path), dtype="float32"),
                        cache=CacheConfig(block_size=16, num_blocks_override=24),  # small: the workload evicts
                        scheduler=SchedulerConfig(max_model_len=512), num_threads=1)  # fmt: skip


def replica(config, port: int = 0, **kw) -> ServerThread:
    return ServerThread(build_app(lambda: LLMEngine(config), ServerSettings(served_model_names=("tiny",), **kw)), port=port)


def cached_blocks(server: ServerThread) -> set[int]:
    """The replica's prefix cache, read directly (the engine is idle when this is called)."""
    return set(server.app.state.llm.engine.scheduler.kv_cache_manager.block_pool.cached_blocks)


def workload(router: ServerThread, rng: random.Random, n: int) -> None:
    systems = [[5 + (31 * s + 13 * i) % 370 for i in range(rng.choice((48, 80)))] for s in range(4)]  # vocab 384
    for i in range(n):
        prompt = rng.choice(systems) + [rng.randrange(5, 380) for _ in range(rng.randrange(4, 60))]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": i % 3 == 0}
        r = httpx.post(router.url("/v1/completions"), json=body, timeout=60)
        assert r.status_code == 200, r.text


def in_step(fleet, servers) -> bool:
    return all(fleet.index.confirmed(s.base_url) == cached_blocks(s) for s in servers)


def test_the_replica_serves_its_events(config):
    with replica(config) as s:
        s.wait_ready(300)
        snap = httpx.get(s.url("/kv_events/snapshot"), timeout=10).json()
        assert snap["block_hashes"] == [] and snap["block_size"] == 16  # the warm-up left nothing
        r = httpx.post(s.url("/v1/completions"), json={"prompt": list(range(1, 40)), "max_tokens": 1}, timeout=60)
        assert r.status_code == 200
        page = httpx.get(s.url("/kv_events"), params={"after": snap["seq"]}, timeout=10).json()
        assert page["epoch"] == snap["epoch"] and not page["gap"]
        stored = [h for e in page["events"] if e["type"] == "stored" for h in e["block_hashes"]]
        assert {int(h, 16) for h in stored} == cached_blocks(s) and len(stored) == 2
        assert httpx.get(s.url("/kv_events"), params={"after": page["seq"] + 5}, timeout=10).json()["gap"] is True
        bad = httpx.get(s.url("/kv_events"), params={"after": "x"}, timeout=10)
        assert bad.status_code == 400 and "after" in bad.text
    with replica(config, kv_events=False) as s:
        s.wait_ready(300)
        off = httpx.get(s.url("/kv_events"), timeout=10)
        assert off.status_code == 404 and off.json()["error"]["type"] == "not_found_error"


def test_router_index_follows_the_replicas_through_evictions_and_a_restart(config):
    rng = random.Random(7)
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(replica(config)) for _ in range(2)]
        for s in servers:
            s.wait_ready(300)
        # round-robin: both replicas get work (the feed is followed whatever the policy)
        app = build_router_app(RouterSettings(backends=tuple(s.base_url for s in servers), policy="round-robin",
                                              probe_interval_s=0.1))  # fmt: skip
        router = stack.enter_context(ServerThread(app))
        fleet = app.state.fleet
        wait_until(lambda: all(r.kv.synced for r in fleet.replicas.values()), 20, "both feeds synced")

        workload(router, rng, 24)
        wait_until(lambda: in_step(fleet, servers), 20, "the index to equal the replicas' caches")
        evictions = [s.app.state.llm.engine.scheduler.kv_cache_manager.block_pool.num_evictions for s in servers]
        assert sum(evictions) > 0, "the workload is meant to evict"
        assert all(fleet.index.num_confirmed(s.base_url) > 0 for s in servers)

        # Restart replica 0 on its port: a new process life, an empty cache, a new epoch.
        old = servers[0]
        epoch = fleet.replicas[old.base_url].kv.epoch
        old.__exit__(None, None, None)
        wait_until(lambda: not fleet.replicas[old.base_url].health.ready, 20, "replica 0 seen down")
        new = replica(config, port=old.port)
        stack.enter_context(new)
        new.wait_ready(300)
        servers[0] = new
        wait_until(lambda: fleet.replicas[new.base_url].kv.synced and fleet.replicas[new.base_url].kv.epoch != epoch,
                   20, "replica 0 resynced on its new epoch")  # fmt: skip
        assert fleet.index.num_confirmed(new.base_url) == 0

        workload(router, rng, 12)
        wait_until(lambda: in_step(fleet, servers), 20, "the index to equal the caches after the restart")
        samples = scrape(router.base_url)
        assert metric(samples, "inferlab:router_kv_resyncs", replica=new.base_url) >= 2
        assert metric(samples, "inferlab:router_kv_events_applied", replica=servers[1].base_url) > 0


def test_tenant_salts_keep_tenants_apart_and_predictions_exact(config, tmp_path):
    """The router and the replica share a tenants file: each prompt is hashed with the salt the
    replica's engine gives it (tenant, then cache group, then the request's own cache_salt)."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": [
        {"name": "team-a", "keys": ["key-a"]}, {"name": "team-b", "keys": ["key-b"]},
        {"name": "team-c", "keys": ["key-c"], "cache_group": "docs"}, {"name": "team-d", "keys": ["key-d"], "cache_group": "docs"},
    ]}))  # fmt: skip
    table = load_tenants(keys)
    with replica(config, tenants=table) as s:
        s.wait_ready(300)
        app = build_router_app(RouterSettings(backends=(s.base_url,), tenants=table, backend_api_key="key-a",
                                              probe_interval_s=0.1))  # fmt: skip
        with ServerThread(app) as router:
            fleet = app.state.fleet
            wait_until(lambda: fleet.replicas[s.base_url].kv.synced, 20, "the feed synced")
            prompt = [5 + (17 * i) % 370 for i in range(70)]

            def send(key: str, **extra) -> tuple[int, int]:
                """(cached tokens the router predicted, cached tokens the replica reported)."""
                before = scrape(router.base_url, {"authorization": "Bearer key-a"})
                r = httpx.post(router.url("/v1/completions"), headers={"authorization": f"Bearer {key}"}, timeout=60,
                               json={"prompt": prompt, "max_tokens": 1, **extra})  # fmt: skip
                assert r.status_code == 200, r.text
                after = scrape(router.base_url, {"authorization": "Bearer key-a"})
                name = "inferlab:router_predicted_cached_tokens_total"
                predicted = after[name] - before[name]
                # the replica's usage; wait for the feed so the next prediction sees these blocks
                wait_until(lambda: fleet.index.confirmed(s.base_url) == cached_blocks(s), 20, "feed caught up")
                return int(predicted), r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

            assert send("key-a") == (0, 0)
            assert send("key-a") == (64, 64)  # the tenant's own prefix: predicted as found
            assert send("key-b") == (0, 0)  # another tenant never shares it, and the router knows
            assert send("key-a", cache_salt="split") == (0, 0)  # a request salt splits a tenant further
            assert send("key-c") == (0, 0)
            assert send("key-d") == (64, 64)  # one cache group: shared on purpose
            bad = httpx.post(router.url("/v1/completions"), headers={"authorization": "Bearer nope"},
                             json={"prompt": prompt}, timeout=10)  # fmt: skip
            assert bad.status_code == 401
