"""From request records to the numbers a benchmark reports: latency distributions,
throughput, goodput, SLO attainment and cost per million tokens.

Definitions follow vLLM's `vllm bench serve` (see `records.py` for TTFT/TPOT/ITL) so that a
run of ours and a run of theirs against the same server can be compared line by line:
percentiles use numpy's default (linear) method; throughput counts only requests that
completed; a request with one output token counts as TPOT 0 for goodput.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from inferlab.bench.records import RequestRecord, RequestStatus

DEFINITIONS = (
    "TTFT = send → first content chunk; TPOT = (E2E − TTFT)/(output tokens − 1) per request; "
    "ITL = every gap between content chunks, pooled (vLLM's definitions; GuideLLM and AIPerf call TPOT 'ITL')."
)

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 95.0, 99.0)


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in milliseconds; None = not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2el_ms is None

    def met_by(self, r: RequestRecord) -> bool:
        """A completed request meeting every objective. TPOT of a 1-token answer counts as 0 (as vLLM)."""
        if not r.ok or r.ttft is None:
            return False
        if self.ttft_ms is not None and r.ttft * 1e3 > self.ttft_ms:
            return False
        if self.tpot_ms is not None and (r.tpot or 0.0) * 1e3 > self.tpot_ms:
            return False
        return not (self.e2el_ms is not None and r.e2e * 1e3 > self.e2el_ms)

    def describe(self) -> str:
        parts = [f"{k}≤{v:g} ms" for k, v in (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms), ("E2E", self.e2el_ms)) if v is not None]
        return ", ".join(parts) or "none"


def parse_slo(items: Iterable[str] | None) -> SLO:
    """`["ttft:500", "tpot:50"]` (or `"ttft:500,tpot:50"`) → SLO. Bad syntax → ValueError."""
    values: dict[str, float] = {}
    for item in items or ():
        for part in str(item).split(","):
            part = part.strip()
            if not part:
                continue
            key, sep, raw = part.partition(":")
            key = key.strip().lower()
            if not sep or key not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"--goodput takes KEY:MS pairs with KEY one of ttft, tpot, e2el; got {part!r}")
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"--goodput {key} needs a number of milliseconds, got {raw!r}") from None
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"--goodput {key} must be a non-negative number of milliseconds, got {raw!r}")
            values[key] = value
    return SLO(ttft_ms=values.get("ttft"), tpot_ms=values.get("tpot"), e2el_ms=values.get("e2el"))


def parse_numbers(text: str, what: str, *, integer: bool = False, most: float = math.inf) -> tuple[float, ...]:
    """`"1,2,4"` → (1.0, 2.0, 4.0): the comma list a flag (`what`) takes, each in (0, most] (and
    whole when `integer`)."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            v = float(part)
        except ValueError:
            raise ValueError(f"{what} takes a comma list of numbers, got {part!r}") from None
        if not (math.isfinite(v) and 0 < v <= most) or (integer and not v.is_integer()):
            raise ValueError(f"{what}: each must be a {'whole number' if integer else 'number'} > 0"
                             + (f" and <= {most:g}" if most < math.inf else "") + f", got {part!r}")
        out.append(v)
    if not out:
        raise ValueError(f"{what} is empty")
    return tuple(out)


def parse_percentiles(text: str) -> tuple[float, ...]:
    """`"50,90,99"` → (50.0, 90.0, 99.0); each in (0, 100]."""
    return parse_numbers(text, "--metric-percentiles", most=100)


def parse_metric_names(text: str) -> tuple[str, ...]:
    """`"ttft,tpot"` → ("ttft", "tpot"); names from LATENCY_METRICS."""
    names = tuple(n.strip().lower() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in LATENCY_METRICS]
    if bad or not names:
        raise ValueError(f"--percentile-metrics takes a comma list of {', '.join(LATENCY_METRICS)}; got {text!r}")
    return names


def percentile_key(p: float) -> str:
    """99 → "p99", 99.9 → "p99.9" (vLLM's JSON keys)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


def cost_per_million(usd_per_hour: float, tokens_per_s: float) -> float | None:
    """Dollars per million tokens when the machine costs `usd_per_hour` and makes `tokens_per_s`.

    usd_per_hour / (tokens_per_s × 3600) × 1e6. None when nothing was made.
    """
    if tokens_per_s <= 0:
        return None
    return usd_per_hour / (tokens_per_s * 3600.0) * 1e6


@dataclass(frozen=True)
class Distribution:
    """One latency metric over a run, in milliseconds."""

    count: int
    mean: float
    median: float
    std: float
    percentiles: dict[float, float]  # p → value

    @classmethod
    def of(cls, values_s: Sequence[float], percentiles: Sequence[float]) -> Distribution | None:
        """From values in seconds; None for an empty list (a run where nothing completed)."""
        if len(values_s) == 0:
            return None
        a = np.asarray(values_s, dtype=float) * 1e3
        return cls(
            count=int(a.size),
            mean=float(np.mean(a)),
            median=float(np.median(a)),
            std=float(np.std(a)),
            percentiles={float(p): float(np.percentile(a, p)) for p in percentiles},
        )


@dataclass(frozen=True)
class RunSummary:
    """Everything one load level measured. Token throughputs count completed requests only (as vLLM)."""

    num_requests: int
    completed: int
    failed: int
    incomplete: int
    timeout: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    latency: dict[str, Distribution | None]  # "ttft" | "tpot" | "itl" | "e2el" → distribution
    max_concurrency: int | None = None
    per_client_output_throughput: float | None = None  # output_throughput / max_concurrency
    slo: SLO = field(default_factory=SLO)
    good_requests: int | None = None  # completed requests meeting every SLO (None without an SLO)
    request_goodput: float | None = None  # good requests / s
    slo_attainment: float | None = None  # good requests / all requests sent
    usd_per_hour: float | None = None
    cost_per_million_output_usd: float | None = None
    cost_per_million_input_usd: float | None = None
    output_token_sources: dict[str, int] = field(default_factory=dict)  # "usage"/"tokenizer"/"chunks" → requests
    # Prompt tokens the server reused from its prefix cache (usage.prompt_tokens_details), and in how
    # many completed requests; None when the server reports no such count.
    cached_prompt_tokens: int | None = None
    cached_requests: int | None = None
    errors: dict[str, int] = field(default_factory=dict)  # distinct error line → how many requests

    @property
    def errored(self) -> int:
        """Requests that did not complete (vLLM's `failed` counts all of these)."""
        return self.failed + self.incomplete + self.timeout

    def to_dict(self) -> dict[str, Any]:
        """Flat, vLLM-style keys (mean_ttft_ms, p99_ttft_ms, ...) for JSON and comparison: the
        fields in their order, then each latency metric's statistics."""
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "latency"}
        d["slo"] = {"ttft_ms": self.slo.ttft_ms, "tpot_ms": self.slo.tpot_ms, "e2el_ms": self.slo.e2el_ms}
        d["output_token_sources"], d["errors"] = dict(self.output_token_sources), dict(self.errors)
        for name, dist in self.latency.items():
            for stat in ("mean", "median", "std"):
                d[f"{stat}_{name}_ms"] = getattr(dist, stat) if dist else None
            if dist:
                for p, v in dist.percentiles.items():
                    d[f"{percentile_key(p)}_{name}_ms"] = v
        return d


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    metrics: Sequence[str] = LATENCY_METRICS,
    slo: SLO | None = None,
    usd_per_hour: float | None = None,
    max_concurrency: int | None = None,
) -> RunSummary:
    """Reduce one run's records. `duration_s` runs from the first send to the last answer."""
    slo = slo or SLO()
    by_status = Counter(r.status for r in records)
    done = [r for r in records if r.ok]
    dur = duration_s if duration_s > 0 else math.nan
    total_in = sum(r.prompt_tokens or 0 for r in done)
    total_out = sum(r.output_tokens or 0 for r in done)

    values: dict[str, list[float]] = {
        "ttft": [r.ttft for r in done if r.ttft is not None],
        "tpot": [t for r in done if (t := r.tpot) is not None],
        "itl": [g for r in done for g in r.itls],
        "e2el": [r.e2e for r in done],
    }
    latency = {m: Distribution.of(values[m], percentiles) for m in metrics}

    good = goodput = attainment = None
    if not slo.empty:
        good = sum(1 for r in done if slo.met_by(r))
        goodput = _rate(good, dur)
        attainment = good / len(records) if records else 0.0

    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
    out_tps = _rate(total_out, dur)
    in_tps = _rate(total_in, dur)
    errors = Counter(r.error for r in records if not r.ok and r.error)
    return RunSummary(
        num_requests=len(records),
        completed=len(done),
        failed=by_status[RequestStatus.FAILED],
        incomplete=by_status[RequestStatus.INCOMPLETE],
        timeout=by_status[RequestStatus.TIMEOUT],
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=_rate(len(done), dur),
        output_throughput=out_tps,
        total_token_throughput=_rate(total_in + total_out, dur),
        latency=latency,
        slo=slo,
        good_requests=good,
        request_goodput=goodput,
        slo_attainment=attainment,
        max_concurrency=max_concurrency,
        per_client_output_throughput=out_tps / max_concurrency if max_concurrency else None,
        usd_per_hour=usd_per_hour,
        cost_per_million_output_usd=cost_per_million(usd_per_hour, out_tps) if usd_per_hour is not None else None,
        cost_per_million_input_usd=cost_per_million(usd_per_hour, in_tps) if usd_per_hour is not None else None,
        output_token_sources=dict(Counter(r.output_tokens_source for r in done if r.output_tokens_source)),
        errors=dict(errors.most_common(10)),
        cached_prompt_tokens=sum(cached) if cached else None,
        cached_requests=sum(1 for c in cached if c > 0) if cached else None,
    )


def _rate(count: float, duration_s: float) -> float:
    """count / duration, 0 for an empty or zero-length run (never NaN in a report)."""
    if not count or not math.isfinite(duration_s) or duration_s <= 0:
        return 0.0
    return count / duration_s


def distserve_goodput(points: Sequence[tuple[float, float]], target: float = 0.9) -> float | None:
    """DistServe's goodput of a sweep: the highest load whose SLO attainment is ≥ `target`.

    `points` are (load, attainment) pairs. Only the loads from the lowest up to the first
    one that misses count: a pass above a miss is noise, not capacity we could promise.
    None when even the lowest load misses.
    """
    if not 0 < target <= 1:
        raise ValueError(f"the SLO attainment target must be in (0, 1], got {target}")
    best = None
    for load, attained in sorted(points):
        if attained < target:
            break
        best = load
    return best
