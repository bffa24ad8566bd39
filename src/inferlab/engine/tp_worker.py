"""Tensor parallelism's processes: ranks 1 .. N-1 started by the engine, and rank 0's side.

Rank 0 is the engine's own process: it keeps the tokenizer, the scheduler and the sampler, and
its `ModelRunner` builds each step's flat batch as without tensor parallelism. `Rank0Model`
stands where the runner's `DecoderModel` stands: its `forward` first broadcasts the step (the
flat batch tensors and the attention metadata, one pickled message on a gloo group) to the
other ranks, then runs rank 0's shard; every rank runs its shard over its own KV cache shard
and meets the others in the all-reduces. `compute_logits` broadcasts the hidden rows to
score, and the ranks' logit columns are gathered on rank 0. The other ranks are a loop:

    receive a command ── "forward" ─► their shard of the forward pass (the hidden states kept
                      │               nowhere: rank 0 sends the rows it wants scored)
                      ├─ "logits"  ─► their lm_head columns of those rows, gathered on rank 0
                      └─ "stop"    ─► leave the process group, exit

Lifecycle. The ranks are `torch.multiprocessing` spawn processes (a fork would copy the
engine's threads and oneDNN state). Each loads the weights itself, from the path rank 0
resolved, and keeps its shard; a rank's load error comes back to rank 0 as its message
(the engine fails to start with it). The process group (gloo on the CPU, NCCL on CUDA, with a
gloo group for the step messages either way) is joined once every rank has loaded. A rank
exits when its parent dies (it watches the parent's sentinel, so a SIGKILLed engine leaves no
orphans), on "stop", or when a collective fails. Rank 0 checks the ranks are alive before each
step, and a collective that fails (a rank died mid-step: gloo sees the closed connection;
a rank that hangs: the group's timeout) becomes a `TensorParallelError` naming the rank and
its exit code: the engine fails loudly rather than hang.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import multiprocessing.connection
import os
import shutil
import sys
import tempfile
import threading
import traceback
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from inferlab.config import CacheConfig, EngineConfig, LoadConfig, ModelConfig
from inferlab.models.attention import AttentionMetadata, meta_to
from inferlab.models.backends import Backends
from inferlab.models.decoder import DecoderModel
from inferlab.models.kv_cache import KVCache, allocate_kv_cache
from inferlab.models.precision import ResolvedPrecision
from inferlab.models.tp import TPShard, build_shard, check_tensor_parallel, describe_shards, plan_shards

log = logging.getLogger(__name__)

__all__ = ["Rank0Model", "TensorParallelError", "TensorParallelGroup", "peek_model_config"]

# A collective waits at most this long for the other ranks (a rank that hangs, not dies): one
# step of a large prefill on a loaded CPU stays well inside it.
COLLECTIVE_TIMEOUT_S = 120.0
STOP_WAIT_S = 10.0  # after "stop", how long a rank may take to exit before it is terminated


class TensorParallelError(RuntimeError):
    """A rank died or stopped answering: the engine cannot step any more."""


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to build its shard (picklable: it crosses the spawn)."""

    load: LoadConfig
    cache: CacheConfig
    model_path: str | None  # the file or directory rank 0 resolved (None: dummy weights from `load`)
    world: int
    init_file: str  # the file store the ranks meet in (no port to pick and race for)
    threads: int  # torch threads of each rank
    num_blocks: int  # the KV pool's blocks, the same on every rank (rank 0 decides)
    precision: ResolvedPrecision  # rank 0's; each rank resolves its own and must agree


def peek_model_config(load: LoadConfig, path: str | Path | None) -> ModelConfig:
    """The model's shape from its config alone (config.json, a GGUF's metadata), before any
    weight loads: what the heads check needs."""
    from inferlab.models.model_config import model_config_from_gguf, model_config_from_hf_dir
    from inferlab.models.registry import detect_format

    if load.load_format == "dummy":
        path = load.hf_config_path or path or load.model
    if path is None:
        raise ValueError("tensor parallelism needs a model to split")
    source = Path(path).expanduser()
    if detect_format(source) == "gguf":
        import gguf

        return model_config_from_gguf(gguf.GGUFReader(source))
    return model_config_from_hf_dir(source)


class TorchCollectives:
    """`models/tp.py`'s Collectives on torch.distributed's default group, plus the step
    messages on a gloo group (the default group itself on the CPU)."""

    def __init__(self, rank: int, world: int, device: torch.device):
        self.rank, self.world, self.device = rank, world, device
        self.control: Any = None  # the gloo group of the step messages, once joined
        # 16-bit tensors are all-reduced in float32 on gloo and converted back: older gloo builds
        # sum no bfloat16, and the one in torch 2.13 (which does) rounds to 16 bits at every hop
        # of its ring, where a float32 sum rounds once. NCCL sums them natively.
        self.float32_reduce = device.type == "cpu"

    def join(self, init_file: str, timeout_s: float) -> None:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        kw: dict[str, Any] = {"device_id": self.device} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=self.rank, world_size=self.world,
                                timeout=timeout, **kw)
        self.control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.float32_reduce and t.dtype in (torch.bfloat16, torch.float16):
            wide = t.float()
            dist.all_reduce(wide)
            return t.copy_(wide)
        dist.all_reduce(t)
        return t

    def gather(self, t: torch.Tensor) -> torch.Tensor | None:
        parts = [torch.empty_like(t) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(t, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def send(self, message: tuple) -> None:
        """Rank 0: one command to every other rank."""
        dist.broadcast_object_list([message], src=0, group=self.control)

    def receive(self) -> tuple:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]


def _on_host(meta: AttentionMetadata, ids: torch.Tensor, pos: torch.Tensor) -> tuple:
    """A step's tensors as a picklable message (moved to the host first on a GPU)."""
    if ids.device.type != "cpu":
        return ("forward", ids.cpu(), pos.cpu(), meta_to(meta, torch.device("cpu")))
    return ("forward", ids, pos, meta)


class Rank0Model:
    """Rank 0's shard behind the interface the runner calls (`forward`, `compute_logits`, the
    precision line): each call is first sent to the other ranks (see the module docstring)."""

    def __init__(self, decoder: DecoderModel, group: TensorParallelGroup):
        self.decoder = decoder
        self.group = group
        self.config = decoder.config

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        with self.group.failures():
            self.group.comm.send(_on_host(meta, input_ids, positions))
            return self.decoder.forward(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self.group.failures():
            self.group.comm.send(("logits", hidden.cpu() if hidden.device.type != "cpu" else hidden))
            return self.decoder.compute_logits(hidden)

    def describe_precision(self) -> str:
        return self.decoder.describe_precision()

    @property
    def weight_nbytes(self) -> int:
        return self.decoder.weight_nbytes

    @property
    def decode_weight_nbytes(self) -> int:
        return self.decoder.decode_weight_nbytes


class TensorParallelGroup:
    """Rank 0's side: starts the other ranks, joins the group with them, builds its own shard,
    checks the ranks before each step, stops them (`shutdown`, also when it is collected and at
    exit: no rank outlives the engine)."""

    def __init__(self, spec: RankSpec, shards: list[TPShard], threads_before: int):
        self.spec = spec
        self.threads_before = threads_before  # this process's torch threads before it took its share
        self.shards = shards
        self.comm = TorchCollectives(0, spec.world, torch.device(spec.precision.device))
        ctx = torch.multiprocessing.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        for rank in range(1, spec.world):
            mine, theirs = ctx.Pipe(duplex=False)
            p = ctx.Process(target=run_rank, args=(spec, rank, theirs), name=f"inferlab-tp-rank{rank}", daemon=True)
            p.start()
            theirs.close()
            self.procs.append(p)
            self.conns.append(mine)
        self._closed = False
        # Collected or at exit without `shutdown`, the ranks get no "stop": terminated at once.
        self._stop_wait = [0.0]
        self._finalizer = weakref.finalize(self, _stop_ranks, self.procs, spec.init_file, self._stop_wait)

    @classmethod
    def start(cls, config: EngineConfig, precision: ResolvedPrecision, model_path: str | Path | None,
              num_blocks: Any) -> TensorParallelGroup:
        """Check the model splits (before any weight loads: a ValueError naming the numbers),
        set this process's threads to its share, start ranks 1 .. N-1 (they load while rank 0
        does). `num_blocks(model_config)`: the KV pool's blocks for the whole model."""
        world = config.parallel.tensor_parallel_size
        model = peek_model_config(config.load, model_path)
        check_tensor_parallel(model, world)
        if torch.device(precision.device).type == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(f"tensor_parallel_size {world} needs {world} GPUs, this machine has "
                             f"{torch.cuda.device_count()}")
        before = torch.get_num_threads()
        total = config.num_threads or before
        threads = max(1, total // world)
        torch.set_num_threads(threads)
        shards = plan_shards(model, world)
        log.info("%s; %d ranks of %d torch threads", describe_shards(model, shards), world, threads)
        init_dir = tempfile.mkdtemp(prefix="inferlab-tp-")
        spec = RankSpec(config.load, config.cache, None if model_path is None else str(model_path), world,
                        os.path.join(init_dir, "store"), threads, num_blocks(model), precision)
        return cls(spec, shards, before)

    @property
    def pids(self) -> list[int]:
        """The other ranks' process ids (the tests check none outlives the engine)."""
        return [p.pid for p in self.procs]

    def rank0_model(self, config: ModelConfig, weights: dict[str, torch.Tensor], precision: ResolvedPrecision,
                    backends: Backends) -> Rank0Model:
        """Build rank 0's shard, wait for the other ranks to load theirs (their error, if one
        failed), join the process group with them."""
        decoder = build_shard(config, weights, precision, backends, self.shards[0], self.comm)
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            ready = multiprocessing.connection.wait([conn, p.sentinel])
            if conn in ready:
                kind, text = conn.recv()
                if kind != "ready":
                    raise TensorParallelError(f"tensor-parallel rank {rank} failed to load: {text}")
            else:
                raise TensorParallelError(f"tensor-parallel rank {rank} exited while loading "
                                          f"(exit code {p.exitcode}){self._last_words(rank)}")
        self.comm.join(self.spec.init_file, COLLECTIVE_TIMEOUT_S)
        return Rank0Model(decoder, self)

    def local_kv_heads(self) -> int:
        return self.shards[0].kv_heads.size

    def _last_words(self, rank: int) -> str:
        conn = self.conns[rank - 1]
        try:
            if conn.poll():
                return f": {conn.recv()[1]}"
        except (EOFError, OSError):
            pass
        return ""

    def dead_rank(self) -> str | None:
        """A line naming the first rank that is no longer running, else None."""
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                return f"tensor-parallel rank {rank} died (exit code {p.exitcode}){self._last_words(rank)}"
        return None

    def failures(self) -> _Failures:
        """A context for one collective call: a dead rank found before it, or an error inside it,
        raises TensorParallelError naming the rank."""
        return _Failures(self)

    def shutdown(self) -> None:
        """Tell the ranks to stop, wait for them (then terminate, then kill), leave the group."""
        if self._closed:
            return
        self._closed = True
        if dist.is_initialized() and self.dead_rank() is None:
            try:
                self.comm.send(("stop",))
            except RuntimeError as e:  # a rank went meanwhile: they are stopped below all the same
                log.warning("tensor parallel: stop message failed (%s)", e)
            else:
                self._stop_wait[0] = STOP_WAIT_S
        self._finalizer()
        self.comm.leave()
        torch.set_num_threads(self.threads_before)


class _Failures:
    def __init__(self, group: TensorParallelGroup):
        self.group = group

    def __enter__(self) -> None:
        if self.group._closed:
            raise TensorParallelError("the tensor-parallel ranks were shut down")
        dead = self.group.dead_rank()
        if dead is not None:
            raise TensorParallelError(dead)

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None and isinstance(exc, RuntimeError) and not isinstance(exc, TensorParallelError):
            for p in self.group.procs:  # a rank that died mid-collective may take a moment to be reaped
                p.join(timeout=2.0)
                if not p.is_alive():
                    break
            dead = self.group.dead_rank()
            raise TensorParallelError(dead or f"a tensor-parallel collective failed: {exc}") from exc


def _stop_ranks(procs: list[Any], init_file: str, wait: list[float]) -> None:
    """Wait up to wait[0] s for the ranks to exit, terminate the ones that do not, kill the ones
    that still do not."""
    for p in procs:
        p.join(timeout=wait[0])
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=2.0)
    shutil.rmtree(os.path.dirname(init_file), ignore_errors=True)


# ---------------------------------------------------------------------- ranks 1 .. N-1


def _exit_with_parent() -> None:
    """Leave at once when the engine's process dies, however it dies (a SIGKILL runs no atexit)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    sentinel = parent.sentinel

    def watch() -> None:
        multiprocessing.connection.wait([sentinel])
        os._exit(3)

    threading.Thread(target=watch, name="inferlab-tp-parent-watch", daemon=True).start()


def precision_mismatch(mine: ResolvedPrecision, rank0: ResolvedPrecision) -> str:
    """Why a rank refuses rank 0's precision: the fields that differ, the kernel's one by one,
    since two ranks whose kernels were compiled from other sources (the package changed between
    their starts) describe() alike."""
    diffs = []
    for f in dataclasses.fields(mine):
        a, b = getattr(mine, f.name), getattr(rank0, f.name)
        if f.name == "reasons" or a == b:
            continue
        if dataclasses.is_dataclass(a) and type(a) is type(b):
            diffs += [f"{f.name}.{g.name} {getattr(a, g.name)!r} against {getattr(b, g.name)!r}"
                      for g in dataclasses.fields(a) if getattr(a, g.name) != getattr(b, g.name)]
        else:
            diffs.append(f"{f.name} {a!r} against {b!r}")
    hint = ("; the kernels were built from other sources than rank 0's (a changed or reinstalled package): "
            "start every rank from one install" if any(d.startswith("kernel.build_dir") for d in diffs) else "")
    return f"this rank resolved another precision than rank 0: {', '.join(diffs)}{hint}"


def run_rank(spec: RankSpec, rank: int, conn: Any) -> None:
    """Rank `rank`'s process: load, report, join, then serve rank 0's commands until "stop"."""
    _exit_with_parent()
    logging.basicConfig(level=logging.WARNING, format=f"tp rank {rank}: %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(spec.threads)
    device = torch.device(spec.precision.device)
    try:
        from inferlab.models.backends import select_backends
        from inferlab.models.loader import load_model
        from inferlab.models.precision import resolve_precision

        if device.type == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        precision = resolve_precision(spec.load, spec.cache)
        if dataclasses.replace(precision, reasons=()) != dataclasses.replace(spec.precision, reasons=()):
            raise RuntimeError(precision_mismatch(precision, spec.precision))
        loaded = load_model(spec.load, spec.model_path, precision=precision)
        shard = plan_shards(loaded.config, spec.world)[rank]
        comm = TorchCollectives(rank, spec.world, device)
        # The same choice as rank 0's: the same inputs, the same machine.
        backends = select_backends(precision, loaded.config, spec.load.decoder_backend, spec.load.attention_backend)
        model = build_shard(loaded.config, loaded.weights, precision, backends, shard, comm)
        c = loaded.config
        del loaded
        caches = allocate_kv_cache(c.num_layers, shard.kv_heads.size, c.head_dim, spec.num_blocks * spec.cache.block_size,
                                   precision.kv_cache, device=str(device))
    except BaseException as e:  # noqa: BLE001 - rank 0 raises it with this text
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", ""))
    try:
        comm.join(spec.init_file, COLLECTIVE_TIMEOUT_S)
        _serve(model, caches, comm, device)
    except BaseException:  # noqa: BLE001 - rank 0 reports the death; its last words go with it
        text = traceback.format_exc()
        print(f"tp rank {rank} stopped:\n{text}", file=sys.stderr)
        try:
            conn.send(("error", text.strip().splitlines()[-1]))
        except OSError:
            pass
        os._exit(1)
    comm.leave()


@torch.inference_mode()
def _serve(model: DecoderModel, caches: list[KVCache], comm: TorchCollectives, device: torch.device) -> None:
    while True:
        message = comm.receive()
        kind = message[0]
        if kind == "forward":
            _, ids, pos, meta = message
            if device.type != "cpu":
                ids, pos, meta = ids.to(device), pos.to(device), meta_to(meta, device)
            model.forward(ids, pos, caches, meta)
        elif kind == "logits":
            model.compute_logits(message[1].to(device))
        elif kind == "stop":
            return
        else:  # pragma: no cover - rank 0 sends only the three
            raise RuntimeError(f"unknown tensor-parallel command {kind!r}")
