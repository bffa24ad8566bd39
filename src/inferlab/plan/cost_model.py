"""Step cost models for the simulator: how long one engine step takes, given its shape.

Three kinds, one interface (`step_time(StepShape) -> seconds`):
- `ConstantCost`: every step the same time (tests, and hand-computable examples);
- `RooflineCost`: the planner's roofline (computed from configurations and spec sheets);
- `LinearCost`: t = c0 + c_p·prefill tokens + c_d·decode tokens + c_k·context tokens read
  + c_a·attention pairs (+ a correction for one-token steps), fitted by least squares to steps
  measured on our engine (`fit_linear`; `--calibrate PROFILE`, `--calibrate-engine` records one).

A linear model rather than the roofline's max(): on a CPU, and on a GPU at small batches,
the terms add (kernels run one after another), and six coefficients are few enough to fit
from a short profile. `shape_of(SchedulerOutput)` turns a real engine step into the shape,
so a profile can be recorded by any driver of the real scheduler and model runner.
`roofline_efficiencies` turns a fitted model back into the roofline's efficiency factors.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from inferlab.engine.outputs import SchedulerOutput
from inferlab.plan.figures import read_json
from inferlab.plan.roofline import Roofline, StepShape

PROFILE_SCHEMA = "inferlab.step-profile/1"
COST_MODEL_SCHEMA = "inferlab.cost-model/1"


class StepCostModel(Protocol):
    kind: str  # where its numbers come from: 'computed' (roofline, constant) or 'measured' (a fit)

    def step_time(self, shape: StepShape) -> float: ...

    def describe(self) -> list[str]: ...


def shape_of(scheduler_output: SchedulerOutput) -> StepShape:
    """A real step's shape. A decode is one token after the prompt, with its drafts (decode
    rows too: each reads the request's context); anything else (a prompt chunk, or recomputing
    outputs after preemption) counts as prefill."""
    chunks = []
    for s in scheduler_output.scheduled:
        n = len(s.token_ids)
        chunks.append((s.start_pos, n, n - s.num_draft_tokens == 1 and s.start_pos >= len(s.prompt_token_ids)))
    return StepShape.from_chunks(chunks)


@dataclass(frozen=True)
class ConstantCost:
    seconds: float
    kind: str = "computed"

    def __post_init__(self) -> None:
        if self.seconds <= 0:
            raise ValueError(f"a constant step time must be > 0, got {self.seconds}")

    def step_time(self, shape: StepShape) -> float:
        return self.seconds if shape.num_tokens else 0.0

    def describe(self) -> list[str]:
        return [f"every step takes {self.seconds * 1000:g} ms, whatever it computes"]


class RooflineCost:
    """The planner's roofline as a step cost."""

    kind = "computed"

    def __init__(self, roofline: Roofline) -> None:
        self.roofline = roofline

    def step_time(self, shape: StepShape) -> float:
        return self.roofline.step_time(shape)

    def describe(self) -> list[str]:
        r = self.roofline
        notes = [
            f"roofline of {r.model.name} on {r.hardware.name} ({r.hardware.kind}): "
            "max((weights + K/V read) / bandwidth, FLOPs / compute) per step",
            f"bandwidth × {r.memory_efficiency:g}, compute × {r.compute_efficiency:g} of peak",
        ]
        if r.step_overhead_s:
            notes.append(f"+ {r.step_overhead_s * 1000:g} ms fixed per step")
        return notes


@dataclass(frozen=True)
class LinearCost:
    """t = intercept + per_prefill_token·P + per_decode_token·D + per_context_token·C
           + per_attention_pair·A + single_token_step·[P + D = 1]   (seconds)

    Context tokens (C) are K/V read from the cache, linear in each sequence's length;
    attention pairs (A, query × key) are the attention FLOPs, quadratic in a prefill chunk's
    length: a lone 1,024-token prompt does 8× the attention work of eight 128-token ones.
    The last term is a correction for a step that computes exactly one token: its matrix
    products are matrix-vector products, which a CPU BLAS runs without the packing a
    matrix-matrix product pays for, so a lone decode costs less than the intercept that every
    batched step pays (measured here: ~49 ms for one token, ~80 ms for two). Zero when no
    profiled step had one token. The last two are 0 in cost models saved before they existed.
    """

    intercept_s: float
    per_prefill_token_s: float
    per_decode_token_s: float
    per_context_token_s: float
    source: str = ""
    fit: dict[str, Any] = field(default_factory=dict)  # n, r2, rms_s, max_rel_err, median_rel_err, notes
    kind: str = "measured"
    single_token_step_s: float = 0.0
    per_attention_pair_s: float = 0.0

    def step_time(self, shape: StepShape) -> float:
        if not shape.num_tokens:
            return 0.0
        t = float(np.dot(self.coefficients, features(shape)))
        return max(t, 1e-9)  # a fit may extrapolate below zero for tiny steps; time still moves

    @property
    def coefficients(self) -> tuple[float, ...]:
        """In the order of `FEATURES`."""
        return (self.intercept_s, self.per_prefill_token_s, self.per_decode_token_s, self.per_context_token_s,
                self.per_attention_pair_s, self.single_token_step_s)

    def describe(self) -> list[str]:
        notes = [
            f"linear step cost fitted to measured steps{' (' + self.source + ')' if self.source else ''}: "
            f"{self.intercept_s * 1e3:.4g} ms + {self.per_prefill_token_s * 1e6:.4g} µs/prefill token + "
            f"{self.per_decode_token_s * 1e6:.4g} µs/decode token + "
            f"{self.per_context_token_s * 1e9:.4g} ns/context token + "
            f"{self.per_attention_pair_s * 1e9:.4g} ns/attention pair"
            + (f" {self.single_token_step_s * 1e3:+.4g} ms for a one-token step" if self.single_token_step_s else ""),
        ]
        if self.fit:
            line = (f"fit over {self.fit.get('n')} steps: R² {self.fit.get('r2', float('nan')):.3f}, "
                    f"RMS error {self.fit.get('rms_s', float('nan')) * 1e3:.3g} ms")
            if "max_rel_err" in self.fit:
                line += (f", relative error median {self.fit['median_rel_err'] * 100:.2g}%, "
                         f"max {self.fit['max_rel_err'] * 100:.2g}%")
            notes.append(line)
            notes.extend(self.fit.get("notes", []))
        return notes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("kind")
        return {"schema": COST_MODEL_SCHEMA, "kind": "linear", **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any], origin: str = "cost model") -> LinearCost:
        try:
            return cls(
                intercept_s=float(d["intercept_s"]),
                per_prefill_token_s=float(d["per_prefill_token_s"]),
                per_decode_token_s=float(d["per_decode_token_s"]),
                per_context_token_s=float(d["per_context_token_s"]),
                source=str(d.get("source") or origin),
                fit=dict(d.get("fit") or {}),
                single_token_step_s=float(d.get("single_token_step_s") or 0.0),
                per_attention_pair_s=float(d.get("per_attention_pair_s") or 0.0),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{origin}: not a linear cost model (missing or bad {e})") from None


@dataclass(frozen=True)
class StepSample:
    """One measured step: its shape and how long it took.

    step_time_s is what the simulator's clock advances by (for `--calibrate-engine`, the whole
    engine step); forward_time_s, when known, the model runner's share of it.
    """

    shape: StepShape
    step_time_s: float
    forward_time_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {**asdict(self.shape), "step_time_s": self.step_time_s}
        if self.forward_time_s is not None:
            d["forward_time_s"] = self.forward_time_s
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepSample:
        try:
            shape = StepShape(
                num_prefill_tokens=int(d["num_prefill_tokens"]),
                num_decode_tokens=int(d["num_decode_tokens"]),
                num_seqs=int(d.get("num_seqs", 0)),
                context_tokens=float(d["context_tokens"]),
                attention_pairs=float(d.get("attention_pairs", 0)),
            )
            t = float(d["step_time_s"])
            fwd = None if d.get("forward_time_s") is None else float(d["forward_time_s"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"a profile sample needs num_prefill_tokens, num_decode_tokens, context_tokens and "
                             f"step_time_s (bad or missing {e})") from None
        if t <= 0:
            raise ValueError(f"a profile sample's step_time_s must be > 0, got {t}")
        return cls(shape, t, fwd)


# The fitted model's inputs, in the order of LinearCost.coefficients.
FEATURES = ("intercept", "prefill tokens", "decode tokens", "context tokens", "attention pairs", "one-token step")
_ONE = FEATURES.index("one-token step")
_NON_NEGATIVE = (1, 2, 3, 4)  # per-unit-of-work costs: more work never takes less time


def features(shape: StepShape) -> tuple[float, ...]:
    return (1.0, float(shape.num_prefill_tokens), float(shape.num_decode_tokens), float(shape.context_tokens),
            float(shape.attention_pairs), 1.0 if shape.num_tokens == 1 else 0.0)


def fit_linear(samples: list[StepSample], source: str = "", relative: bool = True) -> LinearCost:
    """Least-squares fit of the coefficients of `LinearCost`.

    relative=True minimises relative rather than absolute errors: measured steps span ~50 ms
    decodes to multi-second prefills, and an absolute fit would spend its freedom on the long
    prefills while missing the decode steps (which set TPOT) by tens of percent.

    A column that is zero in every sample (e.g. no prefill was measured) cannot be fitted; its
    coefficient is set to 0 and a note says so, rather than letting lstsq's minimum-norm
    answer pass for a measurement. A per-token, per-context or per-pair coefficient that comes
    out negative is noise (more work never takes less time): it is fixed at 0 and the rest refitted.
    """
    if len(samples) < 2:
        raise ValueError(f"calibration needs at least 2 measured steps, got {len(samples)}")
    x = np.array([features(s.shape) for s in samples], dtype=float)
    y = np.array([s.step_time_s for s in samples], dtype=float)
    ncol = len(FEATURES)
    active = [j for j in range(ncol) if j == 0 or np.any(x[:, j] != 0)]
    notes = [f"{FEATURES[j]}: no sample had any, coefficient set to 0" for j in range(1, ncol) if j not in active]
    # The one-token correction is a refinement: fitted only when the steps say something about it
    # beyond the other columns (not every step one token, and a sample to spare).
    if _ONE in active and (np.all(x[:, _ONE] == 1) or len(samples) < len(active)):
        active.remove(_ONE)
        notes.append(f"{FEATURES[_ONE]}: too few distinct steps to fit it, coefficient set to 0")
    if len(samples) < len(active):
        raise ValueError(f"calibration needs at least {len(active)} measured steps for {len(active)} coefficients, "
                         f"got {len(samples)}")
    w = 1.0 / y if relative else np.ones_like(y)
    while True:
        coef_active, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        negative = [j for j, c in zip(active, coef_active) if j in _NON_NEGATIVE and c < 0]
        if not negative:
            break
        for j in negative:
            active.remove(j)
            notes.append(f"{FEATURES[j]}: fitted below zero (noise), coefficient fixed at 0")
    coef = np.zeros(ncol)
    coef[active] = coef_active
    pred = x @ coef
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    rel = np.abs(pred - y) / y
    fit = {"n": len(samples), "r2": r2, "rms_s": float(np.sqrt(ss_res / len(samples))),
           "max_rel_err": float(rel.max()), "median_rel_err": float(np.median(rel)),
           "weighting": "relative" if relative else "absolute", "notes": notes}
    return LinearCost(float(coef[0]), float(coef[1]), float(coef[2]), float(coef[3]), source=source, fit=fit,
                      per_attention_pair_s=float(coef[4]), single_token_step_s=float(coef[_ONE]))


def load_profile(path: str | Path) -> list[StepSample]:
    """A profile JSON: {"schema": ..., "samples": [...]} or a bare list of samples."""
    p, data = read_json(path)
    items = data.get("samples") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise ValueError(f"{p}: a step profile is a list of samples or an object with a 'samples' list")
    return [StepSample.from_dict(d) for d in items]


def write_profile(samples: list[StepSample], path: str | Path, meta: dict[str, Any] | None = None) -> None:
    """`meta`: where and how the steps were measured (model, dtype, threads, date), kept beside them."""
    doc: dict[str, Any] = {"schema": PROFILE_SCHEMA}
    if meta:
        doc["meta"] = meta
    doc["samples"] = [s.to_dict() for s in samples]
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def load_cost_model(path: str | Path) -> LinearCost:
    p, data = read_json(path)
    if not isinstance(data, dict) or data.get("kind", "linear") != "linear":
        raise ValueError(f"{p}: expected a linear cost model written by `inferlab simulate --save-cost-model`")
    return LinearCost.from_dict(data, origin=str(p))


def save_cost_model(model: LinearCost, path: str | Path) -> None:
    Path(path).write_text(json.dumps(model.to_dict(), indent=2) + "\n")


def roofline_efficiencies(cost: LinearCost, roofline: Roofline, context: float) -> tuple[float, float]:
    """(memory, compute) efficiencies at which the roofline reproduces a fitted cost model, so
    that `inferlab plan` can be calibrated too (--memory-efficiency, --compute-efficiency).

    memory: a one-sequence decode at `context` tokens, the most memory-bound step there is;
    compute: the marginal time of one more prompt token in a lone prefill (per prefill token
    plus its own context token), the most compute-bound. Each is capped at 1 (a fit can beat
    a bandwidth or FLOP rate measured on a busy machine) and must be > 0.
    """
    decode = StepShape.decode(1, context)
    est = roofline.step(decode)
    measured_decode = cost.step_time(decode)
    per_token = cost.per_prefill_token_s + cost.per_context_token_s
    if measured_decode <= 0 or per_token <= 0:
        raise ValueError("the cost model predicts no time for a decode or a prefill token; cannot calibrate a roofline")
    # est is at the roofline's own efficiencies; undo them to compare with the peak rates.
    memory_peak_s = est.memory_time_s * roofline.memory_efficiency
    compute_peak_s = roofline.matmul_flops_per_token / roofline.compute_rate
    return min(memory_peak_s / measured_decode, 1.0), min(compute_peak_s / per_token, 1.0)
