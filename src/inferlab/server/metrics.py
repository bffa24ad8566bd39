"""Prometheus metrics under vLLM's names, types and buckets, so dashboards and routers work unchanged.

`ServerMetrics` is an `EngineObserver`: `AsyncLLM` calls it on the engine thread after each step
(prometheus_client's metrics are thread-safe). Every app gets its own `CollectorRegistry`, so
several servers can live in one process (the tests start many).

Time splits (vLLM's): queue = arrival → first scheduled; prefill = first scheduled → first token;
decode = first token → last token; TTFT = arrival → first token (tokenization included, since
the server stamps the arrival before it tokenizes); e2e = arrival → finished.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from inferlab.engine.outputs import SchedulerStats
from inferlab.engine.request import RequestOutput
from inferlab.server.quotas import LIMITS

# vLLM exposes no `*_created` series; dashboards and routers that read ours expect the same set.
disable_created_metrics()

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics", "TenantMetrics", "build_1_2_5_buckets", "outcome_of_status"]

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
TOKEN_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0]  # fmt: skip
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort", "error")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class _RequestTrack:
    """What the metrics remember of one request between steps."""

    __slots__ = ("last_token_time", "num_generated")

    def __init__(self) -> None:
        self.last_token_time: float | None = None
        self.num_generated = 0


class ServerMetrics:
    """The /metrics registry and the engine hooks that feed it (all called on the engine thread)."""

    def __init__(self, model_name: str | None = None, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name  # None: the engine's model name, known once it has loaded
        self._ready = False
        self._tracks: dict[str, _RequestTrack] = {}
        self._last: dict[str, int] = {"queries": 0, "hits": 0, "preemptions": 0}

    def render(self) -> bytes:
        """The Prometheus text exposition of this app's registry."""
        return generate_latest(self.registry)

    # ------------------------------------------------------------ EngineObserver hooks
    def on_ready(self, engine: Any) -> None:
        """Create the metrics once the engine is built (buckets need max_model_len)."""
        if self.model_name is None:
            self.model_name = engine.model_name
        labels = {"model_name": self.model_name, "engine": "0"}
        names = list(labels)
        reg = self.registry

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, names, registry=reg).labels(**labels)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=reg).labels(**labels)

        def histogram(name: str, doc: str, buckets: list) -> Any:
            return Histogram(name, doc, names, buckets=buckets, registry=reg).labels(**labels)

        self.num_requests_running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        stats = engine.get_stats()
        info = Gauge("vllm:cache_config_info", "Information of the KV cache configuration.",
                     [*names, "block_size", "num_gpu_blocks"], registry=reg)
        info.labels(**labels, block_size=str(stats.block_size), num_gpu_blocks=str(stats.num_blocks)).set(1)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*names, "finished_reason"], registry=reg)
        self.request_success = {r: success.labels(**labels, finished_reason=r) for r in FINISH_REASONS}

        lengths = build_1_2_5_buckets(int(getattr(engine, "max_model_len", 2048)))
        tok, req = TOKEN_LATENCY_BUCKETS, REQUEST_LATENCY_BUCKETS
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", tok)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", tok)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", req)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", req)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", req)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", req)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", lengths)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", lengths)
        self.spec: dict[str, Any] | None = None
        spec_config = getattr(engine, "speculative_config", None)
        if spec_config is not None:  # vLLM registers these only with speculative decoding on
            per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                              "Accepted draft tokens at each draft position.", [*names, "position"], registry=reg)
            self.spec = {
                "drafts": counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
                "draft_tokens": counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
                "accepted": counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
                "per_pos": [per_pos.labels(**labels, position=str(j))
                            for j in range(spec_config.num_speculative_tokens)],
            }
            self._last.update(drafts=0, draft_tokens=0, accepted=0)
            self._last_per_pos = [0] * spec_config.num_speculative_tokens
        self._ready = True
        self.on_stats(stats)

    def on_stats(self, stats: SchedulerStats) -> None:
        if not self._ready:
            return
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        # The engine reports cumulative totals; counters take the increase since the last call.
        for key, value, metric in (
            ("queries", stats.prefix_cache_queries, self.prefix_cache_queries),
            ("hits", stats.prefix_cache_hits, self.prefix_cache_hits),
            ("preemptions", stats.num_preemptions, self.num_preemptions),
        ):
            self._inc(key, value, metric)
        if self.spec is not None:
            for key, value in (("drafts", stats.spec_num_drafts), ("draft_tokens", stats.spec_num_draft_tokens),
                               ("accepted", stats.spec_num_accepted_tokens)):
                self._inc(key, value, self.spec[key])
            for j, value in enumerate(stats.spec_accepted_per_pos[: len(self._last_per_pos)]):
                if value > self._last_per_pos[j]:
                    self.spec["per_pos"][j].inc(value - self._last_per_pos[j])
                    self._last_per_pos[j] = value

    def _inc(self, key: str, value: int, metric: Any) -> None:
        """Add the increase of a cumulative total since the last call."""
        delta = value - self._last[key]
        if delta > 0:
            metric.inc(delta)
        self._last[key] = max(value, self._last[key])

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        """Per step: token counters, TTFT and inter-token gaps; the request histograms at finish."""
        if not self._ready:
            return
        tracks = self._tracks
        new_tokens_total = 0
        for out in outputs:
            new_tokens = 0
            for c in out.outputs:
                new_tokens += len(c.token_ids_delta)
            track = tracks.get(out.request_id)
            if track is None:
                track = tracks[out.request_id] = _RequestTrack()
            m = out.metrics
            token_time = m.last_token_time or now
            if new_tokens:
                if track.last_token_time is None:
                    first = m.first_token_time or token_time
                    self.ttft.observe(max(first - m.arrival_time, 0.0))
                    self.prompt_tokens.inc(len(out.prompt_token_ids))
                else:
                    self.itl.observe(max(token_time - track.last_token_time, 0.0))
                track.last_token_time = token_time
                track.num_generated += new_tokens
                new_tokens_total += new_tokens
            if out.finished:
                del tracks[out.request_id]
                self._observe_finished(out, track, now)
        if new_tokens_total:
            self.generation_tokens.inc(new_tokens_total)

    def on_request_dropped(self, request_id: str, reason: str) -> None:
        """A request the engine will not report again (aborted, timed out, failed)."""
        if not self._ready:
            return
        self._tracks.pop(request_id, None)
        self.request_success.get(reason, self.request_success["abort"]).inc()

    # ------------------------------------------------------------ helpers
    def _observe_finished(self, out: RequestOutput, track: _RequestTrack, now: float) -> None:
        m = out.metrics
        reason = "error" if out.error else _request_finish_reason(out)
        self.request_success[reason].inc()
        finished = m.finished_time or now
        self.e2e.observe(max(finished - m.arrival_time, 0.0))
        if m.first_scheduled_time is not None:
            self.queue_time.observe(max(m.first_scheduled_time - m.arrival_time, 0.0))
            if m.first_token_time is not None:
                self.prefill_time.observe(max(m.first_token_time - m.first_scheduled_time, 0.0))
        decode = 0.0
        if m.first_token_time is not None and m.last_token_time is not None:
            decode = max(m.last_token_time - m.first_token_time, 0.0)
            self.decode_time.observe(decode)
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        generated = max(track.num_generated, sum(len(c.token_ids) for c in out.outputs))
        self.request_generation_tokens.observe(generated)
        per_seq = generated / max(len(out.outputs), 1)
        if per_seq > 1:
            self.tpot.observe(decode / (per_seq - 1))


def _request_finish_reason(out: RequestOutput) -> str:
    """One label per request: "length" if any sequence hit a limit, else that of the first."""
    reasons = [c.finish_reason for c in out.outputs if c.finish_reason]
    if not reasons:
        return "abort"
    if "length" in reasons:
        return "length"
    return reasons[0] if reasons[0] in FINISH_REASONS else "stop"


TENANT_OUTCOMES = ("ok", "rate_limited", "rejected", "error", "disconnected")


class TenantMetrics:
    """Per-tenant series in the app's registry, labelled only with the tenants of the keys file
    (created up front: no label value ever comes from a request, so cardinality is bounded).

    Called on the event loop (admission, response ends), not the engine thread.
    """

    def __init__(self, registry: CollectorRegistry, tenant_names: tuple[str, ...]):
        requests = Counter(
            "inferlab:tenant_requests", "Generation requests by tenant and outcome.", ["tenant", "outcome"], registry=registry
        )
        prompt = Counter("inferlab:tenant_prompt_tokens", "Prompt tokens processed, by tenant.", ["tenant"], registry=registry)
        generation = Counter(
            "inferlab:tenant_generation_tokens", "Generated tokens, by tenant.", ["tenant"], registry=registry
        )
        limited = Counter(
            "inferlab:tenant_rate_limited",
            "Requests refused with 429, by tenant and the limit they hit.",
            ["tenant", "limit"],
            registry=registry,
        )
        in_flight = Gauge("inferlab:tenant_requests_in_flight", "Admitted requests not yet ended, by tenant.", ["tenant"],
                          registry=registry)  # fmt: skip
        self._requests = {(t, o): requests.labels(tenant=t, outcome=o) for t in tenant_names for o in TENANT_OUTCOMES}
        self._prompt = {t: prompt.labels(tenant=t) for t in tenant_names}
        self._generation = {t: generation.labels(tenant=t) for t in tenant_names}
        self._limited = {(t, k): limited.labels(tenant=t, limit=k) for t in tenant_names for k in LIMITS}
        self._in_flight = {t: in_flight.labels(tenant=t) for t in tenant_names}

    def outcome(self, tenant: str, outcome: str) -> None:
        self._requests[(tenant, outcome)].inc()

    def tokens(self, tenant: str, prompt_tokens: int, generation_tokens: int) -> None:
        if prompt_tokens:
            self._prompt[tenant].inc(prompt_tokens)
        if generation_tokens:
            self._generation[tenant].inc(generation_tokens)

    def rate_limited(self, tenant: str, limit: str) -> None:
        self._limited[(tenant, limit)].inc()

    def in_flight(self, tenant: str, value: int) -> None:
        self._in_flight[tenant].set(value)


def outcome_of_status(status: int) -> str:
    """The outcome label of a request that ended with this HTTP status."""
    if status < 400:
        return "ok"
    if status == 429:
        return "rate_limited"
    if status == 499:
        return "disconnected"
    return "rejected" if status < 500 else "error"
