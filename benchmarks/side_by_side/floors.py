"""The decode ceiling beside the table: bandwidth / bytes one decode step reads, per system, with
the bandwidth measured by `inferlab plan --measure-cpu` and inferlab's storage as its server reported it."""

from __future__ import annotations

import json
import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import CpuWatch

from side_by_side.measure import Session
from side_by_side.systems import System
from side_by_side.systems.base import inferlab_command
from side_by_side.workloads import Workload


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
    with CpuWatch() as watch:
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


def decode_floors(systems: Sequence[System], hw: dict[str, Any], stream: Workload,
                  server_info: dict[str, dict[str, Any]]) -> list[Floor]:
    """Per system: weights read per step + K/V of the mean decode context of the one-stream workload."""
    from inferlab.plan.hardware import HardwareSpec
    from inferlab.plan.model_spec import load_model_spec
    from inferlab.plan.roofline import Roofline, mean_decode_context

    spec = HardwareSpec.from_dict(hw)
    context = mean_decode_context(stream.input_len, stream.output_len)
    out = []
    for system in systems:
        for f in system.floors(server_info.get(system.name)):
            roof = Roofline(load_model_spec(f.model_file), spec, f.weight_dtype, f.kv_dtype, "fp32")
            kv = (f.kv_bytes_per_token or roof.kv_bytes_per_token) * context
            weights = roof.weight_bytes_read_per_step
            out.append(Floor(system.name, f.label, weights, kv, roof.effective_bandwidth / (weights + kv)))
    return out
