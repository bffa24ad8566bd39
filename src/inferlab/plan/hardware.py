"""`HardwareSpec`: memory size, memory bandwidth and dense matrix throughput of one device.

The built-in entries are copied from the makers' public spec sheets ('cited'); `--measure-cpu`
times this machine ('measured', see measure.py) and caches the result as JSON, which
`--hardware-file` reads back. Spec-sheet "GB" and "TB/s" are decimal (10^9, 10^12).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferlab.plan.figures import Kind, read_json

SCHEMA = "inferlab.hardware/1"


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator (or this CPU). `flops` maps a compute precision to dense FLOP/s."""

    name: str
    memory_bytes: float
    memory_bandwidth: float  # bytes/s
    flops: dict[str, float]  # "bf16", "fp32", "fp8" -> dense FLOP/s (no 2:4 sparsity)
    kind: Kind  # 'cited' (spec sheet) or 'measured' (timed here)
    source: str
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.memory_bandwidth <= 0:
            raise ValueError(f"hardware {self.name!r}: memory size and bandwidth must be > 0")
        if not self.flops or any(v <= 0 for v in self.flops.values()):
            raise ValueError(f"hardware {self.name!r}: needs at least one FLOP/s rate > 0")

    def compute_rate(self, precision: str) -> tuple[float, str]:
        """Dense FLOP/s for `precision`, falling back to bf16 (then anything) with the reason."""
        if precision in self.flops:
            return self.flops[precision], precision
        for fallback in ("bf16", "fp16", "fp32"):
            if fallback in self.flops:
                return self.flops[fallback], fallback
        key = next(iter(self.flops))
        return self.flops[key], key

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "name": self.name,
            "memory_bytes": self.memory_bytes,
            "memory_bandwidth": self.memory_bandwidth,
            "flops": dict(self.flops),
            "kind": self.kind,
            "source": self.source,
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], origin: str = "hardware file") -> HardwareSpec:
        try:
            return cls(
                name=str(d["name"]),
                memory_bytes=float(d["memory_bytes"]),
                memory_bandwidth=float(d["memory_bandwidth"]),
                flops={str(k): float(v) for k, v in d["flops"].items()},
                kind=d.get("kind", "measured"),
                source=str(d.get("source") or origin),
                notes=list(d.get("notes") or []),
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{origin}: not a hardware profile (missing or bad {e})") from None


_T = 1e12
_BUILTIN: dict[str, HardwareSpec] = {
    "h100-sxm-80gb": HardwareSpec(
        "H100 SXM 80GB", 80e9, 3.35e12, {"bf16": 989.4 * _T, "fp16": 989.4 * _T, "fp8": 1978.9 * _T,
                                          "fp32": 66.9 * _T},
        "cited", "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80 GB HBM3, 3.35 TB/s; BF16 1,979 TFLOPS "
                 "with 2:4 sparsity, so 989 dense; FP8 3,958 sparse; FP32 67",
    ),
    "h200": HardwareSpec(
        "H200 SXM 141GB", 141e9, 4.8e12, {"bf16": 989.4 * _T, "fp16": 989.4 * _T, "fp8": 1978.9 * _T,
                                           "fp32": 66.9 * _T},
        "cited", "NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e, 4.8 TB/s; BF16 1,979 TFLOPS "
                 "with sparsity, so 989 dense",
    ),
    "a100-80gb": HardwareSpec(
        "A100 SXM 80GB", 80e9, 2.039e12, {"bf16": 312 * _T, "fp16": 312 * _T, "fp32": 19.5 * _T},
        "cited", "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): 80 GB HBM2e, 2,039 GB/s; BF16 312 TFLOPS "
                 "dense (624 with sparsity)",
    ),
    "l4": HardwareSpec(
        "L4 24GB", 24e9, 300e9, {"bf16": 121 * _T, "fp16": 121 * _T, "fp8": 242.5 * _T, "fp32": 30.3 * _T},
        "cited", "NVIDIA L4 Tensor Core GPU datasheet: 24 GB GDDR6, 300 GB/s; BF16 242 TFLOPS with "
                 "sparsity, so 121 dense",
    ),
    "rtx-4090": HardwareSpec(
        "GeForce RTX 4090 24GB", 24e9, 1008e9, {"bf16": 165.2 * _T, "fp16": 165.2 * _T, "fp8": 330.3 * _T,
                                                  "fp32": 82.6 * _T},
        "cited", "NVIDIA Ada Lovelace architecture whitepaper (GeForce RTX 4090): 24 GB GDDR6X, 1,008 GB/s; "
                 "BF16 tensor 165.2 TFLOPS dense with FP32 accumulate",
    ),
}
_ALIASES = {
    "h100": "h100-sxm-80gb", "h100-sxm": "h100-sxm-80gb", "h100-80gb": "h100-sxm-80gb", "h100-sxm5": "h100-sxm-80gb",
    "h200-sxm": "h200", "h200-141gb": "h200", "h200-sxm-141gb": "h200",
    "a100": "a100-80gb", "a100-sxm-80gb": "a100-80gb", "a100-sxm": "a100-80gb",
    "l4-24gb": "l4", "4090": "rtx-4090", "rtx4090": "rtx-4090", "geforce-rtx-4090": "rtx-4090",
}


def builtin_hardware_names() -> list[str]:
    return list(_BUILTIN)


def builtin_hardware(name: str) -> HardwareSpec:
    key = re.sub(r"[\s_]+", "-", name.strip().lower())
    key = _ALIASES.get(key, key)
    if key not in _BUILTIN:
        raise ValueError(
            f"unknown hardware {name!r}; built-in: {', '.join(_BUILTIN)} "
            "(or --hardware-file PROFILE.json, or --measure-cpu)"
        )
    return _BUILTIN[key]


def load_hardware_file(path: str | Path) -> HardwareSpec:
    p, data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{p}: a hardware profile must be a JSON object")
    return HardwareSpec.from_dict(data, origin=str(p))


def save_hardware_file(spec: HardwareSpec, path: str | Path) -> None:
    Path(path).write_text(json.dumps(spec.to_dict(), indent=2) + "\n")
