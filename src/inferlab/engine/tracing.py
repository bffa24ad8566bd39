"""Per-request traces: where one request's time went, span by span (seed 002 lesson 08).

    arrival ─ queue ─► first scheduled ─ prefill (chunk, chunk, ...) ─► first token ─ decode ─► finished ─ finish ─► response end
                                                                          └─ stream (first token handed to HTTP → response end) ─┘

The engine records what it sees (arrival, each prefill chunk's step, the request's metrics at
its finish or abort); the server adds the end of the response (`complete`). The phases queue,
prefill, decode and finish (abort, error) are contiguous, so they sum to the root span, the
request's time from arrival to the response's end; prefill chunks and the stream span overlap
them. Cheap: one dict lookup per prefill chunk, nothing per decode token; bounded: the newest
`capacity` requests, at most `max_chunks` chunk spans each (the rest counted). Thread-safe (the
engine thread records, the event loop completes and reads).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from inferlab.engine.outputs import SchedulerOutput
from inferlab.engine.request import RequestOutput

PHASES = ("queue", "prefill", "decode")


@dataclass
class Span:
    name: str
    start: float  # time.monotonic() seconds
    end: float
    parent: str | None = "llm_request"  # the parent span's name (None: the root)
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class RequestTrace:
    """What the engine and the server recorded of one request (monotonic seconds)."""

    request_id: str
    arrival: float
    chunks: list[tuple[float, float, int, int]] = field(default_factory=list)  # (start, end, tokens, start_pos)
    chunks_dropped: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None  # the engine's finish or abort
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    stream_start: float | None = None  # the server: first output handed to the HTTP side
    end: float | None = None  # the server: the response ended (None: not yet, or no server)

    @property
    def done(self) -> bool:
        return self.finished is not None

    def spans(self) -> list[Span]:
        """The root first, then the contiguous phases, then chunks and the stream span."""
        last = max(t for t in (self.arrival, self.first_scheduled, self.first_token, self.last_token,
                               self.finished, self.end, *(c[1] for c in self.chunks)) if t is not None)  # fmt: skip
        finished = self.finished if self.finished is not None else last
        end = max(last, finished)
        root = Span("llm_request", self.arrival, end, None, {
            "gen_ai.request.id": self.request_id,
            "gen_ai.usage.prompt_tokens": self.num_prompt_tokens,
            "gen_ai.usage.completion_tokens": self.num_generated_tokens,
            "inferlab.cached_tokens": self.num_cached_tokens,
            "inferlab.preemptions": self.num_preemptions,
            "inferlab.finish_reason": self.finish_reason or "running",
        })  # fmt: skip
        spans = [root]
        cursor = self.arrival
        for name, until in zip(PHASES, (self.first_scheduled, self.first_token, finished)):
            stop = until if until is not None else finished
            spans.append(Span(name, cursor, max(stop, cursor), attributes={"inferlab.phase": True}))
            cursor = max(stop, cursor)
            if until is None:
                break
        spans[-1].end = max(spans[-1].end, finished)
        cursor = spans[-1].end
        tail = "finish" if self.finish_reason in (None, "stop", "length") else self.finish_reason
        spans.append(Span(tail, cursor, end, attributes={"inferlab.phase": True,
                                                         "inferlab.finish_reason": self.finish_reason or "running"}))
        for i, (start, stop, n, pos) in enumerate(self.chunks):
            spans.append(Span("prefill_chunk", start, stop, "prefill", {"inferlab.chunk": i, "inferlab.tokens": n,
                                                                 "inferlab.start_pos": pos}))
        if self.stream_start is not None:
            spans.append(Span("stream", self.stream_start, max(end, self.stream_start)))
        for span in spans:
            if span.name == "decode":
                span.attributes["inferlab.tokens"] = max(self.num_generated_tokens - 1, 0)
        return spans

    def as_dict(self) -> dict[str, Any]:
        """The trace for /traces/{id}: spans in milliseconds from arrival."""
        spans = self.spans()
        t0 = self.arrival
        return {
            "request_id": self.request_id,
            "complete": self.end is not None and self.finished is not None,
            "finish_reason": self.finish_reason,
            "duration_ms": spans[0].duration * 1000.0,
            "chunks_dropped": self.chunks_dropped,
            "spans": [
                {"name": s.name, "parent": s.parent, "start_ms": (s.start - t0) * 1000.0,
                 "duration_ms": s.duration * 1000.0, "attributes": s.attributes}
                for s in spans
            ],
        }  # fmt: skip


class TraceRecorder:
    """The newest `capacity` requests' traces. `on_complete` hooks (an OTLP exporter) get each
    trace once both the engine has finished it and the server has ended its response."""

    def __init__(self, capacity: int = 512, max_chunks: int = 64):
        self.capacity = capacity
        self.max_chunks = max_chunks
        self._traces: collections.OrderedDict[str, RequestTrace] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.on_complete: list[Callable[[RequestTrace], None]] = []

    def clear(self) -> None:
        with self._lock:
            self._traces.clear()

    # ------------------------------------------------------------ engine thread
    def start(self, request_id: str, arrival: float) -> None:
        with self._lock:
            self._traces[request_id] = RequestTrace(request_id, arrival)
            while len(self._traces) > self.capacity:
                self._traces.popitem(last=False)

    def on_step(self, so: SchedulerOutput, start: float, end: float) -> None:
        """Record the step's prefill chunks (a chunk of known tokens: prompt, or recomputed)."""
        chunks = [s for s in so.scheduled if s.start_pos < len(s.prompt_token_ids)]
        if not chunks:
            return
        with self._lock:
            for s in chunks:
                trace = self._find(s.request_id)
                if trace is None:
                    continue
                if len(trace.chunks) < self.max_chunks:
                    trace.chunks.append((start, end, len(s.token_ids), s.start_pos))
                else:
                    trace.chunks_dropped += 1

    def finish(self, out: RequestOutput) -> None:
        """A finished (or aborted) request's metrics."""
        m = out.metrics
        with self._lock:
            trace = self._traces.get(out.request_id)
            if trace is None or trace.finished is not None:
                return
            trace.first_scheduled = m.first_scheduled_time
            trace.first_token = m.first_token_time
            trace.last_token = m.last_token_time
            trace.finished = m.finished_time if m.finished_time is not None else m.last_token_time or m.arrival_time
            reasons = [c.finish_reason for c in out.outputs if c.finish_reason]
            trace.finish_reason = "error" if out.error else ("length" if "length" in reasons else
                                                            (reasons[0] if reasons else "abort"))  # fmt: skip
            trace.num_prompt_tokens = len(out.prompt_token_ids)
            trace.num_cached_tokens = m.num_cached_tokens
            trace.num_generated_tokens = sum(len(c.token_ids) for c in out.outputs)
            trace.num_preemptions = m.num_preemptions
            ready = trace.end is not None
        if ready:
            self._completed(trace)

    # ------------------------------------------------------------ server side
    def complete(self, request_id: str, end: float, stream_start: float | None = None) -> None:
        """The response has ended (sent, failed or disconnected)."""
        with self._lock:
            trace = self._traces.get(request_id)
            if trace is None or trace.end is not None:
                return
            trace.end = end
            trace.stream_start = stream_start
            ready = trace.finished is not None
        if ready:
            self._completed(trace)

    def get(self, request_id: str) -> dict[str, Any] | None:
        with self._lock:
            trace = self._traces.get(request_id)
            return trace.as_dict() if trace is not None else None

    def recent(self, limit: int = 20) -> list[dict[str, Any]]:
        """The newest requests, newest first: id, finish reason, duration."""
        with self._lock:
            traces = list(self._traces.values())[-limit:]
        out = []
        for t in reversed(traces):
            end = t.end if t.end is not None else t.finished
            out.append({"request_id": t.request_id, "finish_reason": t.finish_reason,
                        "duration_ms": (end - t.arrival) * 1000.0 if end is not None else None})  # fmt: skip
        return out

    # ------------------------------------------------------------ helpers
    def _find(self, request_id: str) -> RequestTrace | None:
        trace = self._traces.get(request_id)
        if trace is None and "#" in request_id:  # a child of an n > 1 request: its parent's trace
            trace = self._traces.get(request_id.rpartition("#")[0])
        return trace

    def _completed(self, trace: RequestTrace) -> None:
        for hook in self.on_complete:
            hook(trace)
