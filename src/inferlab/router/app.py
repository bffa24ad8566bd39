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

from inferlab.router.canary import Canary, CanaryConfig
from inferlab.router.fleet import Fleet
from inferlab.router.health import HealthConfig
from inferlab.router.metrics import CONTENT_TYPE_LATEST, RouterMetrics
from inferlab.router.policies import make_policy
from inferlab.router.prefix_index import PrefixIndex
from inferlab.router.probes import Prober
from inferlab.router.proxy import Proxy, ProxySettings, unavailable
from inferlab.router.tokens import LocalTokenizer, PromptTokenizer, RemoteTokenizer, prompt_spec
from inferlab.server.auth import ApiKeyGuard
from inferlab.server.httputil import ClientGone, add_error_handlers, unless_client_gone
from inferlab.server.protocol import ApiError
from inferlab.server.tenants import Tenant, TenantTable

logger = logging.getLogger("inferlab.router")


@dataclass(frozen=True)
class RouterSettings:
    backends: tuple[str, ...]
    policy: str = "cache-aware"
    api_key: str | None = None  # what clients must send
    # The replicas' --api-keys file: clients authenticate here as there, their keys pass through,
    # and each prompt is hashed with its tenant's salt, as the replica will (exclusive with api_key).
    tenants: TenantTable | None = None
    # What the router sends to replicas (None: the client's header); with `tenants`, only on its
    # own calls (probes, /kv_events, /tokenize): the clients' requests carry their own keys.
    backend_api_key: str | None = None
    metrics_public: bool = False
    tokenizer: str | None = None  # a model to tokenize with locally; None: the replicas' /tokenize
    session_header: str = "x-session-id"  # the session key, else the body's `user`
    probe_interval_s: float = 0.5
    metrics_max_age_s: float = 2.0
    prefix_ttl_s: float = 120.0  # a routed prompt's blocks, on a replica that publishes no KV events
    speculative_ttl_s: float = 30.0  # the same on one whose KV events we follow (they confirm within a poll)
    kv_events: bool = True  # follow the replicas' GET /kv_events
    prefill_rate: float = 2000.0  # tokens/s before the first measurement
    proxy: ProxySettings = field(default_factory=ProxySettings)
    health: HealthConfig = field(default_factory=HealthConfig)
    canaries: tuple[str, ...] = ()  # a second pool (the new version) behind `canary` (canary.py)
    canary: CanaryConfig = field(default_factory=CanaryConfig)
    versions: tuple[str, str] = ("stable", "canary")  # version labels of the two pools
    admin_key: str | None = None  # for /admin/canary; None: the api_key; neither: the admin routes refuse


def normalize_backend(url: str) -> str:
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"a backend is an http(s) URL, got {url!r}")
    return url


def build_router_app(settings: RouterSettings, *, tokenizer: PromptTokenizer | None = None) -> FastAPI:
    backends = [normalize_backend(b) for b in settings.backends]
    canaries = [normalize_backend(b) for b in settings.canaries]
    canary = Canary(backends, canaries, settings.canary, settings.versions) if canaries else None
    fleet = Fleet(backends + canaries, make_policy(settings.policy), index=PrefixIndex(ttl_s=settings.prefix_ttl_s),
                  health=settings.health, prefill_rate=settings.prefill_rate,
                  metrics_max_age_s=settings.metrics_max_age_s, speculative_ttl_s=settings.speculative_ttl_s)  # fmt: skip
    metrics = RouterMetrics(fleet)
    if canary is not None:
        metrics.canary_weight.set_function(lambda: canary.weight)
    admin_key = settings.admin_key or settings.api_key
    admin_guard = ApiKeyGuard(TenantTable.single_key(admin_key)) if admin_key else None
    guard = ApiKeyGuard(TenantTable.of(settings.api_key, settings.tenants))
    upstream_key = settings.backend_api_key or settings.api_key
    own_auth = {"authorization": f"Bearer {upstream_key}"} if upstream_key else {}  # the router's own calls
    fixed_auth = {} if settings.tenants is not None else own_auth  # on clients' requests (tenants: their own)
    holder: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = httpx.AsyncClient(limits=httpx.Limits(max_connections=2000, max_keepalive_connections=200),
                                   timeout=httpx.Timeout(30.0, connect=settings.proxy.connect_timeout_s))  # fmt: skip
        tok = tokenizer
        if tok is None and settings.tokenizer:
            tok = await asyncio.to_thread(LocalTokenizer.load, settings.tokenizer)
        if tok is None:
            tok = RemoteTokenizer(client, own_auth)
        holder.update(client=client, tokenizer=tok, proxy=Proxy(fleet, client, metrics, settings.proxy, canary=canary))
        prober = Prober(fleet, client, interval_s=settings.probe_interval_s, headers=own_auth,
                        kv_events=settings.kv_events)  # fmt: skip
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

    add_error_handlers(app)

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

    async def admin(raw: Request) -> Canary:
        if admin_guard is None:
            raise ApiError(403, "the admin routes need a key: start the router with --admin-key or --api-key",
                           "permission_error")  # fmt: skip
        await admin_guard(raw)
        if canary is None:
            raise ApiError(404, "this router has no canary (--canary URL)", "not_found_error")
        return canary

    @app.get("/admin/canary")
    async def canary_status(raw: Request) -> JSONResponse:
        c = await admin(raw)
        return JSONResponse(c.describe(fleet.clock()))

    @app.post("/admin/canary")
    async def canary_action(raw: Request) -> JSONResponse:
        """{"action": "promote" | "rollback" | "set_weight", "weight": W (set_weight only)}."""
        c = await admin(raw)
        try:
            body = json.loads(await raw.body() or b"null")
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "the body is not valid JSON", "invalid_request_error") from None
        action = body.get("action") if isinstance(body, dict) else None
        if action not in ("promote", "rollback", "set_weight"):
            raise ApiError(400, "action must be one of promote, rollback, set_weight", "invalid_request_error",
                           param="action")  # fmt: skip
        if action == "set_weight":
            w = body.get("weight")
            if isinstance(w, bool) or not isinstance(w, int | float) or not 0.0 <= float(w) <= 1.0:
                raise ApiError(400, "weight must be a number within [0, 1]", "invalid_request_error", param="weight")
            c.set_weight(float(w))
        elif action == "promote":
            c.promote()
        else:
            c.rollback("manual")
            metrics.canary_rollbacks.labels(reason="manual").inc()
        logger.warning("canary %s: %s by the admin, weight %.3g", c.versions["canary"], action, c.weight)
        return JSONResponse(c.describe(fleet.clock()))

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

    async def generate(raw: Request, path: str, chat: bool, tenant: Tenant) -> Response:
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
        # The salt the replica's engine will use: the tenant's (from the key), then the request's own.
        salt = tenant.request_salt(payload.get("cache_salt") if isinstance(payload.get("cache_salt"), str) else None)
        request = fleet.request(ids, salt, str(session) if session is not None else None)
        proxy: Proxy = holder["proxy"]
        try:
            response = await unless_client_gone(raw, proxy.forward(path, body, upstream_headers(raw), request, stream))
        except ClientGone:  # the client left before any answer: the upstream call is cancelled
            metrics.requests.labels(route=path, outcome="disconnected").inc()
            return Response(status_code=499)
        metrics.requests.labels(route=path, outcome=str(response.status_code)).inc()
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request, tenant: Tenant = Depends(guard)) -> Response:
        return await generate(raw, "/v1/chat/completions", True, tenant)

    @app.post("/v1/completions")
    async def completions(raw: Request, tenant: Tenant = Depends(guard)) -> Response:
        return await generate(raw, "/v1/completions", False, tenant)

    return app
