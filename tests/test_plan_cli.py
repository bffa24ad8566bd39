"""`inferlab plan` and `inferlab simulate` from the command line: JSON, tables, comparisons,
errors as one line, and no torch import."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from inferlab.bench.report import validate_report
from inferlab.cli import main
from inferlab.plan.cost_model import StepSample, write_profile
from inferlab.plan.roofline import StepShape

SEED001 = ["--model", "llama-3.1-8b", "--hardware", "h100", "--input-len", "8192", "--output-len", "256"]


def run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def figures(doc):
    return {f["name"]: f for f in doc["plan"]["figures"]}


def test_plan_json_every_figure_labelled(capsys):
    doc = run_json(capsys, ["plan", *SEED001, "--usd-per-hour", "2", "--json"])
    assert doc["plan"]["schema"] == "inferlab.plan/1"
    f = figures(doc)
    assert f["kv_bytes_per_token"]["value"] == 131072
    assert f["max_sequences"]["value"] == 50
    for fig in doc["plan"]["figures"]:
        assert fig["kind"] in ("computed", "cited", "measured", "simulated")
        assert isinstance(fig["assumptions"], list) and "unit" in fig
    assert doc["plan"]["decode_by_batch"][0]["batch"] == 1


def test_compare_cited_course_001(capsys):
    doc = run_json(capsys, ["plan", "--compare-cited", "course-001", "--json"])
    (cmp,) = doc["comparisons"]
    rows = {r["name"]: r for r in cmp["rows"]}
    assert set(rows) == {"decode_tokens_per_s_single", "max_sequences", "per_user_tokens_per_s", "total_tokens_per_s"}
    assert rows["max_sequences"]["predicted"]["value"] == 50
    assert rows["max_sequences"]["ratio"] == 1.0
    single = rows["decode_tokens_per_s_single"]
    assert single["reference"]["value"] == 147 and single["reference"]["kind"] == "cited"
    assert single["ratio"] == pytest.approx(single["predicted"]["value"] / 147)
    # a roofline is an upper bound: the cited measurement-based figures are below it
    assert all(r["ratio"] >= 1.0 for r in cmp["rows"])


def test_compare_cited_course_000_prices(capsys):
    doc = run_json(capsys, ["plan", "--compare-cited", "course-000", "--json"])
    rows = {r["name"]: r for r in doc["comparisons"][0]["rows"]}
    assert rows["weight_bytes"]["ratio"] == pytest.approx(633_303_040 / (610 * 2**20))
    assert rows["cost_per_million_tokens"]["reference"]["value"] == 0.05
    f = figures(doc)
    assert f["cost_per_million_tokens_single"]["value"] == pytest.approx(
        0.89 / (f["decode_tokens_per_s_single"]["value"] * 3600) * 1e6)


def test_plan_table_output(capsys):
    assert main(["plan", *SEED001]) == 0
    out = capsys.readouterr().out
    assert "128 KiB" in out and "sequences that fit" in out and "computed" in out and "cited" in out


@pytest.mark.parametrize("argv, message", [
    (["plan", "--model", "gpt-5", "--hardware", "h100"], "unknown model 'gpt-5'"),
    (["plan", "--model", "llama-3.1-8b"], "--hardware is required"),
    (["plan", "--model", "llama-3.1-8b", "--hardware", "h100", "--reserve-bytes", "lots"], "not a size"),
    (["plan", "--model", "llama-3.1-8b", "--hardware", "h100", "--weight-dtype", "q9"], "unknown precision"),
    (["plan", "--model", "llama-3.1-8b", "--hardware", "h100", "--hardware-file", "x.json"], "one of"),
    (["simulate", "--model", "smollm2-135m", "--input-len", "8"], "--num-blocks"),
])
def test_errors_are_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_reserve_bytes_parse(capsys):
    a = figures(run_json(capsys, ["plan", *SEED001, "--json"]))
    b = figures(run_json(capsys, ["plan", *SEED001, "--reserve-bytes", "2GiB", "--json"]))
    assert a["memory_reserve"]["value"] + 2 * 2**30 == b["memory_reserve"]["value"]


@pytest.mark.parametrize("argv", [
    ["plan", "--model", "llama-3.1-8b", "--hardware", "h100", "--json"],
    ["simulate", "--model", "smollm2-135m", "--num-blocks", "64", "--block-size", "4", "--input-len", "8",
     "--output-len", "4", "--num-prompts", "2", "--constant-step-ms", "1", "--json"],
])
def test_plan_and_simulate_do_not_import_torch(argv):
    code = f"import sys; from inferlab.cli import main; main({argv!r}); sys.exit(3 if 'torch' in sys.modules else 0)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_simulate_constant_cost_writes_a_bench_report(tmp_path, capsys):
    path = tmp_path / "sim.json"
    argv = ["simulate", "--model", "smollm2-135m", "--num-blocks", "64", "--block-size", "4", "--input-len", "8",
            "--output-len", "4", "--max-concurrency", "2", "--num-prompts", "4", "--constant-step-ms", "10",
            "--result-file", str(path), "--json"]
    doc = run_json(capsys, argv)
    validate_report(doc)
    assert doc["runs"][0]["summary"]["mean_ttft_ms"] == pytest.approx(10.0)
    assert json.loads(path.read_text())["schema"] == "inferlab.bench/1"
    # and the planner compares against it, taking lengths and concurrency from the report
    cmp = run_json(capsys, ["plan", "--model", "smollm2-135m", "--hardware", "l4", "--compare", str(path), "--json"])
    (c,) = cmp["comparisons"]
    assert cmp["plan"]["inputs"]["input_len"] == 8
    rows = {r["name"]: r for r in c["rows"]}
    assert rows["ttft"]["reference"]["value"] == pytest.approx(0.010)
    assert rows["ttft"]["reference"]["kind"] == "simulated"
    assert rows["ttft"]["ratio"] == pytest.approx(rows["ttft"]["predicted"]["value"] / 0.010)


def test_simulate_roofline_on_builtin_hardware(capsys):
    doc = run_json(capsys, ["simulate", "--model", "smollm2-135m", "--hardware", "l4", "--input-len", "64",
                            "--output-len", "8", "--max-concurrency", "4", "--num-prompts", "8", "--json"])
    sim = doc["simulation"]
    assert sim["cost_model"] == "RooflineCost" and sim["cost_model_kind"] == "computed"
    assert doc["config"]["num_blocks"] > 1000  # 24 GB less a 270 MB model, in 16-token blocks
    assert doc["runs"][0]["summary"]["completed"] == 8


def test_simulate_calibrate(tmp_path, capsys):
    samples = [StepSample(StepShape(p, d, 1, c, 0), 0.001 + 2e-5 * p + 3e-4 * d + 1e-8 * c)
               for p, d, c in [(64, 0, 64), (0, 4, 300), (0, 2, 100), (32, 2, 200), (128, 1, 500)]]
    write_profile(samples, tmp_path / "profile.json")
    argv = ["simulate", "--model", "smollm2-135m", "--num-blocks", "64", "--block-size", "4", "--input-len", "8",
            "--output-len", "4", "--max-concurrency", "1", "--num-prompts", "2",
            "--calibrate", str(tmp_path / "profile.json"), "--save-cost-model", str(tmp_path / "cost.json"), "--json"]
    doc = run_json(capsys, argv)
    assert doc["simulation"]["cost_model"] == "LinearCost"
    assert doc["simulation"]["cost_model_kind"] == "measured"
    # first token: one prefill step of 8 tokens reading 8 → 1 ms + 8·20 µs + 8·10 ns
    assert doc["runs"][0]["summary"]["median_ttft_ms"] == pytest.approx(1.0 + 0.16 + 0.00008, rel=1e-6)
    saved = json.loads((tmp_path / "cost.json").read_text())
    assert saved["per_prefill_token_s"] == pytest.approx(2e-5, rel=1e-6)


def test_measure_cpu_flag_labels_figures_measured_and_caches(tmp_path, capsys, monkeypatch):
    from inferlab.plan import measure
    from inferlab.plan.hardware import HardwareSpec

    fake = HardwareSpec("this CPU", 8e9, 40e9, {"bf16": 8e11, "fp32": 2e11}, "measured", "measured here")
    monkeypatch.setattr(measure, "measure_cpu", lambda threads=None: fake)
    cache = tmp_path / "cpu.json"
    doc = run_json(capsys, ["plan", "--model", "smollm2-135m", "--measure-cpu", "--save-hardware", str(cache),
                            "--input-len", "128", "--output-len", "128", "--json"])
    f = figures(doc)
    assert f["memory_bandwidth"]["kind"] == "measured" and f["memory_bandwidth"]["value"] == 40e9
    assert f["compute_peak"]["value"] == 8e11
    # the cached profile is read back with --hardware-file
    again = run_json(capsys, ["plan", "--model", "smollm2-135m", "--hardware-file", str(cache), "--json"])
    assert figures(again)["memory_bandwidth"]["kind"] == "measured"


def test_seed001_benchmark_script_prints_the_cited_comparison():
    import os
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "plan_seed001.py"
    proc = subprocess.run([sys.executable, str(script), "--num-prompts", "60"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    for cited in ("147 tokens/s", "50 sequences", "41 tokens/s", "2,031 tokens/s"):
        assert cited in proc.stdout
    assert "1.42" in proc.stdout  # 208 computed / 147 cited
