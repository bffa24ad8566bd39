"""Which precision modes the quantization report measures, and which this machine cannot run.

The modes come from config.py's WEIGHT_DTYPES and KV_CACHE_DTYPES (every entry but "auto"), so
a mode added there is in the report without an edit here. Whether this machine runs one is the
engine's answer (models/precision.py resolve_precision raises ValueError with the reason, e.g.
w8a8 without our kernels), not a rule copied here. Two rows that resolve to the same
stored types (the K/V-float16 row with default weights is the weights-bfloat16 row on AVX-512)
are measured once; the second is reported as the same as the first.
"""

from __future__ import annotations

from dataclasses import dataclass

from inferlab.config import KV_CACHE_DTYPES, WEIGHT_DTYPES, CacheConfig, LoadConfig
from inferlab.models.precision import dtype_name, resolve_precision


@dataclass(frozen=True)
class Mode:
    """One row: the engine arguments and what they resolved to on this machine."""

    label: str  # "base float32", "weights int8", "K/V float32"
    kind: str  # "base" | "weights" | "kv"
    dtype: str  # LLM(dtype=...)
    weight_dtype: str  # LLM(weight_dtype=...)
    kv_cache_dtype: str  # LLM(kv_cache_dtype=...)
    compute: str = ""  # resolved names, filled by plan_modes
    weights: str = ""
    kv: str = ""

    @property
    def key(self) -> tuple[str, str, str]:
        """What the engine stores and computes in: equal keys are the same measurement."""
        return self.compute, self.weights, self.kv


@dataclass(frozen=True)
class Skipped:
    label: str
    reason: str


def available_modes() -> tuple[list[str], list[str]]:
    """Every weight mode and K/V dtype the engine offers (the config tuples minus "auto")."""
    return ([w for w in dict.fromkeys(WEIGHT_DTYPES) if w != "auto"],
            [k for k in dict.fromkeys(KV_CACHE_DTYPES) if k != "auto"])


def parse_list(text: str | None, offered: list[str], what: str) -> list[str]:
    """A comma list from the command line (None: all offered, "none" or "": no rows); ValueError
    naming an unknown entry and the offered ones."""
    if text is None:
        return list(offered)
    names = [t.strip() for t in text.split(",") if t.strip() and t.strip().lower() != "none"]
    for n in names:
        if n not in offered:
            raise ValueError(f"unknown {what} {n!r}: this engine offers {', '.join(offered)}")
    return list(dict.fromkeys(names))


def _resolve(mode: Mode, model: str | None) -> Mode:
    p = resolve_precision(LoadConfig(model=model, dtype=mode.dtype, weight_dtype=mode.weight_dtype),
                          CacheConfig(cache_dtype=mode.kv_cache_dtype))
    # weight_mode, not the storage dtype: int8 and w8a8 (and what comes) share one
    return Mode(mode.label, mode.kind, mode.dtype, mode.weight_dtype, mode.kv_cache_dtype,
                dtype_name(p.compute), p.weight_mode, dtype_name(p.kv_cache))


def plan_modes(weight_modes: list[str], kv_modes: list[str],
               model: str | None = None) -> tuple[list[Mode], list[Skipped]]:
    """The rows to measure, the float32 base first, then each weight mode with auto K/V, then each
    K/V dtype with the default weights; and the skipped ones with the engine's reason (or the row
    they duplicate)."""
    wanted = [Mode("base float32", "base", "float32", "auto", "auto")]
    wanted += [Mode(f"weights {w}", "weights", "auto", w, "auto") for w in weight_modes]
    wanted += [Mode(f"K/V {k}", "kv", "auto", "auto", k) for k in kv_modes]
    rows: list[Mode] = []
    skipped: list[Skipped] = []
    for mode in wanted:
        try:
            resolved = _resolve(mode, model)
        except ValueError as e:
            skipped.append(Skipped(mode.label, str(e)))
            continue
        same = next((r for r in rows if r.key == resolved.key), None)
        if same is not None and mode.kind != "base":
            skipped.append(Skipped(mode.label, f"the same as {same.label} (weights {resolved.weights}, "
                                               f"K/V {resolved.kv}, compute {resolved.compute})"))
            continue
        rows.append(resolved)
    return rows, skipped
