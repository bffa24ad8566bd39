"""Predicted against cited or measured: one row per figure, with the ratio predicted / reference.

A bench report (schema "inferlab.bench/1", from `inferlab bench` or `inferlab simulate`) is
read through its summary's vLLM-style keys; the mapping below says which plan figure each
one corresponds to and how to convert its unit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferlab.plan.figures import Figure, read_json
from inferlab.plan.planner import Plan


@dataclass(frozen=True)
class ComparisonRow:
    name: str
    label: str
    unit: str
    predicted: Figure
    reference: Figure

    @property
    def ratio(self) -> float | None:
        """predicted / reference; None when either is missing or the reference is zero."""
        p, r = self.predicted.value, self.reference.value
        if p is None or r is None or r == 0:
            return None
        return p / r

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "label": self.label,
            "unit": self.unit,
            "predicted": self.predicted.to_dict(),
            "reference": self.reference.to_dict(),
            "ratio": self.ratio,
        }


def compare_figures(plan: Plan, references: list[Figure]) -> list[ComparisonRow]:
    rows = []
    for ref in references:
        pred = plan.figure(ref.name)
        rows.append(ComparisonRow(ref.name, pred.title, pred.unit, pred, ref))
    return rows


# plan figure -> (bench summary key, converter to the plan's unit)
_BENCH_MAP: list[tuple[str, str, Callable[[float], float]]] = [
    # Median, not mean: a closed loop's start-up burst (every client sends at once) dominates the mean.
    ("ttft", "median_ttft_ms", lambda ms: ms / 1000.0),
    ("tpot", "mean_tpot_ms", lambda ms: ms / 1000.0),
    # The median gap between tokens is a decode step with no prefill in it: the plan's
    # decode-only step time and per-user speed.
    ("decode_step_time", "median_itl_ms", lambda ms: ms / 1000.0),
    ("per_user_tokens_per_s", "median_itl_ms", lambda ms: 1000.0 / ms if ms else math.nan),
    ("e2el", "mean_e2el_ms", lambda ms: ms / 1000.0),
    ("total_tokens_per_s_with_prefill", "output_throughput", lambda x: x),
    ("cost_per_million_tokens_with_prefill", "cost_per_million_output_usd", lambda x: x),
]


@dataclass(frozen=True)
class BenchRun:
    """One load level of a bench report, with the workload it ran."""

    label: str
    summary: dict[str, Any]
    input_len: int | None
    output_len: int | None
    max_concurrency: int | None
    request_rate: float | None
    kind: str  # 'measured' (inferlab bench) or 'simulated' (inferlab simulate)
    source: str


def load_bench_runs(path: str | Path) -> list[BenchRun]:
    p, doc = read_json(path)
    if not isinstance(doc, dict) or doc.get("schema") != "inferlab.bench/1":
        raise ValueError(f"{p}: not an inferlab.bench/1 report")
    runs = doc.get("runs")
    if not isinstance(runs, list) or not runs:
        raise ValueError(f"{p}: the report has no runs")
    ds = doc.get("dataset") or {}
    kind = "simulated" if (doc.get("simulation") or (doc.get("config") or {}).get("simulated")) else "measured"
    out = []
    for run in runs:
        load = run.get("load") or {}
        rate = load.get("request_rate")
        rate_f = None if rate in (None, "inf") or (isinstance(rate, float) and math.isinf(rate)) else float(rate)
        out.append(BenchRun(
            label=str(run.get("label", "")),
            summary=run.get("summary") or {},
            input_len=_int_or_none(ds.get("input_len")),
            output_len=_int_or_none(ds.get("output_len")),
            max_concurrency=_int_or_none(load.get("max_concurrency")),
            request_rate=rate_f,
            kind=kind,
            source=f"{p} ({run.get('label', '')})",
        ))
    return out


def _int_or_none(x: Any) -> int | None:
    try:
        return None if x is None else int(x)
    except (TypeError, ValueError):
        return None


def bench_reference_figures(run: BenchRun) -> list[Figure]:
    """The run's summary values as Figures in the plan's units (those present and non-null)."""
    figs = []
    for name, key, conv in _BENCH_MAP:
        raw = run.summary.get(key)
        if raw is None:
            continue
        value = conv(float(raw))
        if isinstance(value, float) and math.isnan(value):
            continue
        how = f"1000 / {key}" if name == "per_user_tokens_per_s" else key
        figs.append(Figure(name, value, "", run.kind, [f"{how} of the run"], run.source))  # type: ignore[arg-type]
    return figs


def compare_plan_to_bench(plan: Plan, run: BenchRun) -> list[ComparisonRow]:
    return compare_figures(plan, bench_reference_figures(run))
