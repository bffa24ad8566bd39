"""The web pages' routes over HTTP (no browser): pages and assets with their CSP, the key on
what they fetch, the dashboard's event stream, and the server's shutdown closing it."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from server_harness import ServerThread, sse_events
from webui_support import bench_doc, tiny_app

from inferlab.bench.report import validate_report
from inferlab.server.live import LiveStats, percentiles


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from inferlab.models.testing import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("webui-tiny"), arch="llama")


@pytest.fixture(scope="module")
def srv(tiny_path):
    with ServerThread(tiny_app(tiny_path, api_key="sekret")) as s:
        s.wait_ready()
        yield s


AUTH = {"Authorization": "Bearer sekret"}


def test_pages_and_assets_are_public_with_a_strict_csp(srv):
    for path, kind in (("/", "text/html"), ("/dashboard", "text/html"), ("/ui/playground.js", "text/javascript"),
                       ("/ui/style.css", "text/css")):  # fmt: skip
        r = httpx.get(srv.url(path))
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
        csp = r.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp
        assert r.headers["x-content-type-options"] == "nosniff"
    html = httpx.get(srv.url("/")).text
    assert "<script>" not in html and "http" not in html.replace('http-equiv', '')  # no inline script, no CDN
    r = httpx.get(srv.url("/ui/../app.py"))
    assert r.status_code == 404


def test_what_the_pages_fetch_needs_the_key(srv):
    for path in ("/dashboard/events", "/traces", "/traces/x"):
        r = httpx.get(srv.url(path))
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(srv.url("/traces/unknown"), headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["param"] == "request_id"


def test_the_event_stream_reports_a_finished_request(srv):
    r = httpx.post(srv.url("/v1/chat/completions"), headers=AUTH, timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True})  # fmt: skip
    rid = r.json()["id"]
    with httpx.stream("GET", srv.url("/dashboard/events"), headers=AUTH, timeout=30) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        snap = next(e for e in sse_events(resp))
    assert snap["ready"] and snap["running"] == 0 and snap["kv_cache_usage"] == 0.0
    assert snap["ttft_s"]["n"] >= 1 and snap["itl_s"]["n"] >= 4 and snap["finished_last_minute"].get("length", 0) >= 1
    assert rid in [x["request_id"] for x in snap["recent_requests"]]
    trace = httpx.get(srv.url(f"/traces/{rid}"), headers=AUTH).json()
    names = [s["name"] for s in trace["spans"]]
    assert names[:5] == ["llm_request", "queue", "prefill", "decode", "finish"] and "prefill_chunk" in names


def test_shutdown_closes_an_open_event_stream(tiny_path):
    srv = ServerThread(tiny_app(tiny_path), shutdown_timeout=30)
    srv.__enter__()
    srv.wait_ready()
    got = threading.Event()
    ended = threading.Event()

    def watch():
        try:
            with httpx.stream("GET", srv.url("/dashboard/events"), timeout=60) as resp:
                for _ in sse_events(resp):
                    got.set()
        except httpx.HTTPError:
            pass
        ended.set()

    threading.Thread(target=watch, daemon=True).start()
    assert got.wait(30)
    t0 = time.monotonic()
    srv.__exit__(None, None, None)
    assert ended.wait(10)
    assert time.monotonic() - t0 < 15  # not held for the 30 s graceful-shutdown timeout


def test_live_stats_window_and_percentiles():
    now = [1000.0]
    live = LiveStats(clock=lambda: now[0])
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}
    assert percentiles([float(i) for i in range(1, 101)]) == {"p50": 50.0, "p90": 90.0, "p99": 99.0}
    live._ttft.extend([(900.0, 9.0), (990.0, 0.5)])  # one sample older than the minute
    snap = live.snapshot()
    assert snap["ttft_s"]["n"] == 1 and snap["ttft_s"]["p50"] == 0.5


def test_the_bench_document_used_by_the_browser_test_is_valid():
    validate_report(bench_doc())


def test_the_grafana_dashboard_reads_metrics_the_server_exports(srv):
    import json
    import re
    from pathlib import Path

    board = json.loads((Path(__file__).parent.parent / "deploy" / "grafana" / "inferlab-dashboard.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"(?:vllm|inferlab):[a-z0-9_]+", e)}
    text = httpx.get(srv.url("/metrics"), headers=AUTH).text
    exported = set(re.findall(r"^# TYPE (\S+) (\S+)", text, re.M))
    names = {n for n, _ in exported} | {n + "_total" for n, kind in exported if kind == "counter"}
    speculative = {m for m in used if m.startswith("vllm:spec_decode")}  # registered only with speculative decoding
    assert used - speculative and not (used - speculative - names), sorted(used - speculative - names)
