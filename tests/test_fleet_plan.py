"""The fleet plan (`benchmarks/plan_seed001.py --fleet`, `plan.fleet_plan`): closed-form sizes
that can be checked by hand, a simulated search that ends at a size meeting the SLO while the
next smaller one misses, and a Markdown report that labels every figure."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inferlab.bench.metrics import SLO
from inferlab.plan.fleet_plan import FleetSpec, plan_fleet
from inferlab.plan.hardware import builtin_hardware
from inferlab.plan.model_spec import builtin_model


def spec(**kw):
    base = dict(model=builtin_model("llama-3.1-8b"), hardware=builtin_hardware("h100"), input_len=2048,
                output_len=32, request_rate=20.0, slo=SLO(ttft_ms=400, tpot_ms=40), num_prompts=80,
                memory_efficiency=0.7, compute_efficiency=0.5, max_num_batched_tokens=2048)  # fmt: skip
    base.update(kw)
    return FleetSpec(**base)


@pytest.fixture(scope="module")
def plan():
    return plan_fleet(spec())


def test_closed_form_sizes_follow_the_formulas(plan):
    s, rf = plan.spec, plan.spec.plan_inputs().roofline()
    figs = {f.name: f for f in plan.figures}
    assert all(f.kind == "computed" for f in plan.figures)
    prefill = rf.prefill(2048).time_s
    assert figs["prefill_time"].value == pytest.approx(prefill)
    assert figs["prefill_replicas"].value == math.ceil(20.0 * prefill / 0.8)
    assert figs["kv_bytes_per_request"].value == 2048 * 131072  # 2 × 32 layers × 8 heads × 128 × 2 bytes
    assert figs["kv_transfer_time"].value == pytest.approx(2048 * 131072 / (100e9 / 8))
    assert figs["disaggregated_usd_per_hour"].value == pytest.approx(
        (figs["prefill_replicas"].value + figs["decode_replicas"].value) * s.usd_per_hour)


def test_the_simulated_search_stops_at_the_fewest_gpus_that_meet_the_slo(plan):
    for key in ("colocated", "disaggregated"):
        row = plan.chosen[key]
        assert row["slo_attainment"] >= 0.95
        assert row["usd_per_hour"] == pytest.approx(row["replicas"] * 3.0)
    colo = {r["replicas"]: r for r in plan.rows if "colocated" in r["deployment"]}
    n = plan.chosen["colocated"]["replicas"]
    assert n - 1 in colo and colo[n - 1]["slo_attainment"] < 0.95  # one fewer misses
    dis = plan.chosen["disaggregated"]
    assert dis["p99_itl_ms"] < plan.chosen["colocated"]["p99_itl_ms"]  # no prompt chunks between tokens


def test_the_report_labels_every_figure_and_says_how_to_regenerate_it(plan):
    md = plan.markdown("python benchmarks/plan_seed001.py --fleet")
    assert "`python benchmarks/plan_seed001.py --fleet`" in md
    computed_rows = [line for line in md.splitlines() if line.startswith("| ") and "| computed |" in line]
    assert len(computed_rows) == len(plan.figures)
    assert "## Simulated" in md and "20 requests/s" in md and "TTFT≤400 ms, TPOT≤40 ms" in md


def test_a_plan_needs_an_slo_and_a_rate():
    with pytest.raises(ValueError, match="SLO"):
        spec(slo=SLO())
    with pytest.raises(ValueError, match="--rate"):
        spec(request_rate=0.0)


def test_the_seed001_fleet_plan_regenerates_with_one_command(tmp_path):
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "plan_seed001.py"
    out = tmp_path / "fleet.md"
    proc = subprocess.run([sys.executable, str(script), "--fleet", "--fleet-prompts", "60", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert text == proc.stdout.rstrip("\n") + "\n" or text in proc.stdout
    assert "8,192-token prompts, 256-token replies" in text and "10 requests/s" in text
    assert "147 tokens/s" in text and "$3.00 assumed" in text
    assert "**colocated:" in text and "**disaggregated:" in text


def test_inferlab_plan_fleet_prints_and_writes_the_plan(tmp_path, capsys):
    from inferlab.cli import main

    md = tmp_path / "plan.md"
    argv = ["plan", "--model", "llama-3.1-8b", "--hardware", "h100", "--input-len", "2048", "--output-len", "32",
            "--fleet", "--request-rate", "20", "--goodput", "ttft:400", "tpot:40", "--usd-per-hour", "2",
            "--fleet-prompts", "40", "--memory-efficiency", "0.7", "--compute-efficiency", "0.5",
            "--markdown-out", str(md)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "**colocated:" in out and "**disaggregated:" in out and "$2 per GPU-hour" in out
    assert md.read_text() == out.rstrip("\n") or md.read_text() in out


@pytest.mark.parametrize("drop, message", [("--request-rate", "--request-rate"), ("--goodput", "SLO"),
                                           ("--usd-per-hour", "--usd-per-hour")])  # fmt: skip
def test_inferlab_plan_fleet_bad_input_is_one_line(capsys, drop, message):
    from inferlab.cli import main

    args = {"--request-rate": ["5"], "--goodput": ["ttft:400"], "--usd-per-hour": ["2"]}
    argv = ["plan", "--model", "llama-3.1-8b", "--hardware", "h100", "--fleet"]
    for k, v in args.items():
        if k != drop:
            argv += [k, *v]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
