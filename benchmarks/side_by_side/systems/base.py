"""What every measured system is: how to start it, how many slots a workload needs, what one
decode step reads (for the bandwidth ceiling), and how fast it is assumed to be (for the estimate)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from side_by_side.workloads import Workload

REPO = Path(__file__).resolve().parents[3]
BENCH_START_S = 4.0  # the bench client's imports and tokenizer, per invocation


@dataclass(frozen=True)
class ServerSpec:
    """A server start: its command line and the environment variables set on top of ours."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def shown(self) -> str:
        return shlex.join([*(f"{k}={v}" for k, v in self.env.items()), *self.argv])


@dataclass(frozen=True)
class FloorSpec:
    """What one decode step reads, for the bandwidth ceiling: the weights at `weight_dtype` (None:
    the file's own bytes) and the KV cache at `kv_dtype`, or at `kv_bytes_per_token` where the
    server reported its own figure (an int8 cache's scales included)."""

    label: str
    model_file: str
    weight_dtype: str | None
    kv_dtype: str
    kv_bytes_per_token: float | None = None


@dataclass(frozen=True)
class AssumedRates:
    """Rough speeds for the up-front estimate only (../shared/peers/README.md's figures; inferlab's
    from benchmarks/results/bench_crosscheck.md, float32): one-stream decode, prefill and batched
    output tokens/s, and seconds to start."""

    decode_tps: float
    prefill_tps: float
    batched_tps: float
    start_s: float


@dataclass(frozen=True)
class System:
    """A server we measure. Subclasses say how to start it and how many slots a workload needs."""

    name: str
    kind: str
    ready_timeout_s: float
    missing: str | None = None  # why it cannot run here and how to set it up (None: ready)
    rates: AssumedRates = AssumedRates(18, 700, 100, 15)

    def server(self, port: int, slots: int) -> ServerSpec:
        raise NotImplementedError

    def slot_groups(self, workloads: Sequence[Workload]) -> list[tuple[int, list[Workload]]]:
        """Workloads that one server start can serve, with the slots it needs: by default one
        server for all, sized for the largest concurrency."""
        return [(max(w.concurrency for w in workloads), list(workloads))] if workloads else []

    def seconds(self, workloads: Sequence[Workload], warmup: bool) -> float:
        """One pass of `workloads` from the assumed rates: server starts, warm-ups, bench runs."""
        r = self.rates
        starts = len(self.slot_groups(workloads)) * (r.start_s + (BENCH_START_S + 2.0 if warmup else 0.0))
        return starts + sum(BENCH_START_S + w.num_prompts * (w.input_len / r.prefill_tps + w.output_len
                                                             / min(r.decode_tps * w.concurrency, r.batched_tps))
                            for w in workloads)

    def read_info(self, base_url: str) -> dict[str, Any] | None:
        """What the running server says of itself (None: it says nothing we read)."""
        return None

    def floors(self, info: dict[str, Any] | None) -> list[FloorSpec]:
        """The storage one decode step reads, given what the server reported (`read_info`)."""
        return []


@dataclass(frozen=True)
class Paths:
    """Where the peers live (see ../shared/peers/README.md)."""

    peers_dir: Path
    peers_root: Path
    default_gguf: Path

    @property
    def llama_bin(self) -> Path:
        return self.peers_root / "llama.cpp" / "build" / "bin"

    @property
    def f16_gguf(self) -> Path:
        return self.peers_root / "models" / "SmolLM2-135M-Instruct.F16.gguf"

    @property
    def vllm_venv(self) -> Path:
        return self.peers_root / "vllm-venv"

    @property
    def hf_dir(self) -> Path:
        return self.peers_root / "models" / "smollm2-hf"

    def setup_hint(self, script: str, what: str) -> str:
        return f"{what}: run {self.peers_dir / script}"

    def script(self, name: str) -> tuple[Path, str | None]:
        """A serve script of ../shared/peers, and why it cannot be used (None: it is there)."""
        path = self.peers_dir / name
        return path, None if path.is_file() else f"{path} not found (pass --peers-dir)"


def make_from(paths: Paths, cmd: list[str], made: Path, notes: list[str], hint: tuple[str, str],
              env: dict[str, str] | None = None) -> str | None:
    """Run a seconds-long set-up step (a converted model file); None when `made` exists after
    it, else the set-up hint."""
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if res.returncode != 0 or not made.exists():
        return paths.setup_hint(*hint)
    notes.append(f"made {made}: {shlex.join(cmd)}")
    return None


def inferlab_command() -> list[str]:
    """This checkout's `inferlab` (the venv's entry point beside this Python), as a user would type it."""
    exe = Path(sys.executable).with_name("inferlab")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "inferlab.cli"]
