"""The benchmark's results as one JSON document (schema "inferlab.bench/1"), and the terminal
table and Markdown rendered from that document, so all three always say the same thing.

Layout of the JSON (every run is a load level; a single run is a list of one):

    schema, label, created_utc, command_line, config, server{base_url, url, endpoint, model,
    max_model_len}, tokenizer, dataset{..., lengths, notes}, versions{inferlab, python,
    platform, httpx, numpy}, machine{cpu_count, cpu_model}, definitions, mode, warmup_requests,
    runs[{label, load{request_rate, burstiness, max_concurrency}, summary{flat vLLM-style keys},
          server_metrics|null, requests{status, error, http_status, send_s, ttft_s, tpot_s,
          e2e_s, itl_s (list per request), input_tokens, output_tokens, cached_tokens}}],
    sweep|null{kind, levels, automatic, saturated_at, stop_reason, stopped_early, slo_target,
               distserve_goodput}
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferlab.bench.metrics import DEFINITIONS, RunSummary
from inferlab.bench.runner import RunResult

SCHEMA = "inferlab.bench/1"
REQUIRED_KEYS = (
    "schema", "label", "created_utc", "command_line", "config", "server", "dataset", "versions",
    "machine", "definitions", "mode", "runs", "sweep",
)
REQUEST_ARRAYS = ("status", "error", "http_status", "send_s", "ttft_s", "tpot_s", "e2e_s", "itl_s", "input_tokens", "output_tokens", "cached_tokens")


@dataclass
class RunReport:
    """One load level for the report: its label, raw result and summary."""

    label: str
    result: RunResult
    summary: RunSummary


@dataclass
class ReportContext:
    """Everything about the run that is not a measurement."""

    label: str
    command_line: str
    config: dict[str, Any]
    server: dict[str, Any]
    dataset: dict[str, Any]
    tokenizer: str | None = None
    mode: str = "single"  # "single" | "sweep" | "concurrency-levels"
    warmup_requests: int = 0
    notes: list[str] = field(default_factory=list)


def versions() -> dict[str, str]:
    from importlib import metadata

    def v(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "unknown"

    return {
        "inferlab": v("inferlab"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "httpx": v("httpx"),
        "numpy": v("numpy"),
    }


def machine() -> dict[str, Any]:
    """The client machine (the server's may differ: a load generator's own limits show up here)."""
    model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu_count": os.cpu_count(), "cpu_model": model or "unknown", "machine": platform.machine()}


def _r(x: float | None, nd: int = 6) -> float | None:
    return None if x is None else round(x, nd)


def request_arrays(result: RunResult) -> dict[str, list]:
    """Per-request columns, times in seconds relative to the run's first send."""
    recs, t0 = result.records, result.start_time
    return {
        "status": [r.status.value for r in recs],
        "error": [r.error for r in recs],
        "http_status": [r.http_status for r in recs],
        "send_s": [_r(r.send_time - t0) for r in recs],
        "ttft_s": [_r(r.ttft) for r in recs],
        "tpot_s": [_r(r.tpot) for r in recs],
        "e2e_s": [_r(r.e2e) for r in recs],
        "itl_s": [[_r(g) for g in r.itls] for r in recs],
        "input_tokens": [r.prompt_tokens for r in recs],
        "output_tokens": [r.output_tokens for r in recs],
        "cached_tokens": [r.cached_tokens for r in recs],
    }


def build_report(ctx: ReportContext, runs: Sequence[RunReport], sweep: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON document."""
    return {
        "schema": SCHEMA,
        "label": ctx.label,
        "created_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command_line": ctx.command_line,
        "config": ctx.config,
        "server": ctx.server,
        "tokenizer": ctx.tokenizer,
        "dataset": ctx.dataset,
        "versions": versions(),
        "machine": machine(),
        "definitions": DEFINITIONS,
        "mode": ctx.mode,
        "warmup_requests": ctx.warmup_requests,
        "notes": list(ctx.notes),
        "runs": [
            {
                "label": run.label,
                "load": run.result.load.to_dict(),
                "summary": run.summary.to_dict(),
                "server_metrics": run.result.server_metrics.to_dict() if run.result.server_metrics else None,
                "requests": request_arrays(run.result),
            }
            for run in runs
        ],
        "sweep": sweep,
    }


def validate_report(doc: dict[str, Any]) -> None:
    """Check a document has this schema's shape (ValueError naming the first problem)."""
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"not an {SCHEMA} document (schema = {doc.get('schema')!r})")
    for key in REQUIRED_KEYS:
        if key not in doc:
            raise ValueError(f"report lacks {key!r}")
    if not isinstance(doc["runs"], list) or not doc["runs"]:
        raise ValueError("report has no runs")
    for i, run in enumerate(doc["runs"]):
        for key in ("label", "load", "summary", "requests"):
            if key not in run:
                raise ValueError(f"runs[{i}] lacks {key!r}")
        n = run["summary"].get("num_requests")
        for col in REQUEST_ARRAYS:
            if len(run["requests"].get(col, ())) != n:
                raise ValueError(f"runs[{i}].requests.{col} does not have {n} entries")


def write_json(doc: dict[str, Any], path: str | Path) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=1, allow_nan=False, default=str) + "\n", encoding="utf-8")


# ---- the table shared by the terminal and Markdown --------------------------------------------


def _fmt(x: Any, nd: int = 1, unit: str = "") -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:,.{nd}f}{unit}"
    return f"{x}{unit}"


def _money(x: float | None) -> str:
    return "—" if x is None else f"${x:,.2f}" if x >= 0.1 else f"${x:,.3f}"


def result_rows(doc: dict[str, Any]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(column headers, [(row name, one cell per run)]) for every renderer."""
    runs = doc["runs"]
    headers = [run["label"] for run in runs]
    S = [run["summary"] for run in runs]
    rows: list[tuple[str, list[str]]] = []

    def row(name: str, cells: list[str]) -> None:
        rows.append((name, cells))

    row("requests ok / failed / incomplete / timeout", [f"{s['completed']} / {s['failed']} / {s['incomplete']} / {s['timeout']}" for s in S])
    row("duration (s)", [_fmt(s["duration_s"], 2) for s in S])
    row("request throughput (req/s)", [_fmt(s["request_throughput"], 2) for s in S])
    row("output throughput (tok/s)", [_fmt(s["output_throughput"], 1) for s in S])
    if any(s["per_client_output_throughput"] is not None for s in S):
        row("per-client output (tok/s)", [_fmt(s["per_client_output_throughput"], 1) for s in S])
    row("total token throughput (tok/s)", [_fmt(s["total_token_throughput"], 1) for s in S])
    row("input / output tokens", [f"{s['total_input_tokens']:,} / {s['total_output_tokens']:,}" for s in S])
    names = [("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E")]
    pct_keys = sorted({k.split("_", 1)[0] for s in S for k in s if k.startswith("p") and k.endswith("_ms")}, key=lambda k: float(k[1:]))
    for key, title in names:
        if f"mean_{key}_ms" not in S[0]:
            continue
        row(f"{title} mean / median (ms)", [f"{_fmt(s[f'mean_{key}_ms'], 2)} / {_fmt(s[f'median_{key}_ms'], 2)}" for s in S])
        for pk in pct_keys:
            if pk != "p50" and f"{pk}_{key}_ms" in S[0]:  # p50 is the median, already shown
                row(f"{title} {pk} (ms)", [_fmt(s.get(f"{pk}_{key}_ms"), 2) for s in S])
    if any(s["request_goodput"] is not None for s in S):
        row("goodput (req/s)", [_fmt(s["request_goodput"], 2) for s in S])
        row("SLO attainment", [_fmt(None if s["slo_attainment"] is None else 100 * s["slo_attainment"], 1, "%") for s in S])
    if any(s["usd_per_hour"] is not None for s in S):
        row("$ per 1M output tokens", [_money(s["cost_per_million_output_usd"]) for s in S])
        row("$ per 1M input tokens", [_money(s["cost_per_million_input_usd"]) for s in S])
    for gauge, title in (("running", "server running (mean/max)"), ("waiting", "server waiting (mean/max)"), ("kv_cache_usage", "server KV usage (mean/max)")):
        cells, any_value = [], False
        for run in runs:
            g = ((run.get("server_metrics") or {}).get("gauges") or {}).get(gauge)
            if g:
                any_value = True
                pct = gauge == "kv_cache_usage"
                cells.append(f"{g['mean'] * (100 if pct else 1):.1f}{'%' if pct else ''} / {g['max'] * (100 if pct else 1):.1f}{'%' if pct else ''}")
            else:
                cells.append("—")
        if any_value:
            row(title, cells)
    specs = [(run.get("server_metrics") or {}).get("speculative") for run in runs]
    if any(specs):
        row("spec decode acceptance rate", [_fmt(None if sp is None else 100 * sp["acceptance_rate"], 1, "%") for sp in specs])
        row("spec decode mean acceptance length", [_fmt(None if sp is None else sp["mean_acceptance_length"], 2) for sp in specs])
        row("spec decode acceptance per position", ["—" if sp is None else " / ".join(f"{a:.2f}" for a in sp["acceptance_per_position"])
                                                    for sp in specs])
    return headers, rows


def _header_lines(doc: dict[str, Any]) -> list[str]:
    srv, ds = doc["server"], doc["dataset"]
    lines = [f"{srv.get('model')} at {srv.get('url')}"]
    desc = f"dataset {ds.get('name')}, {ds.get('num_prompts')} prompts"
    if ds.get("name") in ("random", "shared-prefix"):
        desc += f", input {ds.get('input_len')} / output {ds.get('output_len')} tokens"
        if ds.get("range_ratio"):
            desc += f" (range ratio {ds['range_ratio']})"
        if ds.get("prefix_len"):
            desc += f", {ds.get('num_prefixes')} shared prefix(es) of {ds['prefix_len']} tokens"
    if doc["config"].get("ignore_eos"):
        desc += ", ignore_eos"
    lines.append(desc)
    summary0 = doc["runs"][0]["summary"]
    slo = summary0.get("slo") or {}
    if any(v is not None for v in slo.values()):
        lines.append("SLO: " + ", ".join(f"{k.removesuffix('_ms')} ≤ {v:g} ms" for k, v in slo.items() if v is not None))
    if summary0.get("usd_per_hour") is not None:
        lines.append(f"cost at ${summary0['usd_per_hour']:g}/hour: usd_per_hour / (tokens/s × 3600) × 1e6")
    return lines


def _sweep_lines(doc: dict[str, Any]) -> list[str]:
    sw = doc.get("sweep")
    if not sw:
        return []
    unit = "req/s" if sw["kind"] == "rate" else "clients"
    lines = []
    if sw["saturated_at"] is not None:
        lines.append(f"saturated at {sw['saturated_at']:g} {unit}: {sw['stop_reason']}")
    else:
        lines.append("no saturation seen at the levels run")
    if sw["distserve_goodput"] is not None:
        lines.append(f"DistServe goodput: {sw['distserve_goodput']:g} {unit} (SLO attainment ≥ {sw['slo_target']:.0%})")
    elif any(run["summary"]["slo_attainment"] is not None for run in doc["runs"]):
        lines.append(f"DistServe goodput: no level reached {sw['slo_target']:.0%} SLO attainment")
    return lines


def _cache_lines(doc: dict[str, Any]) -> list[str]:
    """Prefix-cache hits the server reported: wanted with shared prefixes, a warning otherwise
    (random prompts repeat for the same --seed, so an earlier run can warm the cache for this one)."""
    ds = doc["dataset"]
    unintended = ds.get("name") == "random" and not ds.get("prefix_len")  # shared prefixes are meant to hit
    lines = []
    for run in doc["runs"]:
        s = run["summary"]
        if s.get("cached_prompt_tokens"):
            line = (f"{run['label']}: the server reused {s['cached_prompt_tokens']:,} of {s['total_input_tokens']:,} "
                    f"prompt tokens from its prefix cache ({s['cached_requests']} requests)")
            if unintended:
                line += "; random prompts repeat for the same --seed, so an earlier run may have warmed the cache (try another --seed)"
            lines.append(line)
    return lines


def render_markdown(doc: dict[str, Any]) -> str:
    headers, rows = result_rows(doc)
    out = [f"# inferlab bench: {doc['label']}", ""]
    out += [f"- {line}" for line in _header_lines(doc)]
    out += [f"- {doc['created_utc']}, inferlab {doc['versions']['inferlab']}, client: {doc['machine']['cpu_count']} × {doc['machine']['cpu_model']}", ""]
    out += ["| | " + " | ".join(headers) + " |", "|---|" + "---|" * len(headers)]
    out += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows]
    out.append("")
    extra = _sweep_lines(doc) + _cache_lines(doc) + list(doc.get("notes") or []) + list(doc["dataset"].get("notes") or [])
    out += [f"- {line}" for line in extra]
    out += ["", f"_{doc['definitions']}_", "", f"`{doc['command_line']}`", ""]
    return "\n".join(out)


def print_terminal(doc: dict[str, Any], console: Any | None = None) -> None:
    """The results table with rich; one column per load level (the seed's 1-vs-32 comparison)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    headers, rows = result_rows(doc)
    table = Table(title=f"inferlab bench: {doc['label']}", caption=doc["definitions"], caption_justify="left")
    table.add_column("", style="bold")
    for h in headers:
        table.add_column(h, justify="right")
    for name, cells in rows:
        table.add_row(name, *cells)
    for line in _header_lines(doc):
        console.print(line)
    console.print(table)
    for line in _sweep_lines(doc) + _cache_lines(doc) + list(doc.get("notes") or []) + list(doc["dataset"].get("notes") or []):
        console.print(f"• {line}")
