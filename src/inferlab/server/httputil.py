"""The HTTP plumbing `inferlab serve` and `inferlab router` share: the error shape, the client
disconnect watch, the SSE response that always ends its stream, running uvicorn until SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import signal
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferlab.server.protocol import ApiError

T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def add_error_handlers(app: FastAPI) -> None:
    """ApiError and Starlette's own errors (404, 405, ...) answered in the one error shape."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        headers = dict(exc.headers) if exc.headers else None
        return error_response(ApiError(exc.status_code, str(exc.detail), kind, headers=headers))


async def client_gone(raw: Request) -> None:
    """Returns when the client disconnects (the body has been read: only a disconnect can come)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    """The client disconnected before its (non-streamed) answer was ready."""


async def unless_client_gone(raw: Request, work: Awaitable[T]) -> T:
    """`work`'s result; if the client disconnects first, `work` is cancelled and ClientGone raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(client_gone(raw))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientGone()
    return task.result()


class ClosingStream(StreamingResponse):
    """An SSE response that always ends its generator: closed explicitly (not left to the garbage
    collector) when sending fails or times out, and `on_exit` (a function, or a coroutine
    function) called if it never started (its `finally`, which releases what the request holds,
    never ran)."""

    def __init__(self, body: Any, on_exit: Any, headers: dict[str, str] = SSE_HEADERS):
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self._on_exit = on_exit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            done = self._on_exit()  # a no-op when the generator's own finally has ended the request
            if inspect.isawaitable(done):
                await done


def run_until_sigterm(server: Any) -> None:
    """`server.run()` (a uvicorn.Server). uvicorn re-raises a caught SIGTERM after its graceful
    shutdown, into the handler that was installed before it started: a no-op one here, so that a
    drained server exits 0."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
