"""The router's FastAPI app: the OpenAI generation routes passed through the fleet, `/v1/models`
from the ready replicas, `/health`, `/metrics`, bearer-key auth.

    lifespan start: the httpx client, the local tokenizer (if any), the probe loop; the router
                    listens at once, and routes to nobody until a probe finds a replica ready
    lifespan end:   the probe loop stops, the client closes
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferlab.router.fleet import Fleet
from inferlab.router.health import HealthConfig
from inferlab.router.metrics import CONTENT_TYPE_LATEST, RouterMetrics
from inferlab.router.policies import make_policy
from inferlab.router.prefix_index import PrefixIndex
from inferlab.router.probes import Prober
from inferlab.router.proxy import Proxy, ProxySettings, unavailable
from inferlab.router.tokens import LocalTokenizer, PromptTokenizer, RemoteTokenizer, prompt_spec
from inferlab.server.auth import ApiKeyGuard
from inferlab.server.protocol import ApiError
from inferlab.server.tenants import TenantTable

logger = logging.getLogger("inferlab.router")


@dataclass(frozen=True)
class RouterSettings:
    backends: tuple[str, ...]
    policy: str = "cache-aware"
    api_key: str | None = None  # what clients must send
    backend_api_key: str | None = None  # what the router sends to replicas (None: the client's header)
    metrics_public: bool = False
    tokenizer: str | None = None  # a model to tokenize with locally; None: the replicas' /tokenize
    session_header: str = "x-session-id"  # the session key, else the body's `user`
    probe_interval_s: float = 0.5
    metrics_max_age_s: float = 2.0
    prefix_ttl_s: float = 120.0
    prefill_rate: float = 2000.0  # tokens/s before the first measurement
    proxy: ProxySettings = field(default_factory=ProxySettings)
    health: HealthConfig = field(default_factory=HealthConfig)


def normalize_backend(url: str) -> str:
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"a backend is an http(s) URL, got {url!r}")
    return url


def _error(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _client_gone(raw: Request) -> None:
    """Returns when the client disconnects (its body has been read: only a disconnect can come)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


def build_router_app(settings: RouterSettings, *, tokenizer: PromptTokenizer | None = None) -> FastAPI:
    backends = [normalize_backend(b) for b in settings.backends]
    fleet = Fleet(backends, make_policy(settings.policy), index=PrefixIndex(ttl_s=settings.prefix_ttl_s),
                  health=settings.health, prefill_rate=settings.prefill_rate,
                  metrics_max_age_s=settings.metrics_max_age_s)  # fmt: skip
    metrics = RouterMetrics(fleet)
    guard = ApiKeyGuard(TenantTable.single_key(settings.api_key) if settings.api_key else TenantTable.open_access())
    upstream_key = settings.backend_api_key or settings.api_key
    fixed_auth = {"authorization": f"Bearer {upstream_key}"} if upstream_key else {}
    holder: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = httpx.AsyncClient(limits=httpx.Limits(max_connections=2000, max_keepalive_connections=200),
                                   timeout=httpx.Timeout(30.0, connect=settings.proxy.connect_timeout_s))  # fmt: skip
        tok = tokenizer
        if tok is None and settings.tokenizer:
            tok = await asyncio.to_thread(LocalTokenizer.load, settings.tokenizer)
        if tok is None:
            tok = RemoteTokenizer(client, fixed_auth)
        holder.update(client=client, tokenizer=tok, proxy=Proxy(fleet, client, metrics, settings.proxy))
        prober = Prober(fleet, client, interval_s=settings.probe_interval_s, headers=fixed_auth)
        app.state.prober = prober
        task = asyncio.create_task(prober.run())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await client.aclose()

    app = FastAPI(title="inferlab router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.fleet = fleet
    app.state.metrics = metrics
    app.state.router_settings = settings  # (not `settings`: the test harness reads that as the server's)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        headers = dict(exc.headers) if exc.headers else None
        return _error(ApiError(exc.status_code, str(exc.detail), kind, headers=headers))

    guarded = [Depends(guard)]

    @app.get("/health")
    async def health() -> Response:
        states = fleet.states()
        if not fleet.routable():
            proxy: Proxy | None = holder.get("proxy")
            return unavailable("no backend is ready", proxy.retry_after_s() if proxy else 1.0,
                               replicas=states)  # fmt: skip
        return JSONResponse({"status": "ok", "policy": fleet.policy.name, "replicas": states})

    @app.get("/metrics", dependencies=[] if settings.metrics_public else guarded)
    async def router_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def upstream_headers(raw: Request) -> dict[str, str]:
        out = {"content-type": "application/json"}
        auth = fixed_auth.get("authorization") or raw.headers.get("authorization")
        if auth:
            out["authorization"] = auth
        return out

    @app.get("/v1/models", dependencies=guarded)
    async def models(raw: Request) -> Response:
        """The union of the ready replicas' models; one replica down does not fail it."""
        client: httpx.AsyncClient = holder["client"]
        names = [r.name for r in fleet.routable()]
        headers = upstream_headers(raw)

        async def one(url: str) -> list[dict[str, Any]] | None:
            try:
                r = await client.get(url + "/v1/models", headers=headers, timeout=5.0)
                data = r.json().get("data") if r.status_code == 200 else None
                return data if isinstance(data, list) else None
            except (httpx.HTTPError, ValueError, AttributeError):
                return None

        answers = await asyncio.gather(*(one(u) for u in names))
        if all(a is None for a in answers):
            proxy: Proxy = holder["proxy"]
            return unavailable("no backend answered /v1/models", proxy.retry_after_s())
        seen: dict[str, dict[str, Any]] = {}
        for data in answers:
            for m in data or ():
                if isinstance(m, dict) and "id" in m:
                    seen.setdefault(str(m["id"]), m)
        return JSONResponse({"object": "list", "data": list(seen.values())})

    async def generate(raw: Request, path: str, chat: bool) -> Response:
        body = await raw.body()
        try:
            payload = json.loads(body) if body else None
        except (ValueError, UnicodeDecodeError):
            payload = None
        if not isinstance(payload, dict):
            payload = {}  # malformed: a replica answers its own 400, passed through
        stream = payload.get("stream") is True
        session = raw.headers.get(settings.session_header) or payload.get("user")
        spec = prompt_spec(chat, payload)
        names = [r.name for r in fleet.routable()]
        ids = None
        # Only cache-aware scores prefixes; `cache_prompt: false` asks the replica not to reuse one.
        if spec is not None and names and fleet.policy.name == "cache-aware" and payload.get("cache_prompt") is not False:
            ids = await holder["tokenizer"].token_ids(spec, names)
        salt = payload.get("cache_salt") if isinstance(payload.get("cache_salt"), str) else None
        request = fleet.request(ids, salt, str(session) if session is not None else None)
        proxy: Proxy = holder["proxy"]
        exchange = asyncio.ensure_future(proxy.forward(path, body, upstream_headers(raw), request, stream))
        gone = asyncio.ensure_future(_client_gone(raw))
        try:
            await asyncio.wait({exchange, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not exchange.done():  # the client left before any answer: cancel the upstream call
            exchange.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await exchange
            metrics.requests.labels(route=path, outcome="disconnected").inc()
            return Response(status_code=499)
        response = exchange.result()
        metrics.requests.labels(route=path, outcome=str(response.status_code)).inc()
        return response

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(raw: Request) -> Response:
        return await generate(raw, "/v1/chat/completions", chat=True)

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(raw: Request) -> Response:
        return await generate(raw, "/v1/completions", chat=False)

    return app
