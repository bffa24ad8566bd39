"""`inferlab bench` end to end against the fake server: JSON (schema checked), Markdown, PNGs,
side-by-side load levels, and one-line errors for bad input."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from fake_openai_server import FakeOpenAIServer

from inferlab.bench.report import REQUEST_ARRAYS, SCHEMA, validate_report
from inferlab.cli import main


def bench(srv: FakeOpenAIServer, *extra: str) -> int:
    return main(["bench", "--base-url", srv.base_url, "--input-len", "24", "--output-len", "5",
                 "--num-prompts", "6", "--no-progress", *extra])


def test_end_to_end_run_writes_json_and_markdown(tmp_path, capsys):
    schedule = ("ok", "ok", "http500", "ok", "ok", "ok", "ok", "ok")  # two warm-up requests come first
    with FakeOpenAIServer(schedule) as srv:
        rc = bench(srv, "--max-concurrency", "3", "--warmup", "2", "--usd-per-hour", "0.89", "--goodput", "ttft:60000",
                   "--scrape-metrics", "--scrape-interval", "0.05", "--label", "fake run", "--api-key", "sekret",
                   "--result-file", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "r.md"))
        assert srv.stats.chat_or_completion_requests == 8
        assert srv.stats.tokenize_calls > 0  # no --tokenizer: the server's /tokenize counted the prompts
        assert all("ignore_eos" not in b for b in srv.stats.bodies)  # only sent when asked for
    assert rc == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    validate_report(doc)
    assert doc["schema"] == SCHEMA == "inferlab.bench/1"
    assert doc["label"] == "fake run"
    assert doc["mode"] == "single" and doc["sweep"] is None and doc["warmup_requests"] == 2
    assert doc["server"]["model"] == "fake-model" and doc["server"]["url"].endswith("/v1/completions")
    assert doc["server"]["max_model_len"] == 4096
    assert set(doc["versions"]) >= {"inferlab", "python", "platform"}
    assert set(doc["machine"]) >= {"cpu_count", "cpu_model"}
    assert doc["command_line"].startswith("inferlab bench --base-url http://127.0.0.1:")
    assert "sekret" not in json.dumps(doc)
    assert "vLLM's definitions" in doc["definitions"]
    [run] = doc["runs"]
    s = run["summary"]
    assert (s["num_requests"], s["completed"], s["failed"], s["incomplete"], s["timeout"]) == (6, 5, 1, 0, 0)
    assert s["total_output_tokens"] == 5 * 5
    assert s["total_input_tokens"] == 5 * 24  # exact prompt lengths, as the server counted them
    assert s["good_requests"] == 5 and s["slo_attainment"] == pytest.approx(5 / 6)
    assert s["cost_per_million_output_usd"] == pytest.approx(0.89 / (s["output_throughput"] * 3600) * 1e6)
    assert s["per_client_output_throughput"] == pytest.approx(s["output_throughput"] / 3)
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "p95_e2el_ms"):
        assert isinstance(s[key], float)
    req = run["requests"]
    assert set(req) == set(REQUEST_ARRAYS)
    assert req["status"].count("failed") == 1
    assert req["error"][req["status"].index("failed")].startswith("HTTP 500")
    ok = [i for i, st in enumerate(req["status"]) if st == "ok"]
    assert all(len(req["itl_s"][i]) == 4 and req["output_tokens"][i] == 5 for i in ok)
    assert run["load"] == {"request_rate": "inf", "burstiness": 1.0, "max_concurrency": 3}
    assert run["server_metrics"]["available"] and run["server_metrics"]["samples"]
    assert any("warm-up" in n for n in doc["notes"])

    md = (tmp_path / "r.md").read_text()
    assert "# inferlab bench: fake run" in md and "| requests ok / failed / incomplete / timeout | 5 / 1 / 0 / 0 |" in md
    assert "GuideLLM and AIPerf call TPOT 'ITL'" in md
    out = capsys.readouterr().out
    assert "concurrency 3" in out and "$ per 1M output tokens" in out


def test_concurrency_levels_run_side_by_side(tmp_path, capsys):
    with FakeOpenAIServer() as srv:
        rc = bench(srv, "--concurrency-levels", "1,4", "--usd-per-hour", "0.89", "--endpoint", "chat",
                   "--result-file", str(tmp_path / "r.json"))
        prompts = [b["messages"][-1]["content"] for b in srv.stats.bodies]
    assert rc == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    validate_report(doc)
    assert doc["mode"] == "concurrency-levels"
    assert [r["load"]["max_concurrency"] for r in doc["runs"]] == [1, 4]
    assert [r["label"] for r in doc["runs"]] == ["concurrency 1", "concurrency 4"]
    assert doc["sweep"]["kind"] == "concurrency" and doc["sweep"]["levels"] == [1.0, 4.0]
    assert len(set(prompts)) == 12  # each level gets fresh prompts: no prefix-cache help from the level before
    out = capsys.readouterr().out
    assert "per-client output (tok/s)" in out and "concurrency 1" in out and "concurrency 4" in out


def test_sweep_writes_latency_and_sweep_plots(tmp_path):
    with FakeOpenAIServer() as srv:
        rc = bench(srv, "--sweep", "rate:50,100", "--plot-dir", str(tmp_path), "--goodput", "e2el:60000",
                   "--result-file", str(tmp_path / "r.json"))
    assert rc == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert [r["load"]["request_rate"] for r in doc["runs"]] == [50.0, 100.0]
    assert doc["sweep"]["distserve_goodput"] == 100.0
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "latency_cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_local_tokenizer_file_is_used_instead_of_the_server(tmp_path):
    from test_bench_datasets import word_level_tokenizer

    word_level_tokenizer(tmp_path)
    with FakeOpenAIServer() as srv:
        rc = bench(srv, "--tokenizer", str(tmp_path / "tokenizer.json"), "--result-file", str(tmp_path / "r.json"))
        assert srv.stats.tokenize_calls == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0 and doc["tokenizer"].endswith("tokenizer.json")
    assert doc["runs"][0]["summary"]["total_input_tokens"] == 6 * 24


def test_all_requests_failing_gives_exit_status_1():
    with FakeOpenAIServer(("http500",)) as srv:
        assert bench(srv) == 1


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--goodput", "ttft=5"], "--goodput takes KEY:MS"),
        (["--num-prompts", "0"], "--num-prompts must be >= 1"),
        (["--sweep", "rate", "--request-rate", "3"], "drop --request-rate"),
        (["--concurrency-levels", "1,x"], "--concurrency-levels"),
        (["--input-len", "5000"], "exceeds the model's context of 4096"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    with FakeOpenAIServer() as srv:
        rc = bench(srv, *args)
        assert srv.stats.chat_or_completion_requests == 0
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("url, message", [("localhost:8000", "--base-url must look like"), (None, "cannot reach the server")])
def test_bad_or_unreachable_server_is_one_line(url, message, capsys):
    url = url or f"http://127.0.0.1:{_closed_port()}"
    rc = main(["bench", "--base-url", url, "--num-prompts", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1


def test_bench_imports_no_torch():
    code = "import sys, inferlab.bench.cli, inferlab.bench.plots; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


@pytest.mark.slow
def test_without_tokenize_route_the_default_models_tokenizer_is_used(tmp_path):
    with FakeOpenAIServer(tokenize=False) as srv:
        rc = bench(srv, "--num-prompts", "2", "--result-file", str(tmp_path / "r.json"))
    doc = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0 and doc["tokenizer"].endswith(".gguf")
    assert doc["dataset"]["lengths"]["prompt_tokens"] == {"mean": 24.0, "min": 24, "max": 24}
