"""What the benchmark scripts share: a server process on a free loopback port, started in its
own process group, waited for, and always stopped.

    with served(["inferlab", "serve", "--port", str(port)], f"http://127.0.0.1:{port}", log) as srv: ...

Scripts import it by name (`from harness import ...`): running `python benchmarks/X.py` puts
benchmarks/ on the path.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

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


def stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the server's whole process group (vLLM runs its engine in a child), then SIGKILL
    whatever is left; returns only when no process of the group remains."""
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
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


@dataclass
class RunningServer:
    base_url: str
    proc: subprocess.Popen
    ready_s: float  # from the start of the process to ready
    log_path: Path


@contextlib.contextmanager
def served(argv: Sequence[str], base_url: str, log_path: Path, *, env: Mapping[str, str] | None = None,
           timeout_s: float = 600.0) -> Iterator[RunningServer]:
    """Start `argv` (a server listening at `base_url`) in its own process group, logging to
    `log_path`; yield once it serves; always stop the whole group."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(list(argv), env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        try:
            ready = wait_ready(proc, base_url, timeout_s, log_path)
            yield RunningServer(base_url, proc, ready, log_path)
        finally:
            stop_group(proc)
