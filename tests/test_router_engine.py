"""The router in front of two real engines (the tiny random model, in-process servers): its
predicted cached tokens equal what the replicas report in usage, a shared system prompt stays
on one replica, and a malformed request gets the replica's own 4xx body."""

from __future__ import annotations

import contextlib

import httpx
import pytest
from server_harness import ServerThread, metric, scrape, sse_events, wait_until

from inferlab.config import CacheConfig, EngineConfig, LoadConfig, SchedulerConfig
from inferlab.engine.llm_engine import LLMEngine
from inferlab.models.testing import make_tiny_hf_model
from inferlab.router.app import RouterSettings, build_router_app
from inferlab.router.proxy import REPLICA_HEADER
from inferlab.router.tokens import LocalTokenizer
from inferlab.server.app import ServerSettings, build_app

SYSTEM = "You are a careful assistant who answers questions about geography in one short sentence. " * 4


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("router-tiny"), arch="llama")
    config = EngineConfig(load=LoadConfig(model=str(path), dtype="float32"),
                          cache=CacheConfig(block_size=16, num_blocks_override=64),
                          scheduler=SchedulerConfig(max_model_len=512), num_threads=1)  # fmt: skip
    with contextlib.ExitStack() as stack:
        servers = []
        for _ in range(2):
            s = stack.enter_context(ServerThread(build_app(lambda: LLMEngine(config), ServerSettings(served_model_names=("tiny",)))))
            servers.append(s)
        for s in servers:
            s.wait_ready(300)
        yield path, servers


@contextlib.contextmanager
def router(servers, **kw):
    app = build_router_app(RouterSettings(backends=tuple(s.base_url for s in servers), probe_interval_s=0.2), **kw)
    with ServerThread(app) as srv:
        wait_until(lambda: len(app.state.fleet.routable()) == len(servers), 20, "replicas ready")
        yield srv


@pytest.mark.parametrize("local", [False, True], ids=["remote-tokenize", "local-tokenizer"])
def test_predicted_cached_tokens_match_the_replicas(replicas, local):
    path, servers = replicas
    kw = {"tokenizer": LocalTokenizer.load(str(path))} if local else {}
    with router(servers, **kw) as srv:
        fleet = srv.app.state.fleet
        assert all(r.state.info.known and r.state.info.block_size == 16 and r.state.info.num_blocks == 64
                   for r in fleet.replicas.values())  # fmt: skip
        homes, cached = [], []
        for q in range(4):
            body = {"model": "tiny", "max_tokens": 2, "temperature": 0, "cache_salt": f"case-{local}",  # each case: empty caches
                    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Where is city {q}?"}]}  # fmt: skip
            if q % 2:
                r = httpx.post(srv.url("/v1/chat/completions"), json=body, timeout=60)
                assert r.status_code == 200, r.text
                usage = r.json()["usage"]
            else:
                with httpx.stream("POST", srv.url("/v1/chat/completions"), timeout=60,
                                  json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:  # fmt: skip
                    events = list(sse_events(r))
                usage = events[-2]["usage"]
            homes.append(r.headers[REPLICA_HEADER])
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
        assert len(set(homes)) == 1
        assert cached[0] == 0 and min(cached[1:]) >= 64, cached
        samples = scrape(srv.base_url)
        assert metric(samples, "inferlab:router_predicted_cached_tokens_total") == sum(cached)
        assert metric(samples, "inferlab:router_actual_cached_tokens_total") == sum(cached)
        assert metric(samples, "inferlab:router_decisions_total", policy="cache-aware", reason="prefix_hit") == 3


def test_malformed_request_gets_the_replicas_own_4xx(replicas):
    _, servers = replicas
    with router(servers) as srv:
        for body in ({"messages": "not a list"}, {"model": "tiny"}, b"{not json"):
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            direct = httpx.post(servers[0].url("/v1/chat/completions"), timeout=30, **kw)
            routed = httpx.post(srv.url("/v1/chat/completions"), timeout=30, **kw)
            assert direct.status_code == 400
            assert (routed.status_code, routed.json()) == (direct.status_code, direct.json())
        r = httpx.get(srv.url("/v1/models"), timeout=10)
        assert [m["id"] for m in r.json()["data"]] == ["tiny"]
