"""Several load levels in one command: a list of rates or concurrencies, or doubling until the
server saturates (throughput stops growing, the SLO fails, or requests start failing).

The sweep only decides *which* level comes next and *when to stop*; running a level is the
caller's job (`run_level`), so the logic is tested without a server.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from inferlab.bench.arrivals import LoadSpec
from inferlab.bench.metrics import RunSummary, distserve_goodput, parse_numbers
from inferlab.bench.runner import RunResult

KINDS = ("rate", "concurrency")


@dataclass(frozen=True)
class SweepPlan:
    """Which levels to run. `levels=None`: start at `start` and double, at most `max_steps` times."""

    kind: str  # "rate" (requests/s, open loop) | "concurrency" (clients, closed loop)
    levels: tuple[float, ...] | None = None
    start: float = 1.0
    max_steps: int = 10
    stop_at_saturation: bool = True  # automatic sweeps stop; explicit lists run every level

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"a sweep is over rate or concurrency, got {self.kind!r}")
        if self.levels is not None and not self.levels:
            raise ValueError("a sweep needs at least one level")

    def iter_levels(self) -> Iterator[float]:
        if self.levels is not None:
            yield from self.levels
            return
        level = self.start
        for _ in range(self.max_steps):
            yield level
            level *= 2

    def load_at(self, level: float, base: LoadSpec) -> LoadSpec:
        """The load of one level: the swept knob set, the others kept from `base`."""
        if self.kind == "rate":
            return LoadSpec(request_rate=level, burstiness=base.burstiness, max_concurrency=base.max_concurrency)
        return LoadSpec(request_rate=base.request_rate, burstiness=base.burstiness, max_concurrency=int(level))


def parse_sweep(text: str) -> SweepPlan:
    """`rate:1,2,4`, `concurrency:1,8,32`, or `rate` / `concurrency` (double until saturation)."""
    kind, sep, rest = text.partition(":")
    kind = kind.strip().lower()
    if kind not in KINDS:
        raise ValueError(f"--sweep takes rate[:LEVELS] or concurrency[:LEVELS], got {text!r}")
    if not sep or not rest.strip():
        return SweepPlan(kind=kind)
    levels = parse_numbers(rest, "--sweep", integer=kind == "concurrency")
    return SweepPlan(kind=kind, levels=levels, stop_at_saturation=False)


@dataclass(frozen=True)
class SaturationRule:
    """When a level counts as saturated."""

    min_gain: float = 0.10  # output throughput must beat the best lower level by this fraction
    max_error_fraction: float = 0.05  # more requests than this not completing
    slo_target: float = 0.90  # SLO attainment below this (only with an SLO)

    def reason(self, history: list[RunSummary]) -> str | None:
        """Why the last level in `history` is saturated, or None."""
        last = history[-1]
        if last.num_requests and last.errored / last.num_requests > self.max_error_fraction:
            return f"{last.errored} of {last.num_requests} requests did not complete"
        if last.slo_attainment is not None and last.slo_attainment < self.slo_target:
            return f"SLO attainment {last.slo_attainment:.0%} < {self.slo_target:.0%}"
        if len(history) >= 2:
            best = max(s.output_throughput for s in history[:-1])
            if last.output_throughput < best * (1 + self.min_gain):
                return f"output throughput grew less than {self.min_gain:.0%} ({best:.1f} → {last.output_throughput:.1f} tok/s)"
        return None


@dataclass
class SweepPoint:
    level: float
    result: RunResult
    summary: RunSummary


@dataclass
class SweepResult:
    plan: SweepPlan
    points: list[SweepPoint] = field(default_factory=list)
    saturated_at: float | None = None  # the first level judged saturated
    stop_reason: str | None = None  # why that level is saturated
    stopped_early: bool = False
    slo_target: float = 0.9
    distserve_goodput: float | None = None  # highest level with SLO attainment ≥ target (None: no SLO or none)

    def to_dict(self) -> dict:
        return {
            "kind": self.plan.kind,
            "levels": [p.level for p in self.points],
            "automatic": self.plan.levels is None,
            "saturated_at": self.saturated_at,
            "stop_reason": self.stop_reason,
            "stopped_early": self.stopped_early,
            "slo_target": self.slo_target,
            "distserve_goodput": self.distserve_goodput,
        }


async def run_sweep(
    plan: SweepPlan,
    base: LoadSpec,
    run_level: Callable[[int, LoadSpec], Awaitable[tuple[RunResult, RunSummary]]],
    rule: SaturationRule = SaturationRule(),
) -> SweepResult:
    """Run the levels in order; stop after the first saturated level when the plan says so."""
    out = SweepResult(plan=plan, slo_target=rule.slo_target)
    history: list[RunSummary] = []
    for k, level in enumerate(plan.iter_levels()):
        result, summary = await run_level(k, plan.load_at(level, base))
        out.points.append(SweepPoint(level, result, summary))
        history.append(summary)
        reason = rule.reason(history)
        if reason and out.saturated_at is None:
            out.saturated_at, out.stop_reason = level, reason
            if plan.stop_at_saturation:
                out.stopped_early = True
                break
    attained = [(p.level, p.summary.slo_attainment) for p in out.points if p.summary.slo_attainment is not None]
    if attained:
        out.distserve_goodput = distserve_goodput(attained, rule.slo_target)
    return out
