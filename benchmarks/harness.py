"""What the benchmark scripts share: a server process on a free loopback port, started in its
own process group, waited for, and always stopped; and how busy the rest of the machine was.

    with served(["inferlab", "serve", "--port", str(port)], f"http://127.0.0.1:{port}", log) as srv: ...

Scripts import it by name (`from harness import ...`): running `python benchmarks/X.py` puts
benchmarks/ on the path.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx


class ServerFailed(RuntimeError):
    """A server that exited or never became ready; the message says why."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_log_line(path: Path) -> str:
    """The last line of a server log that says something, for a failure's reason."""
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:200] if lines else ""


def exit_reason(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def wait_ready(proc: subprocess.Popen, base: str, timeout_s: float, log_path: Path) -> float:
    """Poll /health, then /v1/models, until both answer 200 (llama-server answers 503 while it
    loads); returns the seconds it took. ServerFailed when the process dies or time runs out."""
    t0 = time.monotonic()
    while True:
        try:
            if (httpx.get(base + "/health", timeout=2).status_code == 200
                    and httpx.get(base + "/v1/models", timeout=5).status_code == 200):
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        code = proc.poll()
        if code is not None:
            raise ServerFailed(f"{exit_reason(code)}: {last_log_line(log_path)}")
        if time.monotonic() - t0 > timeout_s:
            raise ServerFailed(f"not ready after {timeout_s:.0f} s: {last_log_line(log_path)}")
        time.sleep(0.05)


def unwind_on_sigterm() -> None:
    """SIGTERM (`timeout`, a killed parent job) unwinds like Ctrl-C, so every `finally` stops its
    server: by default Python dies on it at once and leaves the servers running (or frozen)."""
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the server's whole process group (vLLM runs its engine in a child), then SIGKILL
    whatever is left; returns only when no process of the group remains."""
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
        os.killpg(pgid, signal.SIGCONT)  # a frozen group (spec_decode_vllm's) acts on its SIGTERM only once resumed
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def server_info(base_url: str) -> dict[str, Any] | None:
    """inferlab's `GET /server_info`: what the engine resolved (its precision, kernels, KV
    blocks), so that no figure guesses it from the flags the server was started with; None from
    a server that has no such route (llama-server, vLLM) or does not answer."""
    try:
        r = httpx.get(base_url + "/server_info", timeout=10)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


@dataclass
class RunningServer:
    base_url: str
    proc: subprocess.Popen
    ready_s: float  # from the start of the process to ready
    log_path: Path


@contextlib.contextmanager
def served_many(argvs: Sequence[Sequence[str]], base_urls: Sequence[str], log_paths: Sequence[Path], *,
                env: Mapping[str, str] | None = None, timeout_s: float = 600.0,
                grace_s: float = 20.0) -> Iterator[list[RunningServer]]:
    """Start every `argv` (a server listening at its `base_url`) at once, each in its own process
    group logging to its `log_path` (their start-ups overlap); yield once all serve; always stop
    every group."""
    procs: list[subprocess.Popen] = []
    try:
        for argv, log_path in zip(argvs, log_paths):
            with open(log_path, "wb") as log:
                procs.append(subprocess.Popen(list(argv), env={**os.environ, **(env or {})}, stdout=log,
                                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True))  # fmt: skip
        yield [RunningServer(base, proc, wait_ready(proc, base, timeout_s, log_path), log_path)
               for proc, base, log_path in zip(procs, base_urls, log_paths)]  # fmt: skip
    finally:
        for proc in procs:
            stop_group(proc, grace_s)


@contextlib.contextmanager
def served(argv: Sequence[str], base_url: str, log_path: Path, *, env: Mapping[str, str] | None = None,
           timeout_s: float = 600.0) -> Iterator[RunningServer]:
    """One server: `served_many` of one."""
    with served_many([argv], [base_url], [log_path], env=env, timeout_s=timeout_s) as (server,):
        yield server


@contextlib.contextmanager
def routed(launcher: Sequence[str], backends: Sequence[str], log_path: Path, *, env: Mapping[str, str] | None = None,
           options: Sequence[str] = ()) -> Iterator[str]:
    """`inferlab router` (`launcher` runs inferlab) over `backends` on a free port, with `options`;
    yields its base URL once it reports every backend healthy; always stopped."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [*launcher, "router", "--port", str(port), "--log-level", "warning", *options]
    for b in backends:
        cmd += ["--backend", b]
    with served(cmd, base, log_path, env=env, timeout_s=120):
        deadline = time.monotonic() + 60
        while httpx.get(base + "/health", timeout=5).json().get("replicas", {}) != {b: "healthy" for b in backends}:
            if time.monotonic() > deadline:
                raise RuntimeError("the router did not see every replica ready")
            time.sleep(0.2)
        yield base


class CpuWatch:
    """The share of the machine's CPU that *other* processes took while we measured.

    The 1-minute load average lags and counts our own server, so it cannot tell a quiet run from
    a disturbed one; CPU time can: all busy time (/proc/stat) less this script and its finished
    children (the bench client) and less the server's process group (vLLM's engine is a child).
    """

    def __init__(self, server_pgid: int | None = None) -> None:
        self.pgid = server_pgid
        self.tick = os.sysconf("SC_CLK_TCK")

    def _busy_s(self) -> float:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (sum(v[:8]) - v[3] - v[4]) / self.tick  # less idle and iowait

    @staticmethod
    def _ours_s() -> float:
        return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                      resource.getrusage(resource.RUSAGE_CHILDREN)))  # fmt: skip

    def _server_s(self) -> float:
        if self.pgid is None:
            return 0.0
        total = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == self.pgid:  # pgrp
                total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        return total / self.tick

    def __enter__(self) -> CpuWatch:
        self.t0, self.busy0 = time.monotonic(), self._busy_s()
        self.ours0, self.server0 = self._ours_s(), self._server_s()
        self.load_before = os.getloadavg()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = max(time.monotonic() - self.t0, 1e-9)
        self.load_after = os.getloadavg()
        self.client_cores = (self._ours_s() - self.ours0) / self.wall_s
        self.server_cores = (self._server_s() - self.server0) / self.wall_s
        other = (self._busy_s() - self.busy0) / self.wall_s - self.client_cores - self.server_cores
        self.other_share = max(other, 0.0) / (os.cpu_count() or 1)
