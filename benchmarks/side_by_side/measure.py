"""Running the servers and the bench: one server at a time, a fresh seed per run, a warm-up after
each start, and the share of the CPU that other processes took during every run."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import CpuWatch, RunningServer, ServerFailed, free_port, served

from side_by_side.systems import System
from side_by_side.systems.base import inferlab_command
from side_by_side.workloads import FIGURES, Workload, fmt, get, prompt_tokens

WARMUP_SEED = 990_000  # warm-up prompts: a seed range the measured runs never reach


@dataclass
class Measurement:
    """One `inferlab bench` run against one system: the figures and how quiet the machine was."""

    system: str
    workload: str
    repeat: int
    seed: int
    command: str
    wall_s: float
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    other_cpu_share: float
    summary: dict[str, Any] | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.summary is not None and self.error is None


class Session:
    """State shared by all runs: the work directory, fresh seeds, the log of commands and notes,
    and what each server reported of itself."""

    def __init__(self, args: argparse.Namespace, work: Path, tokenizer: str) -> None:
        self.args = args
        self.work = work
        self.tokenizer = tokenizer
        self.commands: list[str] = []
        self.notes: list[str] = []
        self.warnings: list[str] = []
        self.failed: dict[str, str] = {}  # system → why it could not start
        self.measurements: list[Measurement] = []
        self.server_info: dict[str, dict[str, Any]] = {}  # system → its first `read_info`
        self._seed = args.seed

    def next_seed(self) -> int:
        """A seed no run of this session used: repeated prompts would hit the servers' prefix caches."""
        self._seed += 1
        return self._seed

    def log_command(self, cmd: str) -> None:
        self.commands.append(cmd)
        print(f"$ {cmd}", flush=True)

    def note(self, line: str) -> None:
        self.notes.append(line)
        print(line, flush=True)

    def warn(self, line: str) -> None:
        self.warnings.append(line)
        print(f"WARNING: {line}", flush=True)


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


@contextlib.contextmanager
def running_server(system: System, slots: int, session: Session) -> Iterator[RunningServer]:
    """Start `system` on a free loopback port, wait until it serves, note what it says of itself,
    and always stop it."""
    port = free_port()
    spec = system.server(port, slots)
    session.log_command(spec.shown())
    log_path = session.work / f"server-{len(session.commands):03d}-{slug(system.name)}.log"
    with served(spec.argv, f"http://127.0.0.1:{port}", log_path, env=spec.env,
                timeout_s=system.ready_timeout_s) as server:
        session.note(f"[{system.name}] ready in {server.ready_s:.1f} s ({slots} slot{'s' if slots > 1 else ''}); "
                     f"log {log_path}")
        info = system.read_info(server.base_url)
        if info is not None and system.name not in session.server_info:
            session.server_info[system.name] = info
            summary = (info.get("precision") or {}).get("summary")
            session.note(f"[{system.name}] the server reports: {summary or json.dumps(info.get('precision'))}")
        yield server


def wait_for_quiet(session: Session, server_pgid: int) -> None:
    """--wait-quiet: before a run, wait (up to that many seconds) for 2 s in which other processes
    took at most --warn-other of the CPU; our idle server and this script do not count."""
    deadline = time.monotonic() + session.args.wait_quiet
    while time.monotonic() < deadline:
        with CpuWatch(server_pgid) as watch:
            time.sleep(2.0)
        if watch.other_share <= session.args.warn_other:
            return
    session.note(f"waited {session.args.wait_quiet:.0f} s for a quiet machine in vain; measuring anyway")


def bench_argv(base_url: str, w: Workload, seed: int, result: Path, tokenizer: str) -> list[str]:
    return [*inferlab_command(), "bench", "--base-url", base_url, "--endpoint", "completions", "--tokenizer", tokenizer,
            "--dataset", "random", "--input-len", str(w.input_len), "--output-len", str(w.output_len),
            "--num-prompts", str(w.num_prompts), "--max-concurrency", str(w.concurrency), "--ignore-eos",
            "--seed", str(seed), "--no-progress", "--result-file", str(result)]


def run_bench(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """The bench as a child process; one that overruns its time is a failed run (status 124)."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"the bench ran past {timeout_s:.0f} s")


def read_summary(path: Path) -> dict[str, Any]:
    """The one run's summary from an `inferlab bench` JSON report, its schema checked by the bench."""
    from inferlab.bench.report import validate_report

    doc = json.loads(path.read_text())
    validate_report(doc)
    return doc["runs"][0]["summary"]


def _outcome(res: subprocess.CompletedProcess, result: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(summary, error) of one bench run: a failed bench is an error string, never an exception."""
    summary, error = None, None
    if result.is_file():
        try:
            summary = read_summary(result)
        except (ValueError, KeyError, json.JSONDecodeError) as e:
            error = f"unreadable report: {e}"
    if summary is not None and not summary.get("completed"):
        error = "no request completed: " + "; ".join(summary.get("errors") or {"?": 0})
    elif summary is None and error is None:
        tail = [ln for ln in (res.stderr or res.stdout).splitlines() if ln.strip()]
        error = f"bench exited with status {res.returncode}: {tail[-1][:200] if tail else ''}"
    return summary, error


def measure(session: Session, server: RunningServer, system: System, w: Workload, repeat: int) -> Measurement:
    """One bench run, recorded with how busy the rest of the machine was."""
    seed = session.next_seed()
    result = session.work / f"bench-{slug(system.name)}-{w.key}-r{repeat + 1}-s{seed}.json"
    argv = bench_argv(server.base_url, w, seed, result, session.tokenizer)
    if session.args.wait_quiet > 0:
        wait_for_quiet(session, server.proc.pid)
    session.log_command(shlex.join(argv))
    with CpuWatch(server.proc.pid) as watch:
        res = run_bench(argv, session.args.bench_timeout)
    (session.work / (result.stem + ".out")).write_text(res.stdout + res.stderr)
    summary, error = _outcome(res, result)
    m = Measurement(system.name, w.key, repeat, seed, shlex.join(argv), watch.wall_s, watch.load_before,
                    watch.load_after, watch.other_share, summary, error)
    report_measurement(session, m, w)
    session.measurements.append(m)
    return m


def report_measurement(session: Session, m: Measurement, w: Workload) -> None:
    """One line per run; warnings when the machine was busy, the server failed requests, or the
    server counted other prompt lengths than the bench asked for."""
    where = f"[{m.system}] {m.workload} r{m.repeat + 1}"
    quiet = (f"{m.wall_s:.1f} s, load {m.load_before[0]:.2f} → {m.load_after[0]:.2f}, "
             f"other processes {m.other_cpu_share:.0%} of the CPU")
    if not m.ok:
        session.note(f"{where}: {quiet}; FAILED: {m.error}")
        return
    s = m.summary or {}
    figs = ", ".join(f"{f.label} {fmt(f.value(s))}" for f in FIGURES if f.workload == m.workload)
    if m.workload.startswith("sweep"):
        figs = (f"output tok/s {fmt(get(s, 'output_throughput'))}, p95 ITL ms {fmt(get(s, 'p95_itl_ms'))}, "
                f"median TTFT ms {fmt(get(s, 'median_ttft_ms'))}")
    session.note(f"{where}: {quiet}; {figs}")
    cores = os.cpu_count() or 1
    if m.other_cpu_share > session.args.warn_other:
        session.warn(f"{where}: other processes took {m.other_cpu_share:.0%} of the CPU: this figure is suspect")
    if m.load_before[0] > session.args.warn_load * cores:
        session.warn(f"{where}: 1-minute load average {m.load_before[0]:.2f} before the run on {cores} cores")
    if s.get("completed", 0) < s.get("num_requests", 0):
        session.warn(f"{where}: {s['num_requests'] - s['completed']} of {s['num_requests']} requests failed")
    got = prompt_tokens(s)
    if got and abs(got - w.input_len) > 1:
        session.warn(f"{where}: the server counted {got:.1f} prompt tokens per request, not {w.input_len}")
    if s.get("cached_prompt_tokens"):
        session.warn(f"{where}: the server reused {s['cached_prompt_tokens']} prompt tokens from its prefix cache")


def warm_up(session: Session, server: RunningServer, system: System, slots: int) -> None:
    """One unmeasured short run after each start: first-request costs (lazy allocations, kernel
    builds, page faults) are not what any figure measures."""
    w = Workload("warmup", 32, 8, min(2, slots) * session.args.warmup_requests, min(2, slots))
    seed = WARMUP_SEED + session.next_seed()
    path = session.work / f"warmup-{slug(system.name)}-s{seed}.json"
    argv = bench_argv(server.base_url, w, seed, path, session.tokenizer)
    session.log_command(shlex.join(argv))
    res = run_bench(argv, session.args.bench_timeout)
    if res.returncode != 0:
        session.warn(f"[{system.name}] the warm-up failed (status {res.returncode}); measuring anyway")


def run_on(session: Session, system: System, workloads: Sequence[Workload], repeat: int) -> None:
    """Every workload once against `system`, one server start per slot group; a server that fails
    to start marks the system failed (its column then says why) instead of stopping the benchmark."""
    for slots, group in system.slot_groups(workloads):
        if system.name in session.failed:
            return
        try:
            with running_server(system, slots, session) as server:
                if session.args.warmup_requests:
                    warm_up(session, server, system, slots)
                for w in group:
                    measure(session, server, system, w, repeat)
        except ServerFailed as e:
            session.failed[system.name] = str(e)
            session.note(f"[{system.name}] failed to start: {e}")


def alternating(systems: Sequence[System], repeat: int) -> list[System]:
    """A B C … on even repeats, … C B A on odd ones: drift in the machine's speed falls on all alike."""
    return list(systems) if repeat % 2 == 0 else list(reversed(systems))


def run_series(session: Session, systems: Sequence[System], workloads: Sequence[Workload], repeats: int,
               label: str, estimate: Callable[[int], float]) -> None:
    t0 = time.monotonic()
    for rep in range(repeats):
        for system in alternating(systems, rep):
            if system.name not in session.failed:
                run_on(session, system, workloads, rep)
        done = time.monotonic() - t0
        if rep + 1 < repeats:
            left = done / (rep + 1) * (repeats - rep - 1)
            session.note(f"{label}: repeat {rep + 1} of {repeats} took {done / (rep + 1) / 60:.1f} min; about "
                         f"{left / 60:.0f} min left in this part (estimated {estimate(repeats - rep - 1) / 60:.0f})")
