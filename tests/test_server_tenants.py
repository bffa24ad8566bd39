"""Tenants (--api-keys) over HTTP on the fake engine: keys, 429s, rate windows on a hand-moved
clock, concurrency caps, fairness between tenants, prefix-cache isolation, metrics, logs."""

from __future__ import annotations

import json
import logging
import math

import httpx
import pytest
from engine_factories import FakeClock
from fake_engine import FakeEngine
from server_harness import ServerThread, metric, scrape, sse_events, wait_until

from inferlab.server.app import ServerSettings, build_app
from inferlab.server.quotas import TenantGate, TokenBucket
from inferlab.server.tenants import Tenant, TenantLimits, TenantTable, load_tenants

KEY_A, KEY_A2, KEY_B, KEY_C = "sk-a-0123456789", "sk-a-second-key", "sk-b-0123456789", "sk-c-0123456789"
A, B, C = ({"Authorization": f"Bearer {k}"} for k in (KEY_A, KEY_B, KEY_C))
MSG = [{"role": "user", "content": "Why might a parcel arrive late?"}]


class SaltSpy(FakeEngine):
    """Records the cache salt each request reached the engine with."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.salts: dict[str, str | None] = {}

    def add_request(self, request_id, prompt, params, options=None):
        self.salts[request_id] = options.cache_salt if options is not None else None
        super().add_request(request_id, prompt, params, options)


def keys_file(tmp_path, tenants: list[dict]) -> TenantTable:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": tenants}, indent=2))
    return load_tenants(path)


def serve(table: TenantTable, clock=None, **engine_kw) -> ServerThread:
    holder: dict = {}

    def factory():
        holder["engine"] = SaltSpy(**engine_kw)
        return holder["engine"]

    kw = {"clock": clock} if clock is not None else {}
    srv = ServerThread(build_app(factory, ServerSettings(tenants=table), **kw))
    srv.holder = holder  # type: ignore[attr-defined]
    return srv


def chat(srv, headers, **body) -> httpx.Response:
    return httpx.post(srv.url("/v1/chat/completions"), json={"messages": MSG, "max_tokens": 2, **body}, headers=headers)


def assert_429(r: httpx.Response, limit: str) -> dict:
    assert r.status_code == 429, r.text
    assert int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert err["type"] == "rate_limit_exceeded" and err["code"] == "rate_limit_exceeded" and err["limit"] == limit
    assert err["message"] and "param" in err
    return err


# ---------------------------------------------------------------------------- the file's tenants
def test_keys_resolve_to_tenants_and_limits(tmp_path):
    table = keys_file(tmp_path, [
        {"name": "team-a", "keys": [KEY_A, KEY_A2], "max_concurrent": 4, "requests_per_minute": 600,
         "tokens_per_minute": 200000, "max_tokens": 2048, "max_prompt_tokens": 8192},
        {"name": "team-b", "keys": [KEY_B]},
    ])  # fmt: skip
    a = table.authenticate(KEY_A)
    assert a is table.authenticate(KEY_A2) and a.name == "team-a"
    assert a.limits == TenantLimits(4, 600, 200000, 2048, 8192)
    assert table.authenticate(KEY_B).limits == TenantLimits()
    assert table.authenticate("sk-a-012345678") is None and table.authenticate("") is None
    assert KEY_A not in repr(table) and KEY_A not in repr(a)
    assert a.request_salt(None) == "tenant:team-a" and a.request_salt("x") == "tenant:team-a|x"
    assert TenantTable.open_access().authenticate(None).name == "default"


def test_token_bucket_refills_by_the_minute():
    clock = FakeClock(0.0)
    bucket = TokenBucket(60, clock())  # one a second
    assert bucket.wait_s(60, clock()) == 0
    bucket.take(60, clock())
    assert bucket.wait_s(1, clock()) == pytest.approx(1.0)
    clock.advance(30)
    assert bucket.wait_s(30, clock()) == 0 and bucket.wait_s(31, clock()) == pytest.approx(1.0)
    assert bucket.wait_s(1000, clock()) == pytest.approx(30.0)  # a request beyond a minute's budget waits for a full one
    bucket.give(1000, clock())
    assert bucket.level == 60  # never above capacity


def test_gate_refuses_without_taking():
    clock = FakeClock(0.0)
    t = Tenant("t", TenantLimits(requests_per_minute=2, tokens_per_minute=100))
    gate = TenantGate([t], clock=clock)
    gate.admit(t, 90).release(90)
    with pytest.raises(Exception) as e:
        gate.admit(t, 50)
    assert e.value.limit == "tokens" and e.value.retry_after_s == math.ceil(40 / (100 / 60))
    gate.admit(t, 10)  # the refused request took no request credit: this one still fits
    with pytest.raises(Exception, match="2 requests per minute"):
        gate.admit(t, 0)


# ---------------------------------------------------------------------------- HTTP
def test_bad_or_missing_key_is_401(tmp_path):
    table = keys_file(tmp_path, [{"name": "team-a", "keys": [KEY_A]}])
    with serve(table) as srv:
        srv.wait_ready()
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {KEY_A}"}):
            r = chat(srv, headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert chat(srv, A).status_code == 200
        assert httpx.get(srv.url("/v1/models")).status_code == 401
        assert httpx.get(srv.url("/v1/models"), headers=A).status_code == 200


def test_requests_per_minute_window(tmp_path):
    clock = FakeClock()
    table = keys_file(tmp_path, [{"name": "team-a", "keys": [KEY_A], "requests_per_minute": 2},
                                 {"name": "team-b", "keys": [KEY_B]}])  # fmt: skip
    with serve(table, clock, step_delay=0.001) as srv:
        srv.wait_ready()
        assert chat(srv, A).status_code == 200 and chat(srv, A).status_code == 200
        r = chat(srv, A)
        err = assert_429(r, "requests")
        assert r.headers["retry-after"] == "30" and "2 requests per minute" in err["message"]
        assert chat(srv, B).status_code == 200  # the other tenant is untouched
        clock.advance(29)
        assert_429(chat(srv, A), "requests")
        clock.advance(1)
        assert chat(srv, A).status_code == 200
        s = scrape(srv.base_url, A)
        assert metric(s, "inferlab:tenant_rate_limited_total", tenant="team-a", limit="requests") == 2
        assert metric(s, "inferlab:tenant_requests_total", tenant="team-a", outcome="rate_limited") == 2
        assert metric(s, "inferlab:tenant_requests_total", tenant="team-a", outcome="ok") == 3
        assert metric(s, "inferlab:tenant_requests_total", tenant="team-b", outcome="ok") == 1


def test_tokens_per_minute_charges_the_estimate_and_settles_to_use(tmp_path):
    clock = FakeClock()
    table = keys_file(tmp_path, [{"name": "team-a", "keys": [KEY_A], "tokens_per_minute": 100}])
    with serve(table, clock, step_delay=0.001) as srv:
        srv.wait_ready()
        url = srv.url("/v1/completions")

        def complete(**body):
            return httpx.post(url, json={"prompt": "abc", **body}, headers=A)

        assert complete(max_tokens=40).status_code == 200  # 3 + 40 used: 57 left
        assert complete(max_tokens=40).status_code == 200  # 14 left
        r = complete(max_tokens=40)
        assert_429(r, "tokens")
        assert r.headers["retry-after"] == str(math.ceil((43 - 14) / (100 / 60)))
        clock.advance(60)
        # stopped early: the unused part of the estimate comes back
        srv.holder["engine"].eos_after = 1
        r = complete(max_tokens=90)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert complete(max_tokens=90).status_code == 200  # 100 - 5 left: 93 fits
        s = scrape(srv.base_url, A)
        assert metric(s, "inferlab:tenant_prompt_tokens_total", tenant="team-a") == 12
        assert metric(s, "inferlab:tenant_generation_tokens_total", tenant="team-a") == 84


def test_max_concurrent_and_fairness(tmp_path):
    """Tenant A at its concurrency cap is refused at once; tenant B is admitted and served while
    A's request still runs (checked by admission and state, not by timing)."""
    table = keys_file(tmp_path, [{"name": "team-a", "keys": [KEY_A], "max_concurrent": 1},
                                 {"name": "team-b", "keys": [KEY_B]}])  # fmt: skip
    with serve(table, step_delay=0.01, max_model_len=4096, num_blocks=2000) as srv:
        srv.wait_ready()
        gate = srv.app.state.gate
        a, b = table.authenticate(KEY_A), table.authenticate(KEY_B)
        body = {"messages": MSG, "max_tokens": 3000, "stream": True}  # runs for 30 s unless its client leaves
        with httpx.stream("POST", srv.url("/v1/chat/completions"), json=body, headers=A) as stream:
            events = sse_events(stream)
            next(events), next(events)  # role chunk, first token: A's request is running
            assert gate.in_flight(a) == 1
            r = chat(srv, A)
            err = assert_429(r, "concurrency")
            assert r.headers["retry-after"] == "1" and "already has 1 requests in flight" in err["message"]
            r = chat(srv, B, max_tokens=3)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            assert gate.in_flight(a) == 1 and gate.in_flight(b) == 0  # B done while A still streams
            assert next(events)["choices"]  # and A is still being served
            s = scrape(srv.base_url, A)
            assert metric(s, "inferlab:tenant_requests_in_flight", tenant="team-a") == 1
        wait_until(lambda: gate.in_flight(a) == 0, what="A's slot to come back after its client left")
        assert chat(srv, A).status_code == 200
        s = scrape(srv.base_url, A)
        assert metric(s, "inferlab:tenant_rate_limited_total", tenant="team-a", limit="concurrency") == 1
        assert metric(s, "inferlab:tenant_requests_total", tenant="team-a", outcome="disconnected") == 1
        assert metric(s, "inferlab:tenant_rate_limited_total", tenant="team-b", limit="concurrency") == 0


def test_length_caps_are_400s_naming_the_field(tmp_path):
    table = keys_file(tmp_path, [{"name": "team-a", "keys": [KEY_A], "max_tokens": 5, "max_prompt_tokens": 30}])
    with serve(table) as srv:
        srv.wait_ready()
        url = srv.url("/v1/completions")
        r = httpx.post(url, json={"prompt": "abc", "max_tokens": 6}, headers=A)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = chat(srv, A, max_tokens=None, max_completion_tokens=6, messages=[{"role": "user", "content": "x"}])
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
        r = httpx.post(url, json={"prompt": "abc"}, headers=A)  # no max_tokens: the tenant's cap
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        r = httpx.post(url, json={"prompt": "x" * 31, "max_tokens": 1}, headers=A)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "prompt" and "31" in err["message"]
        assert httpx.post(url, json={"prompt": "x" * 30, "max_tokens": 1}, headers=A).status_code == 200
        r = httpx.post(url, json={"prompt": "abc", "min_tokens": 6}, headers=A)
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
        r = chat(srv, A, messages=[{"role": "user", "content": "x" * 30}])
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_prefix_cache_isolated_per_tenant_unless_grouped(tmp_path):
    table = keys_file(tmp_path, [
        {"name": "team-a", "keys": [KEY_A], "cache_group": "docs"},
        {"name": "team-b", "keys": [KEY_B]},
        {"name": "team-c", "keys": [KEY_C], "cache_group": "docs"},
    ])  # fmt: skip
    with serve(table) as srv:
        srv.wait_ready()
        long = [{"role": "user", "content": "a long shared question " * 4}]

        def cached(headers, **extra) -> tuple[int, str | None]:
            r = chat(srv, headers, messages=long, max_tokens=1, **extra).json()
            return r["usage"]["prompt_tokens_details"]["cached_tokens"], srv.holder["engine"].salts[r["id"]]

        assert cached(A) == (0, "group:docs")
        assert cached(A)[0] > 0
        assert cached(B) == (0, "tenant:team-b")  # same prompt, another tenant: no sharing
        assert cached(B)[0] > 0
        assert cached(C)[0] > 0 and cached(C)[1] == "group:docs"  # shared by configuration
        # a request's own cache_salt splits its tenant's cache, and cannot reach another's
        assert cached(B, cache_salt="group:docs") == (0, "tenant:team-b|group:docs")


def test_keys_never_logged_nor_in_metrics(tmp_path, caplog):
    table = keys_file(tmp_path, [{"name": "team-a", "keys": [KEY_A], "requests_per_minute": 1}])
    loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "uvicorn.access")]
    for lg in loggers:
        lg.addHandler(caplog.handler)
    try:
        caplog.set_level(logging.DEBUG)
        with serve(table) as srv:
            srv.wait_ready()
            assert chat(srv, A).status_code == 200
            assert chat(srv, A).status_code == 429
            assert chat(srv, {"Authorization": f"Bearer {KEY_A}x"}).status_code == 401
            text = httpx.get(srv.url("/metrics"), headers=A).text
    finally:
        for lg in loggers:
            lg.removeHandler(caplog.handler)
    lines = [rec.getMessage() for rec in caplog.records]
    assert any("tenant=team-a status=ok" in line for line in lines)
    assert any("tenant=team-a status=rejected 429" in line for line in lines)
    assert not any(KEY_A in line for line in lines) and KEY_A not in caplog.text
    assert KEY_A not in text and 'tenant="team-a"' in text


def test_single_api_key_is_one_anonymous_tenant():
    with ServerThread(build_app(lambda: FakeEngine(), ServerSettings(api_key="sekret"))) as srv:
        srv.wait_ready()
        good = {"Authorization": "Bearer sekret"}
        assert chat(srv, good).status_code == 200 and chat(srv, {}).status_code == 401
        s = scrape(srv.base_url, good)
        assert metric(s, "inferlab:tenant_requests_total", tenant="default", outcome="ok") == 1
    with pytest.raises(ValueError, match="not both"):
        build_app(lambda: FakeEngine(), ServerSettings(api_key="x", tenants=TenantTable.open_access()))
