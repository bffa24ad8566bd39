"""Canary releases: the split (exact share in turn, sticky per session), the rollback rules
(error rate, TTFT p95, a window, enough outcomes), and over HTTP with fake replicas on
loopback: a bad canary at 10% rolled back by itself (500s; a slow first token), manual
promote / rollback / set_weight behind the admin key, bad admin input."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import pytest
from fake_openai_server import FakeOpenAIServer
from server_harness import ServerThread, metric, scrape, sse_events, wait_until

from inferlab.router.app import RouterSettings, build_router_app
from inferlab.router.canary import Canary, CanaryConfig, session_fraction
from inferlab.router.cli import add_arguments, settings_from_args


# ---------------------------------------------------------------------- the core
def test_split_is_exact_in_turn_and_sticky_per_session():
    c = Canary(["s"], ["c"], CanaryConfig(weight=0.1))
    picks = [c.pool_for(None) for _ in range(1000)]
    assert picks.count("canary") == 100
    sessions = [f"user-{i}" for i in range(2000)]
    before = {k: c.pool_for(k) for k in sessions}
    assert 150 < sum(p == "canary" for p in before.values()) < 250
    assert all(c.pool_for(k) == before[k] for k in sessions)  # sticky
    c.set_weight(0.3)
    after = {k: c.pool_for(k) for k in sessions}
    assert all(after[k] == "canary" for k in sessions if before[k] == "canary")  # raising never moves back
    assert all((after[k] == "canary") == (session_fraction(k) < 0.3) for k in sessions)
    c.rollback()
    assert {c.pool_for(k) for k in sessions} == {"stable"}


def judge(c: Canary, stable: list[tuple[bool, float]], canary: list[tuple[bool, float]], now: float = 0.0):
    for ok, t in stable:
        c.record("stable", ok, t, now)
    reason = None
    for ok, t in canary:
        reason = c.record("canary", ok, t, now) or reason
    return reason


def test_rollback_on_error_rate_only_with_enough_outcomes():
    c = Canary(["s"], ["c"], CanaryConfig(min_requests=10, max_error_rate_delta=0.05))
    assert judge(c, [(True, 0.1)] * 50, [(False, 0.1)] * 9) is None  # 9 < min_requests
    assert c.record("canary", False, None, 0.0).startswith("error_rate")
    assert (c.state, c.weight, c.rollbacks) == ("rolled_back", 0.0, 1)


def test_no_rollback_within_the_margins_and_outside_the_window():
    c = Canary(["s"], ["c"], CanaryConfig(min_requests=10, window_s=10))
    ok = judge(c, [(True, 0.10)] * 40 + [(False, 0.1)] * 2, [(True, 0.14)] * 19 + [(False, 0.1)])
    assert ok is None and c.state == "active"  # 5% vs 4.8% errors; p95 0.14 < 0.10 * 1.5 + 0.05
    judge(c, [], [(False, 0.1)] * 30, now=0.0)
    assert c.state == "rolled_back"
    c2 = Canary(["s"], ["c"], CanaryConfig(min_requests=10, window_s=10))
    judge(c2, [(True, 0.1)] * 20, [(False, 0.1)] * 5, now=0.0)
    assert judge(c2, [(True, 0.1)] * 20, [(True, 0.1)] * 10, now=30.0) is None  # the failures aged out
    assert c2.state == "active"


def test_rollback_on_ttft_p95():
    c = Canary(["s"], ["c"], CanaryConfig(min_requests=10, max_ttft_ratio=1.5))
    reason = judge(c, [(True, 0.10)] * 40, [(True, 0.10)] * 8 + [(True, 0.9)] * 3)
    assert reason is not None and reason.startswith("ttft_p95")


def test_promote_ends_the_judging():
    c = Canary(["s"], ["c"], CanaryConfig(min_requests=1))
    c.promote()
    assert c.pool_for("anyone") == "canary" and c.pool_for(None) == "canary"
    assert judge(c, [(True, 0.1)] * 5, [(False, 0.1)] * 5) is None and c.state == "promoted"


@pytest.mark.parametrize("argv, message", [
    (["--canary", "http://127.0.0.1:9=0.2", "--canary-weight", "0.1"], "one weight"),
    (["--canary", "http://127.0.0.1:9=lots"], "must be a number"),
    (["--canary-weight", "0.1"], "needs a --canary"),
    (["--canary", "http://127.0.0.1:8"], "also as a --backend"),
    (["--canary", "http://127.0.0.1:9=1.5"], "within [0, 1]"),
])  # fmt: skip
def test_cli_refuses_bad_canaries(argv, message):
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        settings_from_args(p.parse_args(["--backend", "http://127.0.0.1:8", *argv]))
    ok = settings_from_args(p.parse_args(["--backend", "http://127.0.0.1:8", "--canary", "http://127.0.0.1:9/v1=0.25",
                                          "--canary-version", "v2"]))  # fmt: skip
    assert ok.canaries == ("http://127.0.0.1:9",) and ok.canary.weight == 0.25 and ok.versions == ("stable", "v2")


def test_router_cli_bad_tenants_file_is_one_line(tmp_path, capsys):
    from inferlab.cli import main

    bad = tmp_path / "keys.json"
    bad.write_text('{"tenants": [{"name": "a", "keys": ["k"], "max_tokens": 0}]}')
    assert main(["router", "--backend", "http://127.0.0.1:8", "--api-keys", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "keys.json:1" in err and "max_tokens" in err and "Traceback" not in err


# ---------------------------------------------------------------------- over HTTP
@contextlib.contextmanager
def release(stable: FakeOpenAIServer, canary_server: FakeOpenAIServer, **kw) -> Iterator[ServerThread]:
    kw.setdefault("canary", CanaryConfig(weight=0.1, min_requests=5))
    with stable, canary_server:
        app = build_router_app(RouterSettings(backends=(stable.base_url,), canaries=(canary_server.base_url,),
                                              policy="least-load", probe_interval_s=0.1, **kw))  # fmt: skip
        with ServerThread(app) as srv:
            wait_until(lambda: len(app.state.fleet.routable()) == 2, 10, "both pools ready")
            yield srv


def complete(srv: ServerThread, i: int, stream: bool = False, **kw) -> httpx.Response:
    body = {"prompt": f"question {i}", "max_tokens": 3, "stream": stream}
    r = httpx.post(srv.url("/v1/completions"), json=body, timeout=20, **kw)
    if stream:
        assert list(sse_events(r))[-1] == "[DONE]"
    return r


def test_a_failing_canary_at_10_percent_is_rolled_back_by_itself():
    stable, canary = FakeOpenAIServer(("ok",)), FakeOpenAIServer(("http500",))
    with release(stable, canary) as srv:
        for i in range(60):
            assert complete(srv, i).status_code == 200  # the canary's 500s are retried on stable
        samples = scrape(srv.base_url)
        assert metric(samples, "inferlab:router_canary_weight") == 0.0
        assert sum(v for k, v in samples.items() if k.startswith("inferlab:router_canary_rollbacks_total")) == 1
        tried = canary.stats.chat_or_completion_requests
        assert 1 <= tried <= 10  # rolled back early; none after
        for i in range(10):
            complete(srv, 1000 + i)
        assert canary.stats.chat_or_completion_requests == tried


def test_a_slow_canary_is_rolled_back_on_ttft():
    stable, canary = FakeOpenAIServer(("ok",)), FakeOpenAIServer(("ok",), ttft_s=0.4)
    with release(stable, canary, canary=CanaryConfig(weight=0.1, min_requests=5, max_ttft_ratio=1.5)) as srv:
        for i in range(60):
            complete(srv, i, stream=True)
        status = httpx.get(srv.url("/admin/canary"), timeout=5)
        assert status.status_code == 403  # no admin key configured: the admin routes refuse
        samples = scrape(srv.base_url)
        assert metric(samples, "inferlab:router_canary_rollbacks_total", reason="ttft_p95") == 1
        assert metric(samples, "inferlab:router_canary_weight") == 0.0


def test_admin_promote_rollback_and_weights():
    stable, canary = FakeOpenAIServer(("ok",)), FakeOpenAIServer(("ok",))
    key = {"authorization": "Bearer admin-secret"}
    with release(stable, canary, api_key="admin-secret") as srv:
        url = srv.url("/admin/canary")
        assert httpx.get(url, timeout=5).status_code == 401
        assert httpx.get(url, headers=key, timeout=5).json()["weight"] == pytest.approx(0.1)
        r = httpx.post(url, headers=key, json={"action": "promote"}, timeout=5)
        assert r.json()["state"] == "promoted" and r.json()["pools"]["canary"]["version"] == "canary"
        before = stable.stats.chat_or_completion_requests
        for i in range(5):
            assert complete(srv, i, headers=key).status_code == 200
        assert stable.stats.chat_or_completion_requests == before  # all on the canary now
        r = httpx.post(url, headers=key, json={"action": "rollback"}, timeout=5)
        assert (r.json()["state"], r.json()["weight"]) == ("rolled_back", 0.0)
        for body, param in (({"action": "explode"}, "action"), ({"action": "set_weight", "weight": 2}, "weight"),
                            ({"action": "set_weight", "weight": "half"}, "weight")):  # fmt: skip
            bad = httpx.post(url, headers=key, json=body, timeout=5)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param
        r = httpx.post(url, headers=key, json={"action": "set_weight", "weight": 0.5}, timeout=5)
        assert (r.json()["state"], r.json()["weight"]) == ("active", 0.5)
        samples = scrape(srv.base_url, headers=key)
        assert metric(samples, "inferlab:router_canary_rollbacks_total", reason="manual") == 1


def test_requests_in_flight_on_the_canary_finish_after_a_rollback():
    import threading

    stable, canary = FakeOpenAIServer(("ok",)), FakeOpenAIServer(("ok",), token_delay_s=0.2)
    key = {"authorization": "Bearer k"}
    with release(stable, canary, api_key="k", canary=CanaryConfig(weight=1.0)) as srv:
        out: dict = {}

        def run() -> None:
            with httpx.stream("POST", srv.url("/v1/completions"), headers=key, timeout=20,
                              json={"prompt": "long answer", "max_tokens": 6, "stream": True}) as r:  # fmt: skip
                out["events"] = list(sse_events(r))

        t = threading.Thread(target=run)
        t.start()
        wait_until(lambda: canary.running == 1, 10, "the stream running on the canary")
        r = httpx.post(srv.url("/admin/canary"), headers=key, json={"action": "rollback"}, timeout=5)
        assert r.json()["weight"] == 0.0
        t.join(20)
        events = out["events"]
        assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events)
        assert "".join((c.get("text") or "") for e in events if isinstance(e, dict) for c in e.get("choices", [])).count("w") == 6
        assert complete(srv, 1, headers=key).status_code == 200 and canary.stats.chat_or_completion_requests == 1
