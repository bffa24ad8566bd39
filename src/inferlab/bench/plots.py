"""PNG figures from a report document: latency CDFs (one line per load level) and, for a
sweep, throughput, goodput and p95 TTFT against load. Matplotlib with the Agg backend, so
no display is needed; imported only when --plot-dir is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(doc: dict[str, Any]) -> str:
    model = doc["server"].get("model")
    return doc["label"] if doc["label"] == model else f"{doc['label']} ({model})"


def _ok_values(run: dict[str, Any], column: str) -> list[float]:
    req = run["requests"]
    if column == "itl_s":
        return [g for st, gaps in zip(req["status"], req["itl_s"]) if st == "ok" for g in gaps if g is not None]
    return [v for st, v in zip(req["status"], req[column]) if st == "ok" and v is not None]


def plot_latency_cdfs(doc: dict[str, Any], path: Path) -> Path:
    """TTFT, TPOT, ITL and E2E cumulative distributions, in ms."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (col, title) in zip(axes.flat, (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E latency"))):
        for run in doc["runs"]:
            xs = np.sort(np.asarray(_ok_values(run, col), dtype=float)) * 1e3
            if xs.size:
                ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=run["label"])
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if col != "itl_s" else "fraction of gaps")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"{_title(doc)}: latency CDFs")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_sweep(doc: dict[str, Any], path: Path) -> Path:
    """Output throughput and goodput, and p95 TTFT, against the swept load."""
    plt = pyplot()
    sweep = doc["sweep"] or {}
    kind = sweep.get("kind", "concurrency")
    xlabel = "request rate (req/s)" if kind == "rate" else "concurrency (clients)"
    runs = doc["runs"]
    x = [
        (run["load"]["request_rate"] if kind == "rate" else run["load"]["max_concurrency"]) for run in runs
    ]
    out_tps = [run["summary"]["output_throughput"] for run in runs]
    req_tps = [run["summary"]["request_throughput"] for run in runs]
    goodput = [run["summary"]["request_goodput"] for run in runs]
    p95 = [float(np.percentile(v, 95)) * 1e3 if (v := _ok_values(run, "ttft_s")) else float("nan") for run in runs]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    axes[0].plot(x, out_tps, "o-")
    axes[0].set_title("output throughput (tok/s)")
    axes[1].plot(x, req_tps, "o-", label="throughput")
    if any(g is not None for g in goodput):
        axes[1].plot(x, [g if g is not None else float("nan") for g in goodput], "s--", label="goodput")
    axes[1].set_title("requests / s")
    axes[1].legend(fontsize=8)
    axes[2].plot(x, p95, "o-", color="tab:red")
    axes[2].set_title("p95 TTFT (ms)")
    wide = min(x) > 0 and max(x) / min(x) >= 8  # doubling sweeps read best on a log axis
    for ax in axes:
        ax.set_xlabel(xlabel)
        if wide:
            ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        if sweep.get("saturated_at") is not None:
            ax.axvline(sweep["saturated_at"], color="grey", ls=":", lw=1)
    fig.suptitle(f"{_title(doc)}: load sweep")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(doc: dict[str, Any], plot_dir: str | Path) -> list[Path]:
    """All figures that apply to this document; returns the files written."""
    d = Path(plot_dir)
    d.mkdir(parents=True, exist_ok=True)
    written = [plot_latency_cdfs(doc, d / "latency_cdf.png")]
    if len(doc["runs"]) > 1:
        written.append(plot_sweep(doc, d / "sweep.png"))
    return written
