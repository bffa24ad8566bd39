"""The dashboard's figures: the last minute of the engine, kept in memory, one snapshot a second.

`LiveStats` is an `EngineObserver` beside `ServerMetrics` (`Observers` calls both): Prometheus'
histograms are cumulative, and the dashboard wants percentiles over the last minute, so this
keeps the raw samples of the window (bounded deques) and the token counts per step. Hooks run
on the engine thread, `snapshot()` on the event loop: a lock guards the deques.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from inferlab.engine.outputs import SchedulerStats
from inferlab.engine.request import RequestOutput

logger = logging.getLogger(__name__)

WINDOW_S = 60.0  # percentiles and the prefix-cache hit rate: over the last minute
RATE_S = 3.0  # tok/s: averaged over the last few seconds (moves each second, not jittery)
MAX_SAMPLES = 50_000  # per deque: ~800 tokens/s for a minute


class Observers:
    """Several `EngineObserver`s as one (AsyncLLM takes one); one that raises does not keep
    the others from their call."""

    def __init__(self, *observers: Any):
        self.observers = observers

    def _each(self, hook: str, *args: Any) -> None:
        for o in self.observers:
            try:
                getattr(o, hook)(*args)
            except Exception:  # noqa: BLE001 - metrics must never break serving
                logger.exception("engine observer %s.%s failed", type(o).__name__, hook)

    def on_ready(self, engine: Any) -> None:
        self._each("on_ready", engine)

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        self._each("on_outputs", outputs, now)

    def on_stats(self, stats: SchedulerStats) -> None:
        self._each("on_stats", stats)

    def on_request_dropped(self, request_id: str, reason: str) -> None:
        self._each("on_request_dropped", request_id, reason)


def percentiles(values: list[float], qs: tuple[float, ...] = (50, 90, 99)) -> dict[str, float | None]:
    """Nearest-rank percentiles (None without samples)."""
    if not values:
        return {f"p{q:g}": None for q in qs}
    ordered = sorted(values)
    n = len(ordered)
    return {f"p{q:g}": ordered[min(n - 1, max(0, math.ceil(q / 100 * n) - 1))] for q in qs}


class LiveStats:
    """The last minute: tokens per step, TTFT and inter-token gaps, scheduler counters."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()
        self._tokens: collections.deque[tuple[float, int, int]] = collections.deque(maxlen=MAX_SAMPLES)  # (t, prompt, gen)
        self._ttft: collections.deque[tuple[float, float]] = collections.deque(maxlen=MAX_SAMPLES)
        self._itl: collections.deque[tuple[float, float]] = collections.deque(maxlen=MAX_SAMPLES)
        self._counters: collections.deque[tuple[float, int, int, int]] = collections.deque()  # (t, queries, hits, preempt)
        self._last_token: dict[str, float] = {}
        self._finished: collections.deque[tuple[float, str]] = collections.deque(maxlen=MAX_SAMPLES)  # (t, reason)
        self.stats = SchedulerStats()
        self.ready = False

    # ------------------------------------------------------------ EngineObserver hooks
    def on_ready(self, engine: Any) -> None:
        self.ready = True

    def on_stats(self, stats: SchedulerStats) -> None:
        now = self.clock()
        with self._lock:
            self.stats = stats
            c = self._counters
            # one entry per ~half second is enough for a one-minute difference
            if not c or now - c[-1][0] >= 0.5:
                c.append((now, stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions))
            while len(c) > 2 and c[1][0] < now - WINDOW_S:
                c.popleft()

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        prompt = gen = 0
        with self._lock:
            last = self._last_token
            for out in outputs:
                new = sum(len(c.token_ids_delta) for c in out.outputs)
                if new:
                    t = out.metrics.last_token_time or now
                    prev = last.get(out.request_id)
                    if prev is None:
                        first = out.metrics.first_token_time or t
                        self._ttft.append((now, max(first - out.metrics.arrival_time, 0.0)))
                        prompt += len(out.prompt_token_ids) - out.metrics.num_cached_tokens
                    else:
                        self._itl.append((now, max(t - prev, 0.0)))
                    last[out.request_id] = t
                    gen += new
                if out.finished:
                    last.pop(out.request_id, None)
                    reasons = [c.finish_reason for c in out.outputs if c.finish_reason]
                    self._finished.append((now, "error" if out.error else (reasons[0] if reasons else "abort")))
            if prompt or gen:
                self._tokens.append((now, prompt, gen))

    def on_request_dropped(self, request_id: str, reason: str) -> None:
        with self._lock:
            self._last_token.pop(request_id, None)
            self._finished.append((self.clock(), reason))

    # ------------------------------------------------------------ the snapshot
    def snapshot(self) -> dict[str, Any]:
        """The dashboard's figures now (JSON-ready)."""
        now = self.clock()
        since = now - WINDOW_S
        with self._lock:
            stats = self.stats
            tokens = [x for x in self._tokens if x[0] > now - RATE_S]
            ttft = [v for t, v in self._ttft if t > since]
            itl = [v for t, v in self._itl if t > since]
            finished = [r for t, r in self._finished if t > since]
            counters = list(self._counters)
        prompt_rate = sum(x[1] for x in tokens) / RATE_S
        gen_rate = sum(x[2] for x in tokens) / RATE_S
        hit_rate = None
        preempted = 0
        if counters:
            old = next((c for c in counters if c[0] >= since), counters[0])
            queries = stats.prefix_cache_queries - old[1]
            hits = stats.prefix_cache_hits - old[2]
            hit_rate = hits / queries if queries > 0 else None
            preempted = stats.num_preemptions - old[3]
        reasons = collections.Counter(finished)
        return {
            "time": time.time(),
            "ready": self.ready,
            "running": stats.num_running,
            "waiting": stats.num_waiting,
            "kv_cache_usage": stats.kv_cache_usage,
            "num_blocks": stats.num_blocks,
            "prompt_tokens_per_s": prompt_rate,
            "output_tokens_per_s": gen_rate,
            "prefix_cache_hit_rate": hit_rate,
            "prefix_cache_hit_rate_total": (stats.prefix_cache_hits / stats.prefix_cache_queries
                                            if stats.prefix_cache_queries else None),  # fmt: skip
            "preemptions_total": stats.num_preemptions,
            "preemptions_last_minute": preempted,
            "ttft_s": {**percentiles(ttft), "n": len(ttft)},
            "itl_s": {**percentiles(itl), "n": len(itl)},
            "finished_last_minute": dict(reasons),
            "window_s": WINDOW_S,
        }
