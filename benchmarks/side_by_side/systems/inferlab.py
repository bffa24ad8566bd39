"""`inferlab serve` from this checkout: one column per --inferlab-variant NAME=ARGS."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import server_info

from side_by_side.systems.base import FloorSpec, ServerSpec, System, inferlab_command


@dataclass(frozen=True)
class InferlabSystem(System):
    """`inferlab serve` with the user's flags passed through untouched."""

    args: tuple[str, ...] = ()
    model_file: str = ""

    def server(self, port: int, slots: int) -> ServerSpec:
        return ServerSpec([*inferlab_command(), "serve", "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs",
                           str(max(64, slots)), "--log-level", "warning", *self.args])

    def read_info(self, base_url: str) -> dict[str, Any] | None:
        """`GET /server_info`: the precision the engine resolved, so that no figure guesses it from flags."""
        return server_info(base_url)

    def floors(self, info: dict[str, Any] | None) -> list[FloorSpec]:
        """The weights and K/V at the precision the server reported (none when it reported nothing)."""
        precision = (info or {}).get("precision")
        if not precision:
            return []
        weights, kv = precision["weights"], precision["kv_cache"]
        model = _flag(self.args, "--model", "-m") or self.model_file
        return [FloorSpec(f"{weights} weights, {kv} KV", model, weights, kv, precision.get("kv_bytes_per_token"))]


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


def inferlab_systems(args: argparse.Namespace, gguf: Path) -> list[System]:
    """One column per --inferlab-variant NAME=ARGS (or one, "inferlab"), each with --inferlab-args first."""
    common = shlex.split(args.inferlab_args)
    out: list[System] = []
    for spec in args.inferlab_variant or ["inferlab="]:
        name, sep, extra = spec.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--inferlab-variant takes NAME=VALUE, got {spec!r}")
        out.append(InferlabSystem(name.strip(), "inferlab", args.inferlab_timeout,
                                  args=(*common, *shlex.split(extra)), model_file=str(gguf)))
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise ValueError(f"--inferlab-variant names must differ: {names}")
    return out
