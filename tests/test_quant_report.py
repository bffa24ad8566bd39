"""`inferlab quant-report` on a tiny model: the float32 base against itself (KLD ~0, the same top
token everywhere), a lossy mode (int8 weights) visibly off it, the table, the PNG, the JSON, the
speed figures, and one-line refusals of bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from inferlab.cli import main
from inferlab.config import KV_CACHE_DTYPES, WEIGHT_DTYPES
from inferlab.models.testing import make_tiny_hf_model
from inferlab.quality.report_modes import available_modes, parse_list, plan_modes
from inferlab.quality.report_render import COLUMNS, same_scores

N_CTX = 32
SMALL = ["-c", str(N_CTX), "-b", str(2 * N_CTX), "--chunks", "3", "--streams", "4", "--prompt-tokens", "8",
         "--output-tokens", "4", "--speed-runs", "1", "-t", "1"]


@pytest.fixture(autouse=True, scope="module")
def keep_threads():
    """-t 1 (robust on a loaded machine: two threads' barriers stall when the other is descheduled)
    is process-wide: give the other tests their thread count back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("qr") / "m", seed=0)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    words = "the quick brown fox jumps over the lazy dog while a model predicts the next token".split()
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(" ".join(np.random.default_rng(0).choice(words, 300)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def report(model, text, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    argv = ["quant-report", "-m", str(model), "-f", str(text), *SMALL, "--weight-dtypes", "float32,int8",
            "--kv-cache-dtypes", "none", "--markdown", str(out / "q.md"), "--png", str(out / "q.png"),
            "--json", str(out / "q.json")]
    assert main(argv) == 0
    return out


def test_the_modes_are_the_config_tuples_minus_auto():
    weights, kv = available_modes()
    assert weights == [w for w in WEIGHT_DTYPES if w != "auto"] and "int8" in weights
    assert kv == [k for k in KV_CACHE_DTYPES if k != "auto"] and "float32" in kv
    assert parse_list(None, weights, "weight dtype") == weights
    assert parse_list("none", kv, "K/V cache dtype") == []


def test_rows_resolve_through_the_loader_and_duplicates_are_skipped():
    rows, skipped = plan_modes(*available_modes())
    assert rows[0].kind == "base" and rows[0].key == ("float32", "float32", "float32")
    assert len({r.key for r in rows}) == len(rows)
    measured = {r.label for r in rows} | {s.label for s in skipped}
    weights, kv = available_modes()
    assert measured == {"base float32"} | {f"weights {w}" for w in weights} | {f"K/V {k}" for k in kv}
    assert all(s.reason for s in skipped)


@pytest.mark.parametrize("n_ctx, batch", [(512, 2048), (512, 512), (32, 64), (4096, 4096), (2048, 8192), (4, 4096)])
def test_scoring_steps_are_decode_sized_and_the_scored_half_reads_the_cache(n_ctx, batch):
    from inferlab.kernels.linear import MKL_MIN_ROWS
    from inferlab.quality.quant_report import ReportSettings

    s = ReportSettings(None, "t.txt", n_ctx=n_ctx, batch_size=batch)
    assert s.chunks_per_step * s.piece < MKL_MIN_ROWS and 1 <= s.piece <= n_ctx // 2


def test_a_mode_the_cpu_lacks_is_skipped_with_the_loaders_reason(monkeypatch):
    from inferlab.kernels import build

    monkeypatch.setattr(build, "kernel_info", lambda: build.KernelInfo("none", (), "turned off by INFERLAB_KERNELS=0"))
    rows, skipped = plan_modes(["int8", "w8a8"], [])
    assert [r.label for r in rows] == ["base float32", "weights int8"]
    assert [s.label for s in skipped] == ["weights w8a8"] and "integer dot product" in skipped[0].reason


def test_table_base_row_and_lossy_rows(report):
    doc = json.loads((report / "q.json").read_text())
    rows = {r["label"]: r for r in doc["rows"]}
    assert list(rows) == ["base float32", "weights float32", "weights int8"]
    base, f32, int8 = rows["base float32"], rows["weights float32"], rows["weights int8"]
    assert abs(base["kld_mean"]) < 1e-9 and base["same_top_pct"] == 100.0 and abs(base["ppl_change_pct"]) < 1e-9
    # float32 weights with the auto (float16) K/V: only the cache differs from the base, and the
    # scored tokens read it back (two-step prefill), so its KLD is small but not 0.
    assert f32["weights"] == "float32" and f32["kv"] == "float16" and f32["weight_bytes"] == base["weight_bytes"]
    assert 1e-10 < f32["kld_mean"] < int8["kld_mean"] / 100
    assert f32["kv_bytes_per_token"] == base["kv_bytes_per_token"] / 2
    assert int8["kld_mean"] > 1e-5 and int8["same_top_pct"] < 100 and int8["weights"] == "int8"
    assert int8["weight_bytes"] < base["weight_bytes"] / 2
    for r in doc["rows"]:
        assert r["decode_tps_1"] > 0 and r["decode_tps_n"] > 0 and r["precision"].startswith("weights ")
    assert doc["text"]["chunks"] == 3 and doc["machine"]["kernels"] and doc["machine"]["load_average_start"]
    md = (report / "q.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| mode"))
    assert [c.strip() for c in header.strip("|").split("|")] == [c.format(n=4) for c in COLUMNS]
    for label in rows:
        assert f"| {label} |" in md
    assert "Kernel paths" in md and "load average" in md


def test_rows_that_score_alike_are_explained():
    """Same weights, another K/V dtype, the same PPL and KLD: the report says why, once per pair;
    rows that differ, or differ in weights, get no such line."""
    def row(label, weights, kv, ppl, kld):
        return {"label": label, "weights": weights, "kv": kv, "ppl": ppl, "kld_mean": kld}

    doc = {"rows": [row("K/V float32", "bfloat16", "float32", 11.9139, 0.000189),
                    row("K/V bfloat16", "bfloat16", "bfloat16", 11.9139, 0.000189),
                    row("K/V int8", "bfloat16", "int8", 11.9312, 0.001034),
                    row("weights float16", "float16", "float16", 11.9139, 0.000189)]}
    lines = same_scores(doc)
    assert len(lines) == 1 and lines[0].startswith("- K/V float32 and K/V bfloat16 score alike")
    assert "rounded to bf16" in lines[0]


def test_png_written(report):
    assert (report / "q.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("flag, value, needle", [("--weight-dtypes", "int3", "'int3'"),
                                                 ("--kv-cache-dtypes", "fp8", "'fp8'")])
def test_unknown_mode_is_a_one_line_error(model, text, capsys, flag, value, needle):
    assert main(["quant-report", "-m", str(model), "-f", str(text), flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "offers" in err


def test_text_too_short_names_the_token_counts(model, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("the quick brown fox", encoding="utf-8")
    argv = ["quant-report", "-m", str(model), "-f", str(short), *SMALL, "--weight-dtypes", "none",
            "--kv-cache-dtypes", "none"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "tokens" in err and f"needs at least {2 * N_CTX}" in err


def test_the_modes_take_turns_at_the_speed_runs(monkeypatch):
    """A spell of host load lands on every mode alike: round r runs every mode once, the order
    reversed every other round, and each engine is freed before the next is built (one model in
    memory at a time)."""
    from inferlab.quality import report_speed

    built, order, live = [], [], set()

    class Engine:
        def __init__(self, label):
            assert not live, "an engine was built while another was still held"
            self.label = label
            live.add(label)

        def __del__(self):
            live.discard(self.label)

    def build(label):
        built.append(label)
        return Engine(label)

    def speed_run(llm, settings):
        order.append(llm.label)
        return {"a": 10.0, "b": 20.0, "c": 30.0}[llm.label] + len(order), 100.0

    monkeypatch.setattr(report_speed, "speed_run", speed_run)
    settings = report_speed.SpeedSettings(streams=2, prompt_tokens=4, output_tokens=2, runs=3)
    speeds, seconds = report_speed.alternated_speeds(["a", "b", "c"], build, settings)
    assert order == built == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert speeds["a"].one_stream_runs == [11.0, 16.0, 17.0] and speeds["a"].one_stream == 16.0
    assert speeds["c"].streams == 100.0 and set(seconds) == {"a", "b", "c"}
