"""Simulated replicas (`inferlab serve --simulate`) for the router tests: in this process
(`sim_servers`: one app per replica under uvicorn threads) or as real processes (`SimProcess`,
which a test can SIGKILL and start again on the same port)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from server_harness import ServerThread

from inferlab.config import CacheConfig, EngineConfig, SchedulerConfig
from inferlab.plan.cost_model import LinearCost
from inferlab.server.app import ServerSettings, build_app
from inferlab.server.sim_engine import SimulatedEngine

ROOT = Path(__file__).resolve().parent.parent

# A step clock that makes queueing visible without making tests slow: 10 ms a step, prefill
# 0.2 ms a token (a 200-token prompt: 50 ms), decode 2 ms a sequence.
FAST = LinearCost(intercept_s=0.01, per_prefill_token_s=0.0002, per_decode_token_s=0.002, per_context_token_s=0.0,
                  source="test step clock")  # fmt: skip


def write_cost(path: Path, cost: LinearCost = FAST) -> Path:
    path.write_text(json.dumps(cost.to_dict()))
    return path


def sim_engine_config(max_num_seqs: int = 8, num_blocks: int = 256) -> EngineConfig:
    return EngineConfig(scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=2048),
                        cache=CacheConfig(num_blocks_override=num_blocks))  # fmt: skip


@contextlib.contextmanager
def sim_servers(n: int, cost: LinearCost = FAST, **config) -> Iterator[list[ServerThread]]:
    """n simulated replicas in this process, each ready."""
    with contextlib.ExitStack() as stack:
        servers = []
        for _ in range(n):
            cfg = sim_engine_config(**config)
            app = build_app(lambda cfg=cfg: SimulatedEngine(cfg, cost), ServerSettings())
            srv = stack.enter_context(ServerThread(app))
            servers.append(srv)
        for srv in servers:
            srv.wait_ready(60)
        yield servers


class SimProcess:
    """`inferlab serve --simulate` in its own process, on a fixed port (so it can come back)."""

    def __init__(self, cost_file: Path, port: int, log: Path, *extra: str):
        self.cmd = [sys.executable, "-m", "inferlab.cli", "serve", "--simulate", str(cost_file), "--port", str(port),
                    "--log-level", "warning", *extra]  # fmt: skip
        self.base_url = f"http://127.0.0.1:{port}"
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> SimProcess:
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"the simulated replica exited: {self.log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"the simulated replica at {self.base_url} did not become ready")

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye; its connections are reset."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
