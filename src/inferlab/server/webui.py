"""The web pages `inferlab serve` ships: the playground (`/`), the live dashboard (`/dashboard`),
and the two JSON/SSE routes only they need (`/dashboard/events`, `/traces/...`).

Pages and their scripts are static files inside the package (`server/static/`), no CDN, no
inline script: every response here carries a strict Content-Security-Policy (scripts, styles
and connections to this origin only). The files hold no secret, so they are public; what they
fetch (chat, /dashboard/events, /traces) is behind the API key when one is set, and the pages
ask for it on a 401 and send it as a Bearer header (fetch, not EventSource, which cannot).

`/dashboard/events` pushes one snapshot of `LiveStats` a second as server-sent events; the
server closes these streams when it shuts down (limits.py), so a drain is not held up by an
open dashboard.
"""

from __future__ import annotations

import asyncio
from importlib import resources
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse

from inferlab.engine.async_llm import AsyncLLM
from inferlab.server.live import LiveStats
from inferlab.server.protocol import ApiError
from inferlab.server.render import sse

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}
EVENTS_PATH = "/dashboard/events"
EVENT_INTERVAL_S = 1.0
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
          ".svg": "image/svg+xml"}  # fmt: skip


def _static_files() -> dict[str, bytes]:
    """Every asset, read once: name → bytes (a fixed set: no path from a request reaches the disk)."""
    root = resources.files("inferlab.server") / "static"
    return {f.name: f.read_bytes() for f in root.iterdir() if f.is_file() and f.name.endswith(tuple(_TYPES))}


def _asset(files: dict[str, bytes], name: str) -> Response:
    body = files.get(name)
    if body is None:
        raise ApiError(404, f"no such file: {name}", "not_found_error")
    suffix = name[name.rfind(".") :]
    return Response(body, media_type=_TYPES[suffix], headers=PAGE_HEADERS)


def add_webui_routes(app: FastAPI, llm: AsyncLLM, live: LiveStats, guard: Any) -> None:
    files = _static_files()
    guarded = [Depends(guard)]

    @app.get("/", include_in_schema=False)
    async def playground() -> Response:
        return _asset(files, "playground.html")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        return _asset(files, "dashboard.html")

    @app.get("/ui/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        return _asset(files, name)

    def traces() -> Any:
        return getattr(llm.engine, "traces", None) if llm.ready else None

    @app.get(EVENTS_PATH, dependencies=guarded, include_in_schema=False)
    async def events() -> Response:
        async def stream():
            while True:
                snap = live.snapshot()
                recorder = traces()
                snap["recent_requests"] = recorder.recent(12) if recorder is not None else []
                yield sse(snap)
                await asyncio.sleep(EVENT_INTERVAL_S)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip

    @app.get("/traces", dependencies=guarded)
    async def recent_traces(limit: int = 50) -> JSONResponse:
        """The newest requests the engine keeps a trace of (newest first)."""
        recorder = traces()
        return JSONResponse({"data": recorder.recent(max(1, min(limit, 500))) if recorder is not None else []})

    @app.get("/traces/{request_id}", dependencies=guarded)
    async def one_trace(request_id: str) -> JSONResponse:
        """One recent request's spans, in milliseconds from its arrival."""
        recorder = traces()
        trace = recorder.get(request_id) if recorder is not None else None
        if trace is None:
            raise ApiError(404, f"no trace of request {request_id!r} (only the newest requests are kept)",
                           "not_found_error", "request_id")  # fmt: skip
        return JSONResponse(trace)
