"""One client request through the fleet: route, send, retry while nothing has reached the
client, then relay the answer (streamed or not) and release the replica's ticket.

    attempt ─► route ─► dispatch ─► POST upstream
       │ connection refused / reset, 5xx, timeout, a stream that breaks before its first event
       └─► retry on another replica (bounded by max_retries and the retry budget)
    first SSE event in hand ─► 200 to the client; from here on nothing is retried: a broken
       upstream stream ends with `data: {"error": ...}` and `data: [DONE]`, and the upstream
       response is closed (the replica sees the disconnect and aborts the request)

Only whole SSE events are forwarded, so an error event never lands inside half an event. The
client going away closes the upstream stream (streamed) or cancels the exchange (plain).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response

from inferlab.router.canary import Canary
from inferlab.router.fleet import Fleet
from inferlab.router.health import Circuit
from inferlab.router.metrics import RouterMetrics
from inferlab.router.policies import RouteRequest
from inferlab.router.replica import Ticket
from inferlab.server.httputil import SSE_HEADERS, ClosingStream

logger = logging.getLogger("inferlab.router")

# Retried on another replica: overload and server faults. 4xx (bad input) go back as they are.
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# Server faults count against the replica's circuit; overload answers do not.
FAULT_STATUS = frozenset({500, 502, 504})
REPLICA_HEADER = "x-inferlab-replica"  # which backend (its index) served the request


@dataclass(frozen=True)
class ProxySettings:
    max_retries: int = 2
    retry_budget_s: float = 30.0  # no new attempt once this long has passed since arrival
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0  # between two upstream chunks


@dataclass
class _Failure:
    outcome: str  # "failed" | "fatal"
    reason: str  # metric label: connect, reset, timeout, status_5xx, ...
    message: str


@dataclass
class _StreamState:
    done_seen: bool = False
    upstream_error: bool = False
    tail: bytes = b""
    usage_seen: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def error_event(message: str, kind: str = "upstream_error", code: int = 502) -> bytes:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return f"data: {json.dumps(body)}\n\n".encode() + b"data: [DONE]\n\n"


def unavailable(message: str, retry_after_s: float, **extra: Any) -> JSONResponse:
    """503 + Retry-After, in the replicas' error shape (`extra`: more top-level fields)."""
    body = {"error": {"message": message, "type": "unavailable_error", "param": None, "code": 503}, **extra}
    return JSONResponse(body, status_code=503, headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


def _classify(e: Exception) -> _Failure:
    if isinstance(e, httpx.ConnectError):
        return _Failure("fatal", "connect", f"cannot connect: {e}")
    if isinstance(e, httpx.TimeoutException):
        return _Failure("failed", "timeout", f"timed out: {type(e).__name__}")
    if isinstance(e, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError):
        return _Failure("fatal", "reset", f"connection lost: {type(e).__name__}: {e}")
    return _Failure("failed", "transport", f"{type(e).__name__}: {e}")


class _EndedEarly(Exception):
    """The replica closed the stream cleanly but before `data: [DONE]`."""


class Proxy:
    def __init__(self, fleet: Fleet, client: httpx.AsyncClient, metrics: RouterMetrics,
                 settings: ProxySettings | None = None, clock: Callable[[], float] = time.monotonic,
                 canary: Canary | None = None):  # fmt: skip
        self.fleet = fleet
        self.canary = canary
        self.client = client
        self.metrics = metrics
        self.settings = settings or ProxySettings()
        self.clock = clock
        self.index_of = {name: i for i, name in enumerate(fleet.replicas)}

    def retry_after_s(self) -> float:
        """When a replica may come back: the nearest end of an ejection, else a probe round."""
        now = self.fleet.clock()
        waits = [r.health.ejected_until - now for r in self.fleet.replicas.values() if r.health.ejected_until > now]
        return min(waits, default=1.0)

    async def forward(self, path: str, body: bytes, headers: dict[str, str], request: RouteRequest,
                      stream: bool) -> Response:  # fmt: skip
        """The client's response; raises nothing for upstream trouble (it becomes a response)."""
        s = self.settings
        arrival = self.clock()
        tried: list[str] = []
        last_status: Response | None = None
        last_failure: _Failure | None = None
        pool = self.canary.pool_for(request.session_key) if self.canary is not None else None
        for attempt in range(1 + s.max_retries):
            if attempt and self.clock() - arrival > s.retry_budget_s:
                break
            decision = self._route(request, tried, pool)
            if decision is None:
                break
            if attempt:
                self.metrics.retries.labels(reason=last_failure.reason if last_failure else "status").inc()
            self.metrics.decision(decision.reason, decision.predicted_cached_tokens)
            tried.append(decision.replica)
            ticket = self.fleet.dispatch(decision, request, streamed=stream)
            result = await self._attempt(ticket, path, body, headers, stream)
            if isinstance(result, _Failure):
                last_failure = result
                logger.warning("attempt %d on %s failed: %s", attempt + 1, decision.replica, result.message)
                continue
            if isinstance(result, tuple):  # a retryable status: kept in case no one does better
                last_status, last_failure = result
                continue
            return result
        if last_status is not None:
            return last_status
        if not tried:
            return unavailable("no backend is available (all are down, ejected or not ready yet)", self.retry_after_s())
        msg = last_failure.message if last_failure else "no backend answered"
        return unavailable(f"no backend could serve the request after {len(tried)} attempt(s): {msg}",
                           self.retry_after_s())  # fmt: skip

    def _route(self, request: RouteRequest, tried: list[str], pool: str | None):
        """The policy's pick within the request's canary pool; else within the stable one (the
        canary is down); else anywhere but a canary that was rolled back."""
        c = self.canary
        if c is None or pool is None:
            return self.fleet.route(request, exclude=tried)
        decision = self.fleet.route(request, tried, among=c.members[pool])
        if decision is None and pool == "canary":
            decision = self.fleet.route(request, tried, among=c.members["stable"])
        if decision is None and c.state != "rolled_back":
            decision = self.fleet.route(request, exclude=tried)
        return decision

    def _end(self, ticket: Ticket, outcome: str, error: str = "") -> None:
        first_end = not ticket.released
        ejected = self.fleet.finish(ticket, outcome)
        if ejected:
            self.metrics.ejections.labels(replica=ticket.replica).inc()
            logger.warning("replica %s ejected: %s", ticket.replica, error or outcome)
        c = self.canary
        if not first_end or c is None or outcome == "abandoned":
            return
        pool = c.pool_of(ticket.replica)
        ttft = ticket.first_token_at - ticket.sent_at if ticket.first_token_at is not None else None
        self.metrics.canary_requests.labels(pool=pool, outcome="ok" if outcome == "ok" else "error").inc()
        reason = c.record(pool, outcome == "ok", ttft, self.fleet.clock())
        if reason is None and ejected and pool == "canary" and c.state == "active" and c.weight > 0 and all(
                self.fleet.replicas[n].health.circuit is not Circuit.CLOSED for n in c.members["canary"]):  # fmt: skip
            # Its failures opened every canary circuit: no outcome would come to judge it by.
            reason = c.rollback(f"ejected: every canary replica failed ({error or outcome})")
        if reason is not None:
            self.metrics.canary_rollbacks.labels(reason=reason.split(":")[0]).inc()
            logger.warning("canary %s rolled back (weight 0; in-flight requests finish): %s", c.versions["canary"], reason)

    async def _attempt(self, ticket: Ticket, path: str, body: bytes, headers: dict[str, str],
                       stream: bool) -> Response | _Failure | tuple[Response, _Failure]:  # fmt: skip
        """One try on the ticket's replica; the ticket is released here unless a stream is
        handed on (then by the relay)."""
        url = ticket.replica + path
        s = self.settings
        timeout = httpx.Timeout(s.read_timeout_s, connect=s.connect_timeout_s)
        resp: httpx.Response | None = None
        handed_on = False
        try:
            req = self.client.build_request("POST", url, content=body, headers=headers, timeout=timeout)
            resp = await self.client.send(req, stream=True)
            status = resp.status_code
            if not stream or status != 200:
                content = await resp.aread()
                out = Response(content, status_code=status, headers=self._headers(resp, ticket))
                if status in RETRY_STATUS:
                    fault = status in FAULT_STATUS
                    self._end(ticket, "failed" if fault else "abandoned", f"HTTP {status}")
                    return out, _Failure("failed", f"status_{status}", f"HTTP {status}")
                self._end(ticket, "ok")
                if status == 200:
                    self._count_usage(content)
                return out
            it = resp.aiter_bytes()
            buf = b""
            while b"\n\n" not in buf:
                try:
                    buf += await it.__anext__()
                except StopAsyncIteration:
                    raise _EndedEarly("the stream ended before its first event") from None
            cut = buf.rfind(b"\n\n") + 2
            first, rest = buf[:cut], buf[cut:]
            state = _StreamState()
            self._inspect(first, ticket, state)
            handed_on = True
            upstream = resp

            async def never_started() -> None:  # the client left before the relay ran
                await upstream.aclose()
                self._end(ticket, "abandoned")

            return ClosingStream(self._relay(first, rest, it, resp, ticket, state), never_started,
                                 headers={**SSE_HEADERS, **self._headers(resp, ticket, sse=True)})
        except _EndedEarly as e:
            self._end(ticket, "fatal", str(e))
            return _Failure("fatal", "ended_early", str(e))
        except httpx.HTTPError as e:
            f = _classify(e)
            self._end(ticket, f.outcome, f.message)
            return f
        except BaseException:  # cancelled (the client left) or a bug: never leak the ticket
            self._end(ticket, "abandoned")
            raise
        finally:
            if resp is not None and not handed_on:
                await resp.aclose()

    def _headers(self, resp: httpx.Response, ticket: Ticket, sse: bool = False) -> dict[str, str]:
        out = {REPLICA_HEADER: str(self.index_of.get(ticket.replica, -1))}
        if not sse:
            ct = resp.headers.get("content-type")
            if ct:
                out["content-type"] = ct
        retry = resp.headers.get("retry-after")
        if retry:
            out["retry-after"] = retry
        return out

    async def _relay(self, first: bytes, rest: bytes, it: AsyncIterator[bytes], resp: httpx.Response, ticket: Ticket,
                     state: _StreamState) -> AsyncIterator[bytes]:  # fmt: skip
        """The stream after its first event; the ticket is released at its end, whatever it is."""
        outcome, error = "abandoned", ""
        buf = rest
        try:
            yield first
            async for chunk in it:
                buf += chunk
                cut = buf.rfind(b"\n\n")
                if cut >= 0:
                    out, buf = buf[: cut + 2], buf[cut + 2 :]
                    self._inspect(out, ticket, state)
                    yield out
            if buf.strip():
                self._inspect(buf, ticket, state)
                yield buf
            if not state.done_seen:
                raise _EndedEarly("the replica closed the stream before [DONE]")
            outcome = "failed" if state.upstream_error else "ok"
            error = "the replica reported an error in the stream" if state.upstream_error else ""
        except (httpx.HTTPError, _EndedEarly) as e:
            f = _classify(e) if isinstance(e, httpx.HTTPError) else _Failure("fatal", "ended_early", str(e))
            outcome, error = f.outcome, f.message
            logger.warning("stream from %s broke after its first event: %s", ticket.replica, f.message)
            self.metrics.requests.labels(route="stream", outcome="broken").inc()
            yield error_event(f"the backend failed mid-stream: {f.message}")
        finally:
            await resp.aclose()  # the replica sees the disconnect and aborts what is left
            self._end(ticket, outcome, error)

    def _inspect(self, events: bytes, ticket: Ticket, state: _StreamState) -> None:
        """Look for the first token (it ends the ticket's prefill), [DONE], errors and usage."""
        if b"[DONE]" in events:
            state.done_seen = any(line.strip() == b"data: [DONE]" for line in events.split(b"\n"))
        looking = ticket.first_token_at is None
        if not looking and b'"error"' not in events and b'"cached_tokens"' not in events:
            return
        for line in events.split(b"\n"):
            if not line.startswith(b"data: {"):
                continue
            try:
                obj = json.loads(line[6:])
            except ValueError:
                continue
            if "error" in obj:
                state.upstream_error = True
                continue
            if looking and _has_token(obj):
                self.fleet.first_token(ticket)
                looking = False
            u = obj.get("usage")
            if isinstance(u, dict) and not state.usage_seen and not obj.get("choices"):
                state.usage_seen = True
                self._count_usage_dict(u)

    def _count_usage(self, content: bytes) -> None:
        try:
            u = json.loads(content).get("usage")
        except (ValueError, AttributeError):
            return
        if isinstance(u, dict):
            self._count_usage_dict(u)

    def _count_usage_dict(self, u: dict[str, Any]) -> None:
        details = u.get("prompt_tokens_details") or {}
        try:
            self.metrics.usage(int(u.get("prompt_tokens") or 0), int(details.get("cached_tokens") or 0))
        except (TypeError, ValueError):
            pass


def _has_token(chunk: dict[str, Any]) -> bool:
    for c in chunk.get("choices") or ():
        if c.get("finish_reason") or c.get("text") or (c.get("delta") or {}).get("content"):
            return True
    return False
