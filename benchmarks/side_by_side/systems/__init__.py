"""The registry of systems: inferlab's variants, and the peers by the key --peers names them."""

from __future__ import annotations

import argparse
import subprocess
from collections.abc import Callable, Sequence

from side_by_side.systems import llama_cpp, vllm
from side_by_side.systems.base import Paths, System
from side_by_side.systems.inferlab import inferlab_systems

__all__ = ["DEFAULT_PEERS", "PEERS", "Paths", "System", "inferlab_systems", "peer_systems"]

# key -> (the system, or the reason it cannot run; the set-up script it needs when not built)
PEERS: dict[str, tuple[Callable[[Paths, argparse.Namespace, list[str]], System], Callable[[Paths], str | None]]] = {
    "llama-q4_1": (llama_cpp.q4_1, llama_cpp.setup_needed),
    "llama-f16": (llama_cpp.f16, llama_cpp.setup_needed),
    "vllm": (vllm.vllm_cpu, vllm.setup_needed),
    "llama-q4_1-norepack": (llama_cpp.q4_1_no_repack, llama_cpp.setup_needed),
}
# What --peers runs by default: the Q4_1 without repacking only where named (where the repacked
# server crashes: a Xeon with AMX).
DEFAULT_PEERS = ("llama-q4_1", "llama-f16", "vllm")


def peer_systems(keys: Sequence[str], paths: Paths, args: argparse.Namespace, notes: list[str]) -> list[System]:
    """The peers asked for, each either ready or carrying the message that says how to set it up.
    Sets up what takes seconds (the F16 GGUF, vLLM's model directory); the builds take minutes and
    run only with --setup (the peers' own scripts; they download from the package index)."""
    unknown = [k for k in keys if k not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer {unknown[0]!r}; choose from {', '.join(PEERS)}")
    if args.setup:
        for script in dict.fromkeys(s for k in keys if (s := PEERS[k][1](paths))):
            print(f"$ bash {paths.peers_dir / script}", flush=True)
            subprocess.run(["bash", str(paths.peers_dir / script)], check=False)
    return [PEERS[k][0](paths, args, notes) for k in keys]
