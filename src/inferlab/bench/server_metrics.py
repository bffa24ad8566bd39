"""The server's own view during a run: poll its Prometheus `/metrics` and summarize the queue
(running, waiting) and KV-cache usage beside the client's latencies.

Reads vLLM's names (which our server exports too) and llama.cpp's equivalents:

| what            | vLLM / inferlab              | llama.cpp                       |
|-----------------|------------------------------|---------------------------------|
| running         | vllm:num_requests_running    | llamacpp:requests_processing    |
| waiting         | vllm:num_requests_waiting    | llamacpp:requests_deferred      |
| KV usage (0–1)  | vllm:kv_cache_usage_perc     | llamacpp:kv_cache_usage_ratio   |

Counters (vLLM names) are read at the start and the end, and their differences reported:
tokens the server counted, preemptions, prefix-cache hits, and speculative decoding's drafts:
the acceptance rate (accepted / draft tokens), the mean acceptance length (1 + accepted /
drafts: tokens a verification step yields on average) and the acceptance at each draft
position (accepted there / drafts), as vLLM's own spec-decode logging defines them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

GAUGES: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running", "llamacpp:requests_processing"),
    "waiting": ("vllm:num_requests_waiting", "llamacpp:requests_deferred"),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "llamacpp:kv_cache_usage_ratio"),
}
COUNTERS: dict[str, str] = {
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "preemptions": "vllm:num_preemptions_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "spec_drafts": "vllm:spec_decode_num_drafts_total",
    "spec_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "spec_accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"  # labelled by position: spec_accepted_pos_<j>


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {our name: value}, summing over label sets (several models/engines)."""
    totals: dict[str, float] = {}
    wanted = {n: key for key, names in GAUGES.items() for n in names} | {n: key for key, n in COUNTERS.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = wanted.get(sample.name)
            if sample.name == PER_POSITION and "position" in sample.labels:
                key = f"spec_accepted_pos_{sample.labels['position']}"
            if key is not None:
                totals[key] = totals.get(key, 0.0) + float(sample.value)
    return totals


@dataclass
class ServerMetricsSample:
    t: float  # seconds since the scrape began
    values: dict[str, float]


@dataclass
class ServerMetricsSummary:
    """Gauges over the run (mean and max), counter differences, and the raw samples."""

    available: bool
    note: str = ""
    gauges: dict[str, dict[str, float]] = field(default_factory=dict)  # name → {"mean", "max"}
    counter_deltas: dict[str, float] = field(default_factory=dict)
    prefix_cache_hit_rate: float | None = None
    samples: list[ServerMetricsSample] = field(default_factory=list)

    @property
    def speculative(self) -> dict[str, Any] | None:
        return speculative_summary(self.counter_deltas)

    def to_dict(self) -> dict[str, Any]:
        return {
            "available": self.available,
            "note": self.note,
            "gauges": self.gauges,
            "counter_deltas": self.counter_deltas,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "speculative": self.speculative,
            "samples": [{"t": round(s.t, 4), **s.values} for s in self.samples],
        }


def summarize_samples(samples: list[ServerMetricsSample]) -> ServerMetricsSummary:
    """Mean/max of each gauge, last − first of each counter."""
    if not samples:
        return ServerMetricsSummary(available=False, note="no /metrics samples")
    gauges = {}
    for key in GAUGES:
        xs = [s.values[key] for s in samples if key in s.values]
        if xs:
            gauges[key] = {"mean": sum(xs) / len(xs), "max": max(xs)}
    deltas = {}
    positions = sorted({k for s in samples for k in s.values if k.startswith("spec_accepted_pos_")},
                       key=lambda k: int(k.rsplit("_", 1)[1]))
    for key in [*COUNTERS, *positions]:
        xs = [s.values[key] for s in samples if key in s.values]
        if xs:
            deltas[key] = xs[-1] - xs[0]
    q, h = deltas.get("prefix_cache_queries"), deltas.get("prefix_cache_hits")
    return ServerMetricsSummary(
        available=True,
        gauges=gauges,
        counter_deltas=deltas,
        prefix_cache_hit_rate=(h / q) if q and h is not None else None,
        samples=samples,
    )


def speculative_summary(deltas: dict[str, float]) -> dict[str, Any] | None:
    """Speculative decoding over the run from counter differences (None: no drafts verified)."""
    drafts, tokens = deltas.get("spec_drafts", 0.0), deltas.get("spec_draft_tokens", 0.0)
    if drafts <= 0 or tokens <= 0:
        return None
    accepted = deltas.get("spec_accepted_tokens", 0.0)
    per_pos, j = [], 0
    while f"spec_accepted_pos_{j}" in deltas:
        per_pos.append(deltas[f"spec_accepted_pos_{j}"] / drafts)
        j += 1
    return {"drafts": drafts, "draft_tokens": tokens, "accepted_tokens": accepted,
            "acceptance_rate": accepted / tokens, "mean_acceptance_length": 1 + accepted / drafts,
            "acceptance_per_position": per_pos}


class MetricsScraper:
    """Polls `/metrics` every `interval_s` in the background while a run goes on.

    Usage: `async with MetricsScraper(http, url) as s: ...run...` then `s.summary()`.
    A server without /metrics gives `available=False` and never fails the run.
    """

    def __init__(self, http: httpx.AsyncClient, base_url: str, interval_s: float = 0.5, headers: dict | None = None):
        self._http, self._url, self._interval = http, base_url + "/metrics", interval_s
        self._headers = headers or {}
        self._samples: list[ServerMetricsSample] = []
        self._task: asyncio.Task | None = None
        self._t0 = 0.0
        self._error = ""

    async def _scrape_once(self) -> None:
        try:
            r = await self._http.get(self._url, headers=self._headers, timeout=5.0)
            if r.status_code != 200:
                self._error = f"GET /metrics answered {r.status_code}"
                return
            values = parse_metrics(r.text)
        except (httpx.HTTPError, ValueError) as e:
            self._error = f"GET /metrics failed: {type(e).__name__}"
            return
        if values:
            self._samples.append(ServerMetricsSample(time.perf_counter() - self._t0, values))
        else:
            self._error = "/metrics has none of the vLLM or llama.cpp gauges"

    async def _loop(self) -> None:
        while True:
            await self._scrape_once()
            await asyncio.sleep(self._interval)

    async def __aenter__(self) -> MetricsScraper:
        self._t0 = time.perf_counter()
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self._scrape_once()  # a last sample so that counter differences cover the whole run

    def summary(self) -> ServerMetricsSummary:
        if not self._samples:
            return ServerMetricsSummary(available=False, note=self._error or "no /metrics samples")
        return summarize_samples(self._samples)
