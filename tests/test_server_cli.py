"""`inferlab serve`: flags → configs, and a graceful SIGTERM drain in a real subprocess."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import httpx
import pytest
from server_harness import sse_events, wait_until

from inferlab.cli import build_parser
from inferlab.engine.engine_args import parse_size
from inferlab.server.cli import _engine_config

TESTS = Path(__file__).parent


def test_parse_size():
    assert parse_size("2GiB") == 2 * 1024**3
    assert parse_size("512MiB") == 512 * 1024**2
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("1000") == 1000
    for bad in ("two", "5XB", "0", ""):
        with pytest.raises(Exception, match="size"):
            parse_size(bad)


def test_flags_build_the_engine_config():
    argv = ["serve", "--model", "m.gguf", "--max-model-len", "1024", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "512", "--kv-cache-memory", "2GiB", "--no-prefix-caching",
            "--dtype", "float32", "--block-size", "32", "--alias", "qwen3-0.6b", "--port", "8080"]  # fmt: skip
    parser, module = build_parser(argv)
    args = parser.parse_args(argv)
    assert module.__name__ == "inferlab.server.cli"
    cfg = _engine_config(args)
    assert cfg.load.model == "m.gguf" and cfg.load.dtype == "float32"
    assert cfg.scheduler.max_model_len == 1024 and cfg.scheduler.max_num_seqs == 8
    assert cfg.scheduler.max_num_batched_tokens == 512
    assert cfg.cache.kv_cache_memory == 2 * 1024**3 and cfg.cache.block_size == 32
    assert cfg.cache.enable_prefix_caching is False
    assert args.served_model_name == ["qwen3-0.6b"] and args.port == 8080


def test_the_queue_is_bounded_by_default_and_can_be_lifted():
    from inferlab.server.cli import QUEUE_PER_SEAT, queue_len

    assert queue_len(None, 16) == QUEUE_PER_SEAT * 16 == 64
    assert queue_len(8, 16) == 8
    assert queue_len(0, 16) is None
    with pytest.raises(ValueError, match="--max-queue-len must be >= 0"):
        queue_len(-1, 16)


def test_defaults():
    parser, _ = build_parser(["serve"])
    args = parser.parse_args(["serve"])
    assert (args.host, args.port, args.model, args.api_key) == ("127.0.0.1", 8000, None, None)
    cfg = _engine_config(args)
    assert cfg.load.model is None and cfg.cache.enable_prefix_caching


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVER_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from fake_engine import FakeEngine
from inferlab.server.app import ServerSettings, build_app
from inferlab.server.cli import run_server
app = build_app(lambda: FakeEngine(step_delay=0.02), ServerSettings(shutdown_timeout=20))
sys.exit(run_server(app, "127.0.0.1", {port}, shutdown_timeout=20, log_level="warning"))
"""


def test_sigterm_drains_in_flight_requests_and_exits_0():
    port = _free_port()
    script = textwrap.dedent(SERVER_SCRIPT).format(tests=str(TESTS), port=port)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            try:
                return httpx.get(base + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, timeout=60, what="the server to start")
        result: dict = {}
        first_token = threading.Event()

        def client():
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as r:
                events = []
                for e in sse_events(r):
                    events.append(e)
                    if len(events) == 2:
                        first_token.set()
                result["events"] = events

        t = threading.Thread(target=client)
        t.start()
        assert first_token.wait(30)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert proc.wait(60) == 0, proc.stdout.read().decode(errors="replace")
        events = result["events"]
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 60  # finished, not cut
        with pytest.raises(httpx.ConnectError):
            httpx.get(base + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_reports_a_missing_model(tmp_path):
    missing = tmp_path / "nowhere.gguf"
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-m", "inferlab.cli", "serve", "--model", str(missing), "--port", str(_free_port())],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "nowhere.gguf" in proc.stderr


# ---------------------------------------------------------------------------- --api-keys and limits
GOOD_KEYS = '{"tenants": [{"name": "team-a", "keys": ["sk-a"], "max_concurrent": 4}]}'
BAD_KEYS = {
    "malformed": ('{"tenants": [\n  {"name": "team-a", "keys": ["sk-a",]}\n]}\n', ":2:38: not valid JSON"),
    "duplicate": (
        '{"tenants": [\n  {"name": "team-a", "keys": ["sk-a"]},\n  {"name": "team-b",\n   "keys": ["sk-b", "sk-a"]}\n]}\n',
        ":4: tenant 'team-b' has a key that tenant 'team-a' already has (line 2)",
    ),
    "zero": ('{"tenants": [\n  {"name": "team-a", "keys": ["sk-a"],\n   "requests_per_minute": 0}\n]}\n',
             ":3: tenant 'team-a': requests_per_minute must be a positive integer"),
    "negative": ('{"tenants": [{"name": "team-a", "keys": ["sk-a"], "max_tokens": -5}]}', "max_tokens must be a positive integer"),
    "unknown": ('{"tenants": [\n  {"name": "team-a", "keys": ["sk-a"],\n   "max_concurency": 4}\n]}\n',
                ":3: tenant 'team-a': unknown field 'max_concurency'"),
    "same-tenant": ('{"tenants": [{"name": "t", "keys": ["sk-a",\n "sk-a"]}]}', "lists the same key twice (lines 1 and 2)"),
    "two-names": ('{"tenants": [{"name": "t", "keys": ["k1"]},\n {"name": "t", "keys": ["k2"]}]}', ":2: a second tenant named 't'"),
    "no-tenants": ('{"tenants": []}', "tenants"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_KEYS))
def test_bad_keys_file_refused_with_one_line(case, tmp_path, capsys):
    from inferlab.cli import main

    text, expected = BAD_KEYS[case]
    path = tmp_path / "keys.json"
    path.write_text(text)
    assert main(["serve", "--api-keys", str(path), "--load-format", "dummy"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"inferlab serve: error: {path}:"), err
    assert expected in err and "Traceback" not in err
    assert "sk-a" not in err and "sk-b" not in err  # keys never in messages


def test_api_key_and_api_keys_together_refused(tmp_path, capsys):
    from inferlab.cli import main

    path = tmp_path / "keys.json"
    path.write_text(GOOD_KEYS)
    assert main(["serve", "--api-keys", str(path), "--api-key", "x"]) == 2
    assert "use one" in capsys.readouterr().err
    assert main(["serve", "--header-timeout", "0"]) == 2
    assert "--header-timeout" in capsys.readouterr().err


def test_limit_flags():
    argv = ["serve", "--max-request-body-bytes", "1MiB", "--header-timeout", "3", "--body-timeout", "4",
            "--send-timeout", "5", "--keep-alive-timeout", "6", "--api-keys", "k.json"]  # fmt: skip
    parser, _ = build_parser(argv)
    args = parser.parse_args(argv)
    assert (args.max_request_body_bytes, args.header_timeout, args.body_timeout, args.send_timeout,
            args.keep_alive_timeout, args.api_keys) == (1024**2, 3, 4, 5, 6, "k.json")  # fmt: skip
    args = parser.parse_args(["serve"])
    assert args.max_request_body_bytes == 8 * 1024**2 and args.api_keys is None


def test_serve_refuses_a_bad_keys_file_before_loading(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(BAD_KEYS["duplicate"][0])
    proc = subprocess.run(
        [sys.executable, "-m", "inferlab.cli", "serve", "--api-keys", str(path), "--port", str(_free_port())],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "tenant 'team-b'" in proc.stderr and "(line 2)" in proc.stderr
