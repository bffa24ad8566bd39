"""The HTTP router in front of fake replicas on loopback: passthrough (streamed and not),
/v1/models and /health with a replica down, retries before the first byte only, a broken stream
ending in an error event (no text twice), 503 + Retry-After, cancellation reaching the replica,
cache-aware placement from the replicas' own /tokenize, the API key."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import httpx
import pytest
from fake_openai_server import FakeOpenAIServer
from server_harness import ServerThread, metric, scrape, sse_events, wait_until

from inferlab.router.app import RouterSettings, build_router_app
from inferlab.router.health import HealthConfig
from inferlab.router.proxy import REPLICA_HEADER


def dead_url() -> str:
    """A loopback URL nothing listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@contextlib.contextmanager
def fakes(*schedules: tuple[str, ...], **kw) -> Iterator[list[FakeOpenAIServer]]:
    servers = [FakeOpenAIServer(s, **kw).start() for s in schedules]
    try:
        yield servers
    finally:
        for s in servers:
            s.stop()


@contextlib.contextmanager
def router(backends: list[str], wait_for: int | None = None, **kw) -> Iterator[ServerThread]:
    """The router on a free port; returns once `wait_for` backends (default all) are ready."""
    kw.setdefault("probe_interval_s", 0.1)
    app = build_router_app(RouterSettings(backends=tuple(backends), **kw))
    with ServerThread(app) as srv:
        want = len(backends) if wait_for is None else wait_for
        wait_until(lambda: len(app.state.fleet.routable()) >= want, 10, f"{want} backends ready")
        yield srv


def fleet_of(srv: ServerThread):
    return srv.app.state.fleet


def text_of(events: list) -> str:
    out = []
    for e in events:
        if isinstance(e, dict) and "choices" in e:
            for c in e["choices"]:
                out.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return "".join(out)


def stream(srv: ServerThread, path: str, body: dict, **kw) -> tuple[httpx.Response, list]:
    with httpx.stream("POST", srv.url(path), json={**body, "stream": True}, timeout=20, **kw) as r:
        if r.status_code != 200:
            r.read()
            return r, []
        events = list(sse_events(r))
    return r, events


def test_streaming_passthrough_round_robin():
    with fakes(("ok",), ("ok",)) as (a, b), router([a.base_url, b.base_url], policy="round-robin") as srv:
        served = []
        for i in range(6):
            r, events = stream(srv, "/v1/completions", {"prompt": f"hello {i}", "max_tokens": 5,
                                                         "stream_options": {"include_usage": True}})  # fmt: skip
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            assert events[-1] == "[DONE]"
            assert text_of(events) == " w0 w1 w2 w3 w4"
            assert events[-2]["usage"]["completion_tokens"] == 5
            served.append(r.headers[REPLICA_HEADER])
        assert sorted(served) == ["0", "0", "0", "1", "1", "1"]
        assert a.stats.chat_or_completion_requests == b.stats.chat_or_completion_requests == 3
        r, events = stream(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert events[0]["choices"][0]["delta"]["role"] == "assistant" and text_of(events) == " w0 w1 w2"
        samples = scrape(srv.base_url)
        assert metric(samples, "inferlab:router_decisions_total", policy="round-robin", reason="round_robin") == 7
        wait_until(lambda: all(r.state.in_flight == 0 for r in fleet_of(srv).replicas.values()), 5, "tickets released")


def test_plain_response_passthrough():
    with fakes(("ok",)) as (a,), router([a.base_url]) as srv:
        r = httpx.post(srv.url("/v1/completions"), json={"prompt": "x y", "max_tokens": 3}, timeout=20)
        assert r.status_code == 200 and b"w2" in r.content
        assert fleet_of(srv).replicas[a.base_url].state.in_flight == 0


def test_models_and_health_with_one_replica_down():
    down = dead_url()
    with fakes(("ok",)) as (a,), router([a.base_url, down], wait_for=1) as srv:
        r = httpx.get(srv.url("/v1/models"), timeout=10)
        assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["fake-model"]
        h = httpx.get(srv.url("/health"), timeout=10)
        assert h.status_code == 200 and h.json()["replicas"] == {a.base_url: "healthy", down: "not_ready"}
        for _ in range(4):  # the down replica never gets traffic
            r, events = stream(srv, "/v1/completions", {"prompt": "p", "max_tokens": 2})
            assert r.status_code == 200 and r.headers[REPLICA_HEADER] == "0"


def test_all_backends_down_is_503_with_retry_after():
    with router([dead_url(), dead_url()], wait_for=0) as srv:
        r = httpx.post(srv.url("/v1/chat/completions"), json={"messages": [{"role": "user", "content": "hi"}]}, timeout=10)
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "unavailable_error"
        h = httpx.get(srv.url("/health"), timeout=10)
        assert h.status_code == 503 and "retry-after" in h.headers
        assert httpx.get(srv.url("/v1/models"), timeout=10).status_code == 503


def test_retry_on_5xx_before_the_first_byte():
    with fakes(("http500",), ("ok",)) as (bad, good), router([bad.base_url, good.base_url], policy="round-robin") as srv:
        for _ in range(4):
            r, events = stream(srv, "/v1/completions", {"prompt": "p", "max_tokens": 3})
            assert r.status_code == 200 and text_of(events) == " w0 w1 w2" and events[-1] == "[DONE]"
            assert r.headers[REPLICA_HEADER] == "1"
        assert bad.stats.chat_or_completion_requests >= 1
        samples = scrape(srv.base_url)
        assert metric(samples, "inferlab:router_retries_total", reason="status_500") >= 1


def test_replica_gone_after_ready_is_ejected_and_retried():
    """The probe still believes in it (slow probes): the refused connection ejects it at once
    and the request goes to the other replica, the client sees nothing."""
    with fakes(("ok",), ("ok",)) as (a, b), router([a.base_url, b.base_url], policy="round-robin", probe_interval_s=30,
                                                   health=HealthConfig(ejection_s=60)) as srv:  # fmt: skip
        a.stop()
        for _ in range(3):
            r, events = stream(srv, "/v1/completions", {"prompt": "p", "max_tokens": 2})
            assert r.status_code == 200 and text_of(events) == " w0 w1"
        assert fleet_of(srv).states()[a.base_url] == "ejected"
        samples = scrape(srv.base_url)
        assert metric(samples, "inferlab:router_ejections_total", replica=a.base_url) == 1
        assert metric(samples, "inferlab:router_retries_total", reason="connect") == 1


@pytest.mark.parametrize("behaviour", ["drop", "eof", "error_event"])
def test_failure_after_the_first_byte_ends_with_an_error_event_never_duplicated_text(behaviour):
    with fakes((behaviour,), ("ok",)) as (bad, good), router([bad.base_url, good.base_url], policy="round-robin") as srv:
        r, events = stream(srv, "/v1/completions", {"prompt": "p", "max_tokens": 8})
        assert r.status_code == 200 and r.headers[REPLICA_HEADER] == "0"
        assert text_of(events) == " w0 w1"  # what the replica sent, once; no retry after bytes went out
        assert "error" in events[-2] and events[-1] == "[DONE]"
        assert sum(1 for e in events if e == "[DONE]") == 1
        assert good.stats.chat_or_completion_requests == 0
        wait_until(lambda: fleet_of(srv).replicas[bad.base_url].state.in_flight == 0, 5, "ticket released")


def test_streamed_cancellation_reaches_the_replica():
    with fakes(("ok",), token_delay_s=0.05) as (a,), router([a.base_url]) as srv:
        with httpx.stream("POST", srv.url("/v1/completions"), json={"prompt": "p", "max_tokens": 400, "stream": True},
                          timeout=20) as r:  # fmt: skip
            it = sse_events(r)
            assert text_of([next(it), next(it)]) == " w0 w1"
        wait_until(lambda: a.running == 0, 10, "the replica's stream to end")
        assert a.generated < 400
        wait_until(lambda: fleet_of(srv).replicas[a.base_url].state.in_flight == 0, 5, "ticket released")


def test_plain_cancellation_reaches_the_replica():
    with fakes(("ok",), token_delay_s=0.05) as (a,), router([a.base_url]) as srv:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url("/v1/completions"), json={"prompt": "p", "max_tokens": 400}, timeout=0.5)
        wait_until(lambda: a.running == 0, 10, "the replica's request to end")
        assert a.generated < 400
        wait_until(lambda: fleet_of(srv).replicas[a.base_url].state.in_flight == 0, 5, "ticket released")


def test_cache_aware_sends_a_shared_prefix_to_the_same_replica():
    system = " ".join(f"s{i}" for i in range(40))  # 41 tokens with BOS: two full blocks of 16
    with fakes(("ok",), ("ok",)) as (a, b), router([a.base_url, b.base_url]) as srv:
        homes = []
        for q in range(5):
            r, events = stream(srv, "/v1/completions", {"prompt": f"{system} question {q}", "max_tokens": 2})
            assert r.status_code == 200
            homes.append(r.headers[REPLICA_HEADER])
        assert len(set(homes)) == 1
        samples = scrape(srv.base_url)
        assert metric(samples, "inferlab:router_decisions_total", policy="cache-aware", reason="prefix_hit") == 4
        assert metric(samples, "inferlab:router_predicted_cached_tokens_total") == 4 * 32
        assert a.stats.tokenize_calls + b.stats.tokenize_calls == 5


def test_api_key():
    with fakes(("ok",)) as (a,), router([a.base_url], api_key="sekrit") as srv:
        assert httpx.post(srv.url("/v1/completions"), json={"prompt": "p"}, timeout=10).status_code == 401
        assert httpx.get(srv.url("/v1/models"), timeout=10).status_code == 401
        assert httpx.get(srv.url("/metrics"), timeout=10).status_code == 401
        assert httpx.get(srv.url("/health"), timeout=10).status_code == 200
        r, events = stream(srv, "/v1/completions", {"prompt": "p", "max_tokens": 2},
                           headers={"Authorization": "Bearer sekrit"})  # fmt: skip
        assert r.status_code == 200 and text_of(events) == " w0 w1"


def test_session_policy_is_sticky_per_header_and_user():
    with fakes(("ok",), ("ok",), ("ok",)) as servers, router([s.base_url for s in servers], policy="session") as srv:
        homes: dict[str, set[str]] = {}
        for i in range(12):
            key = f"user-{i % 4}"
            body = {"prompt": "p", "max_tokens": 1}
            if i % 2:
                r, _ = stream(srv, "/v1/completions", body, headers={"X-Session-ID": key})
            else:
                r, _ = stream(srv, "/v1/completions", {**body, "user": key})
            homes.setdefault(key, set()).add(r.headers[REPLICA_HEADER])
        assert all(len(h) == 1 for h in homes.values()), homes
        samples = scrape(srv.base_url)
        assert metric(samples, "inferlab:router_decisions_total", policy="session", reason="session") == 12
