"""The playground and the dashboard in a real browser: Debian's chromium driven by Playwright's
Python package (scripts/install_browser.sh installs it; Playwright's own browser download is
never used). Each test starts its tiny-model server on 127.0.0.1 and the browser itself.

INFERLAB_WEBUI_SCREENSHOTS=DIR saves the pages' screenshots there (docs/images/ holds them).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
from pathlib import Path

import httpx
import pytest
from server_harness import ServerThread, metric, scrape, wait_until
from webui_support import bench_doc, tiny_app

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# What a closed network needs: no sandbox (root in CI), no GPU, no calls home.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
SHOTS = os.environ.get("INFERLAB_WEBUI_SCREENSHOTS")
TIMEOUT_MS = 30_000


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip("no chromium: run scripts/install_browser.sh (Debian's chromium; .ci/run does)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright's Python package is not installed")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = ctx.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    violations: list[str] = []
    pg.on("console", lambda m: violations.append(m.text) if "Content Security Policy" in m.text else None)
    pg.on("pageerror", lambda e: violations.append(f"page error: {e}"))
    pg.violations = violations
    yield pg
    ctx.close()
    assert not violations, violations  # no CSP violation, no uncaught script error


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from inferlab.models.testing import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("browser-tiny"), arch="llama")


@pytest.fixture(scope="module")
def srv(tiny_path):
    with ServerThread(tiny_app(tiny_path, paced=True)) as s:
        s.wait_ready()
        yield s


def shot(page, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SHOTS) / name), full_page=True)


def engine_counts(srv) -> tuple[float, float, float]:
    s = scrape(srv.base_url)
    return (metric(s, "vllm:num_requests_running"), metric(s, "vllm:kv_cache_usage_perc"),
            metric(s, "vllm:request_success_total", finished_reason="abort"))  # fmt: skip


def test_a_person_asks_watches_it_stream_and_stops_it(srv, page):
    resp = page.goto(srv.url("/"))
    assert "script-src 'self'" in resp.headers["content-security-policy"]
    page.wait_for_selector("#model option[value=tiny]", state="attached")
    aborted_before = engine_counts(srv)[2]
    page.fill("#max_tokens", "400")
    page.check("#ignore_eos")
    page.fill("#prompt", "Tell me a long story about a lighthouse.")
    page.press("#prompt", "Enter")
    answer = page.locator(".msg.assistant").last
    page.wait_for_function("() => document.querySelector('.msg.assistant .content').textContent.length > 20")
    assert "first text after" in answer.locator(".timings").inner_text()
    assert engine_counts(srv)[0] == 1  # it is running on the server now
    page.click("#stop")
    page.wait_for_selector(".msg.assistant .status.stopped")
    wait_until(lambda: engine_counts(srv)[:2] == (0, 0), timeout=20, what="the server to free the request")
    assert engine_counts(srv)[2] == aborted_before + 1  # the server aborted it, not finished it
    trace_link = answer.locator("a.trace-link").get_attribute("href")
    rid = trace_link.split("#trace=", 1)[1]
    trace = httpx.get(srv.url(f"/traces/{rid}")).json()
    assert trace["finish_reason"] == "abort" and [s["name"] for s in trace["spans"]][4] == "abort"
    assert page.is_enabled("#send") and not page.is_enabled("#stop")

    # the next answer runs to its end: the server's timings under it, and its tokens on demand
    page.fill("#max_tokens", "8")
    page.fill("#prompt", "And a short one?")
    page.press("#prompt", "Enter")
    last = page.locator(".msg.assistant").nth(1)
    last.locator(".status", has_text="finished").wait_for()
    timings = last.locator(".timings").inner_text()
    assert "queue" in timings and "TTFT" in timings and "decode" in timings and "(8 tokens)" in timings
    last.locator("button.show-tokens").click()
    last.locator(".answer-tokens .tok").first.wait_for()
    assert last.locator(".answer-tokens .tok").count() == 8
    assert last.locator(".prompt-tokens .tok").count() > 5
    assert "logprob" in last.locator(".answer-tokens .tok").first.get_attribute("title")
    assert "logprob" in last.locator(".prompt-tokens .tok").nth(1).get_attribute("title")
    shot(page, "playground.png")


def test_a_server_error_is_shown_in_the_page(srv, page):
    page.goto(srv.url("/"))
    page.wait_for_selector("#model option[value=tiny]", state="attached")
    page.fill("#max_tokens", "100000")  # beyond the context window: a 400
    page.fill("#prompt", "hello")
    page.press("#prompt", "Enter")
    err = page.locator(".msg.assistant .status.error")
    err.wait_for()
    assert "error:" in err.inner_text() and "512" in err.inner_text()


def test_structured_outputs_from_the_playground(srv, page):
    """The response-format control: a strict JSON schema and a list of choices constrain a tiny
    random model's answer (valid every time); a schema that is not JSON is refused in the page."""
    page.goto(srv.url("/"))
    page.wait_for_selector("#model option[value=tiny]", state="attached")
    page.fill("#max_tokens", "40")
    page.fill("#temperature", "1")
    schema = {"type": "object", "properties": {"ok": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["ok"], "additionalProperties": False}
    page.select_option("#response_format", "json_schema")
    page.fill("#constraint", json.dumps(schema))
    page.fill("#prompt", "Answer yes or no.")
    page.press("#prompt", "Enter")
    first = page.locator(".msg.assistant").nth(0)
    first.locator(".status", has_text="finished").wait_for()
    assert json.loads(first.locator(".content").inner_text()) in ({"ok": "yes"}, {"ok": "no"})
    page.select_option("#response_format", "choice")
    page.fill("#constraint", "red\nblue")
    page.fill("#prompt", "A colour?")
    page.press("#prompt", "Enter")
    second = page.locator(".msg.assistant").nth(1)
    second.locator(".status", has_text="finished").wait_for()
    assert second.locator(".content").inner_text() in ("red", "blue")
    page.select_option("#response_format", "json_schema")
    page.fill("#constraint", "{not json")
    page.fill("#prompt", "again")
    page.press("#prompt", "Enter")
    err = page.locator(".msg.assistant").nth(2).locator(".status.error")
    err.wait_for()
    assert "not valid JSON" in err.inner_text()


def test_the_dashboard_moves_under_load_and_draws_a_trace(srv, page):
    page.goto(srv.url("/dashboard"))
    page.wait_for_function("() => Number(document.body.dataset.events || 0) >= 1")
    assert page.inner_text("#conn") == "live"
    assert page.inner_text("#v-running") == "0"
    body = {"messages": [{"role": "user", "content": "load"}], "max_tokens": 100, "ignore_eos": True, "stream": False}

    def one(_):
        return httpx.post(srv.url("/v1/chat/completions"), json=body, timeout=60).status_code

    seen_running = []
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # bounded: 8 requests, 4 at a time
        futures = [pool.submit(one, i) for i in range(8)]
        page.wait_for_function("() => Number(document.getElementById('v-running').textContent) >= 2")
        seen_running.append(int(page.inner_text("#v-running")))
        page.wait_for_function("() => parseFloat(document.getElementById('v-output').textContent) > 0")
        assert all(f.result() == 200 for f in futures)
    page.wait_for_function("() => document.getElementById('v-running').textContent === '0'")
    assert seen_running[0] >= 2
    assert page.inner_text("#v-ttft") != "– / –" and page.locator("#c-tokens path.line").count() == 2
    page.wait_for_function("() => document.querySelectorAll('#recent li').length >= 8")
    first = page.locator("#recent li").first
    rid = first.get_attribute("data-id")
    first.click()
    page.wait_for_function(f"() => document.getElementById('trace-svg').dataset.request === {json.dumps(rid)}")
    bars = page.locator("#trace-svg rect")
    assert bars.count() >= 6  # request, queue, prefill, decode, finish, a chunk, the stream
    assert "decode" in page.text_content("#trace-svg")
    shot(page, "dashboard.png")


def test_the_dashboard_reconnects_when_its_event_stream_drops(srv, page):
    attempts = []

    def handle(route):
        attempts.append(1)
        if len(attempts) == 1:
            route.abort()  # the first connection fails
        else:
            route.continue_()

    page.route("**/dashboard/events", handle)
    page.goto(srv.url("/dashboard"))
    page.wait_for_function("() => Number(document.body.dataset.events || 0) >= 2")
    assert len(attempts) >= 2 and page.inner_text("#conn") == "live"


def test_the_dashboard_draws_a_bench_result_file(srv, page, tmp_path):
    path = tmp_path / "result.json"
    path.write_text(json.dumps(bench_doc()))
    page.goto(srv.url("/dashboard"))
    page.set_input_files("#bench-file", str(path))
    page.wait_for_selector("svg.bench-cdf path.line")
    assert page.locator("svg.bench-cdf").count() == 4 and page.locator("svg.bench-sweep").count() == 2
    assert page.locator("svg.bench-cdf[data-col=ttft_s] path.line").count() == 2  # one CDF per load level
    assert "c=8" in page.inner_text("#bench-summary")
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "something else"}')
    page.set_input_files("#bench-file", str(bad))
    page.wait_for_selector("#bench-msg.error")
    assert "not an inferlab.bench/1 result" in page.inner_text("#bench-msg")


def test_the_page_asks_for_the_api_key(tiny_path, page):
    with ServerThread(tiny_app(tiny_path, api_key="sekret")) as s:
        s.wait_ready()
        page.goto(s.url("/"))
        page.wait_for_selector("#key-form:not([hidden])")
        page.fill("#key-input", "wrong")
        page.click("#key-form button")
        page.wait_for_selector("#key-message:has-text('refused')")
        page.fill("#key-input", "sekret")
        page.click("#key-form button")
        page.wait_for_selector("#model option[value=tiny]", state="attached")
        page.fill("#max_tokens", "4")
        page.fill("#prompt", "hi")
        page.press("#prompt", "Enter")
        page.locator(".msg.assistant .status", has_text="finished").wait_for()
        page.goto(s.url("/dashboard"))  # the key is kept for the tab
        page.wait_for_function("() => Number(document.body.dataset.events || 0) >= 1")
        assert page.is_hidden("#key-form")
