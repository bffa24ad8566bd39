"""`Figure`: one number with its unit and its provenance.

The course's rule is that every figure says what kind it is. A bare float cannot, so the
planner, the simulator and the comparisons pass `Figure`s around, and the JSON output
keeps the kind and the assumptions next to each value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Kind = Literal["computed", "simulated", "cited", "measured"]
KINDS: tuple[str, ...] = ("computed", "simulated", "cited", "measured")


@dataclass(frozen=True)
class Figure:
    """A value, its unit, and how we know it.

    kind: 'computed' (arithmetic on public configurations and spec sheets), 'simulated'
    (a step-by-step model of an engine), 'cited' (someone's published number, with its
    source), 'measured' (timed on this machine). `value` is None when the figure does not
    exist for these inputs (e.g. decode never turns compute-bound); an assumption says why.
    """

    name: str  # a stable snake_case key (JSON, --compare)
    value: float | None
    unit: str
    kind: Kind
    assumptions: list[str] = field(default_factory=list)
    source: str | None = None
    label: str = ""  # a human heading for tables; defaults to the name

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"figure kind must be one of {', '.join(KINDS)}, not {self.kind!r}")

    @property
    def title(self) -> str:
        return self.label or self.name.replace("_", " ")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "label": self.title,
            "value": self.value,
            "unit": self.unit,
            "kind": self.kind,
            "assumptions": list(self.assumptions),
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Figure:
        return cls(
            name=d["name"],
            value=d.get("value"),
            unit=d.get("unit", ""),
            kind=d.get("kind", "computed"),
            assumptions=list(d.get("assumptions") or []),
            source=d.get("source"),
            label=d.get("label", ""),
        )


def format_value(value: float | None, unit: str) -> str:
    """A readable rendering: bytes in binary units (and decimal GB beside GiB, as spec sheets
    use), rates and FLOPs with SI prefixes, times in ms or s, counts with commas."""
    if value is None:
        return "—"
    if unit == "bytes":
        return format_bytes(value)
    if unit in ("B/s", "FLOP/s", "FLOP"):
        return format_si(value, unit)
    if unit == "s":
        if abs(value) < 1.0:
            return f"{value * 1000:.3g} ms"
        return f"{value:.3g} s"
    if unit == "USD":
        return f"${value:.3g}" if abs(value) < 1 else f"${value:,.2f}"
    if isinstance(value, int) or float(value).is_integer():
        return f"{int(value):,} {unit}".rstrip()
    if abs(value) >= 100:
        return f"{value:,.0f} {unit}".rstrip()
    return f"{value:.3g} {unit}".rstrip()


def format_bytes(n: float) -> str:
    """Binary units (KiB, MiB, GiB), the units the course and `du` use; from 1 GB up, the
    decimal GB of spec sheets first."""
    binary = f"{n:.4g} B"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            binary = f"{n / size:.4g} {unit}"
            break
    if abs(n) >= 1e9:
        return f"{n / 1e9:.4g} GB ({binary})"
    return binary


def format_si(value: float, unit: str) -> str:
    for prefix, size in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.4g} {prefix}{unit}"
    return f"{value:.4g} {unit}"


def read_json(path: str | Path) -> tuple[Path, Any]:
    """A JSON file the planner reads (a bench report, a step profile, a cost model, a hardware
    profile) and its path; malformed JSON is a ValueError naming the file and the line."""
    p = Path(path)
    try:
        return p, json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not JSON ({e.msg} at line {e.lineno})") from None
