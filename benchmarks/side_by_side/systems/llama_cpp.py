"""llama.cpp's llama-server through ../shared/peers/serve_llama.sh (2 threads, N slots): the Q4_1
GGUF as shipped, an F16 GGUF made from it, and (asked for by name) the Q4_1 GGUF with llama.cpp's
weight repacking turned off: on a Xeon with AMX its repacked Q4_1 server died with SIGSEGV at
start, every run, and without repacking it serves."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from side_by_side.systems.base import AssumedRates, FloorSpec, Paths, ServerSpec, System, make_from
from side_by_side.workloads import Workload

SLOT_CONTEXT = 512  # serve_llama.sh gives each of N > 1 slots this many tokens (one slot: 2048)
SETUP = "setup_llama_server.sh"


@dataclass(frozen=True)
class LlamaSystem(System):
    gguf: str = ""
    script: str = ""
    bin_dir: str = ""
    repack: bool = True  # llama.cpp's default; False sets LLAMA_ARG_REPACK=0 (its --no-repack)

    def server(self, port: int, slots: int) -> ServerSpec:
        env = {"LLAMA_BIN": self.bin_dir} | ({} if self.repack else {"LLAMA_ARG_REPACK": "0"})
        return ServerSpec(["bash", self.script, self.gguf, str(port), str(slots)], env)

    def slot_groups(self, workloads: Sequence[Workload]) -> list[tuple[int, list[Workload]]]:
        """One server per slot count: serve_llama.sh splits its context into 512-token slots when
        there are several, so the 1,024-token prompt needs a one-slot server."""
        groups: dict[int, list[Workload]] = {}
        for w in workloads:
            groups.setdefault(w.concurrency, []).append(w)
        for slots, ws in groups.items():
            per_slot = SLOT_CONTEXT if slots > 1 else 4 * SLOT_CONTEXT
            too_long = [w.key for w in ws if w.context > per_slot]
            if too_long:
                raise ValueError(f"{self.name}: {', '.join(too_long)} needs more than the {per_slot} tokens a slot "
                                 f"of serve_llama.sh holds with {slots} slots; shorten the prompts")
        return list(groups.items())

    def floors(self, info: dict[str, Any] | None) -> list[FloorSpec]:
        return [FloorSpec("GGUF file's bytes, f16 KV", self.gguf, None, "fp16")]


def setup_needed(paths: Paths) -> str | None:
    return None if (paths.llama_bin / "llama-server").is_file() else SETUP


def _llama(f16: bool, paths: Paths, args: argparse.Namespace, notes: list[str], repack: bool = True) -> System:
    script, missing = paths.script("serve_llama.sh")
    gguf = paths.f16_gguf if f16 else paths.default_gguf
    if missing is None and setup_needed(paths):
        missing = paths.setup_hint(SETUP, "llama-server is not built (~5 min)")
    elif missing is None and f16 and not gguf.is_file():
        cmd = [str(paths.llama_bin / "llama-quantize"), "--allow-requantize", str(paths.default_gguf), str(gguf),
               "F16", "2"]
        gguf.parent.mkdir(parents=True, exist_ok=True)
        missing = make_from(paths, cmd, gguf, notes, (SETUP, f"no F16 GGUF ({shlex.join(cmd)} failed)"))
    rates = AssumedRates(115, 1043, 265, 3) if f16 else AssumedRates(147, 454, 137, 3)
    name = f"llama.cpp {'F16' if f16 else 'Q4_1'}" + ("" if repack else " (no repack)")
    return LlamaSystem(name, "llama.cpp", args.peer_timeout, missing, rates, gguf=str(gguf), script=str(script),
                       bin_dir=str(paths.llama_bin), repack=repack)


def q4_1(paths: Paths, args: argparse.Namespace, notes: list[str]) -> System:
    return _llama(False, paths, args, notes)


def f16(paths: Paths, args: argparse.Namespace, notes: list[str]) -> System:
    return _llama(True, paths, args, notes)


def q4_1_no_repack(paths: Paths, args: argparse.Namespace, notes: list[str]) -> System:
    return _llama(False, paths, args, notes, repack=False)
