"""What a public server needs against big bodies and slow or stalled clients.

    request line + headers  --header-timeout s from the connection's (or the next request's)
                            first byte, else the connection is closed; h11 caps their size
                            (16 KiB: 400). uvicorn alone keeps a half-sent request open forever.
    body                    --max-request-body-bytes: 413 (by Content-Length before reading,
                            else once the bytes read pass it); --body-timeout s for all of it: 408
    response                --send-timeout s for each piece: a client that stops reading (its
                            TCP window full, uvicorn's write buffer past its high-water mark)
                            gets its connection closed; a stream's finally then aborts the
                            engine request, so a stalled reader holds no memory or KV blocks
                            for longer than this (AsyncLLM merges a lagging reader's outputs
                            only when the reader takes them; until then they queue, one a step)
    between requests        --keep-alive-timeout s (uvicorn's timeout_keep_alive)

The body and send limits are an ASGI middleware; the header timeout is uvicorn's h11 protocol
with a timer (`uvicorn_options` gives the `uvicorn.Config` arguments).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from inferlab.server.protocol import ApiError

logger = logging.getLogger("inferlab.server")

MiB = 1024 * 1024


@dataclass(frozen=True)
class HttpLimits:
    max_request_body_bytes: int = 8 * MiB
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    send_timeout: float = 30.0
    keep_alive_timeout: float = 5.0

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if getattr(self, name) <= 0:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{name} ({flag}) must be > 0, got {getattr(self, name)}")


class _SendTimeout(Exception):
    pass


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is larger than this server accepts ({limit} bytes)",
        "invalid_request_error",
        headers={"Connection": "close"},
    )


class LimitsMiddleware:
    """Body size and read deadline on the way in, a deadline on every send on the way out."""

    def __init__(self, app: Any, limits: HttpLimits):
        self.app = app
        self.limits = limits

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limits = self.limits
        cap = limits.max_request_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > cap:
                    await _send_error(send, _too_large(cap))
                    return
        received = 0
        body_done = False
        deadline = time.monotonic() + limits.body_timeout

        async def limited_receive() -> dict:
            nonlocal received, body_done
            if body_done:
                return await receive()
            try:
                async with asyncio.timeout(deadline - time.monotonic()):
                    message = await receive()
            except TimeoutError:
                raise ApiError(
                    408, f"the request body did not arrive within {limits.body_timeout:g} s", "timeout_error",
                    headers={"Connection": "close"},
                ) from None  # fmt: skip
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > cap:
                    raise _too_large(cap)
                body_done = not message.get("more_body", False)
            return message

        async def timed_send(message: dict) -> None:
            try:
                async with asyncio.timeout(limits.send_timeout):
                    await send(message)
            except TimeoutError:
                raise _SendTimeout() from None

        try:
            await self.app(scope, limited_receive, timed_send)
        except _SendTimeout:
            # uvicorn closes a connection whose app returned mid-response; the response's
            # generator is closed with it (a stream aborts its engine requests there).
            logger.warning("closing a connection whose client read nothing for %g s", limits.send_timeout)


async def _send_error(send: Any, err: ApiError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# Responses that stream until the client leaves (webui.EVENTS_PATH), closed at shutdown.
ENDLESS_STREAMS = frozenset({"/dashboard/events"})


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection that takes longer than `header_timeout` s to
    send a request's line and headers (from its first byte, or from the connection's start)."""

    header_timeout: float = 10.0

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and data:
            if self._header_timer is None:
                self._arm_header_timer()
        else:
            self._disarm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """A graceful shutdown lets responses finish, but an endless one (the dashboard's event
        stream) never would: its connection is closed now, as if the client had left (its app
        sees the disconnect; a page reconnects to whichever server comes up)."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and cycle.scope.get("path") in ENDLESS_STREAMS:
            self.transport.close()
            return
        super().shutdown()

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            logger.debug("closing a connection that sent no complete request headers in %g s", self.header_timeout)
            self.transport.close()


def uvicorn_options(limits: HttpLimits) -> dict[str, Any]:
    """The `uvicorn.Config` arguments that enforce `limits` (the body ones are the middleware's)."""
    protocol = type("InferlabH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout": limits.header_timeout})
    return {"http": protocol, "timeout_keep_alive": limits.keep_alive_timeout}
