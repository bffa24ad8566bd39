"""One engine replica as a Ray Serve deployment: our whole server inside the actor.

Why the whole server on a loopback port rather than a new engine API: every OpenAI detail
(validation, rendering, streaming, limits, errors, /metrics) stays in `server/` and is the same
with one worker or many; the actor adds only what Ray needs:

- `forward(...)` streams one HTTP request to the local server: first `(status, headers,
  replica)`, then the body's chunks as they come;
- `check_health()` (Serve calls it every `health_check_period_s`): raises when the engine
  failed to load, died, or stalls, so Serve replaces the replica;
- `record_routing_stats()` (every ~1 s, for the request router) and `record_autoscaling_stats()`
  (for the autoscaling policy): queued prompt tokens, running / waiting requests, block size;
- `__del__` (Serve calls it once the replica has no ongoing requests or its graceful timeout
  has passed): the server drains and the engine stops.

Queued tokens are counted here, per request: a request's prompt tokens from its arrival until its
first response byte (for a stream, its first event; for a plain reply, its end).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from inferlab.engine.engine_args import EngineArgs
from inferlab.server.app import ServerSettings

logger = logging.getLogger("inferlab.ray_serve")

HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "te", "upgrade"}


class EngineReplica:
    def __init__(self, engine_args: EngineArgs, settings: ServerSettings, load_timeout_s: float = 600.0):
        import httpx
        import uvicorn

        from inferlab.server.app import build_app
        from inferlab.server.limits import uvicorn_options

        config = engine_args.create_engine_config()
        self.prefix_caching = config.cache.enable_prefix_caching

        def make_engine():
            from inferlab.engine.llm_engine import LLMEngine

            return LLMEngine(config)

        self.app = build_app(make_engine, settings)
        self.llm = self.app.state.llm
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(
            self.app, log_level="warning", access_log=False, lifespan="on",
            timeout_graceful_shutdown=settings.shutdown_timeout, **uvicorn_options(settings.limits)))  # fmt: skip
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, name="inferlab-replica-http",
                                        daemon=True)  # fmt: skip
        self._thread.start()
        # Serve counts the replica as started only when __init__ returns: no request reaches a
        # replica whose model is still loading.
        if not self.llm.wait_ready(load_timeout_s):
            err = self.llm.load_error
            raise RuntimeError(f"the model did not load: {type(err).__name__}: {err}" if err else "the model did not load in time")
        self.client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(None, connect=5.0))
        self.name = _replica_name()
        self.queued_tokens = 0
        self.in_flight = 0
        self.served = 0
        self.started = time.monotonic()

    async def forward(self, method: str, path: str, headers: dict[str, str], body: bytes,
                      route: dict[str, Any] | None = None) -> AsyncIterator[Any]:  # fmt: skip
        """One request on the local server: (status, headers, replica name), then body chunks."""
        tokens = int((route or {}).get("prompt_tokens", 0))
        self.queued_tokens += tokens
        self.in_flight += 1
        queued = True
        try:
            send = {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}
            async with self.client.stream(method, path, headers=send, content=body) as resp:
                out = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
                yield (resp.status_code, out, self.name)
                async for chunk in resp.aiter_raw():
                    if queued:
                        self.queued_tokens -= tokens
                        queued = False
                    yield chunk
        finally:
            if queued:
                self.queued_tokens -= tokens
            self.in_flight -= 1
            self.served += 1

    def check_health(self) -> None:
        if not self.llm.is_healthy():
            err = self.llm.dead_error or self.llm.load_error
            raise RuntimeError(f"engine unhealthy: {err!r}" if err else "engine unhealthy (stalled or stopped)")
        if not self._thread.is_alive():
            raise RuntimeError("the replica's HTTP server stopped")

    def stats(self) -> dict[str, Any]:
        s = self.llm.get_stats()
        return {"name": self.name, "queued_tokens": self.queued_tokens, "in_flight": self.in_flight,
                "served": self.served, "running": s.num_running, "waiting": s.num_waiting,
                "kv_usage": s.kv_cache_usage, "block_size": s.block_size, "num_blocks": s.num_blocks,
                "prefix_caching": self.prefix_caching}  # fmt: skip

    def record_routing_stats(self) -> dict[str, Any]:
        return self.stats()

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {"queued_tokens": float(self.queued_tokens)}

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None and not server.should_exit:
            server.should_exit = True  # uvicorn drains its connections, then the lifespan stops the engine
            self._thread.join(timeout=self.app.state.settings.shutdown_timeout + 15.0)


def _replica_name() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside Serve (tests): a local name
        return f"local-{id(object()):x}"
