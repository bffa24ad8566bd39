"""The FastAPI app: routes, error shapes, auth, lifespan.

    build_app(engine_factory, settings) ─► FastAPI
      lifespan start: AsyncLLM.start() (the model loads on the engine thread; /health says 503)
      lifespan end:   AsyncLLM.shutdown(settings.shutdown_timeout) (uvicorn has drained connections)

Every error leaves as `{"error": {"message", "type", "param", "code"}}`, FastAPI's 422s included
(they become 400s: clients and benchmark tools treat 4xx alike, and OpenAI answers 400).

Every guarded route knows its caller's `Tenant` (auth.py); the generation routes go through
that tenant's quotas (quotas.py) and count each request's outcome per tenant (a stream's at its
end). Body size and client timeouts: limits.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from inferlab.engine.async_llm import AsyncLLM, EngineLike
from inferlab.engine.kv_events import KVEventLog, page_json, snapshot_json
from inferlab.server import props as server_props
from inferlab.server.auth import ApiKeyGuard
from inferlab.server.httputil import add_error_handlers, error_response
from inferlab.server.limits import HttpLimits, LimitsMiddleware
from inferlab.server.live import LiveStats, Observers
from inferlab.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics, TenantMetrics, outcome_of_status
from inferlab.server.openapi import describe_bodies
from inferlab.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from inferlab.server.quotas import TenantGate
from inferlab.server.serving import OpenAIServing, parse_body, validation_error
from inferlab.server.tenants import Tenant, TenantTable
from inferlab.server.webui import add_webui_routes

logger = logging.getLogger("inferlab.server")


@dataclass(frozen=True)
class ServerSettings:
    """The server's own knobs (the engine's live in `EngineConfig`)."""

    served_model_names: tuple[str, ...] = ()  # empty: the engine's model name
    api_key: str | None = None  # one key, one anonymous tenant without limits
    tenants: TenantTable | None = None  # --api-keys (exclusive with api_key); neither: open access
    metrics_public: bool = False  # /metrics without the API key
    log_prompts: bool = False
    max_queue_len: int | None = None  # requests in flight beyond max_num_seqs; None = unbounded (the CLI bounds it)
    request_timeout: float | None = None  # seconds from arrival; None = no deadline
    shutdown_timeout: float = 30.0  # seconds to let in-flight requests finish
    stall_timeout: float = 300.0  # one engine call longer than this: /health says 503
    limits: HttpLimits = field(default_factory=HttpLimits)  # body size, client timeouts
    kv_events: bool = True  # GET /kv_events and /kv_events/snapshot for routers (engine/kv_events.py)
    kv_events_capacity: int = 8192  # records kept; a router further behind resyncs from the snapshot
    otlp_traces_endpoint: str | None = None  # each request's trace sent there over OTLP/HTTP (server/otlp.py)
    tool_call_parser: str = "auto"  # how "auto" tool calls are read (server/tool_calls.py)
    reasoning_parser: str | None = None  # "qwen3": <think> blocks into reasoning_content (server/reasoning.py)


def build_app(
    engine_factory: Callable[[], EngineLike],
    settings: ServerSettings | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> FastAPI:
    """An app serving the engine that `engine_factory` builds (called on the engine thread);
    `clock` drives the tenants' rate windows (tests step it by hand)."""
    settings = settings or ServerSettings()
    table = TenantTable.of(settings.api_key, settings.tenants)
    metrics = ServerMetrics(model_name=settings.served_model_names[0] if settings.served_model_names else None)
    tenant_metrics = TenantMetrics(metrics.registry, table.names)
    gate = TenantGate(
        table.tenants,
        clock=clock,
        on_limited=lambda t, limit: tenant_metrics.rate_limited(t.name, limit),
        on_in_flight=lambda t, n: tenant_metrics.in_flight(t.name, n),
    )
    kv_log: list[KVEventLog] = []  # filled on the engine thread once the engine is built

    def make_engine() -> EngineLike:
        engine = engine_factory()
        if settings.kv_events and hasattr(engine, "enable_kv_events"):
            kv_log.append(engine.enable_kv_events(settings.kv_events_capacity))
        return engine

    live = LiveStats()
    exporter = None
    if settings.otlp_traces_endpoint is not None:
        from inferlab.server.otlp import OtlpTraceExporter

        exporter = OtlpTraceExporter(settings.otlp_traces_endpoint)  # a bad URL or no SDK: ValueError now
    llm = AsyncLLM(
        make_engine,
        max_queue_len=settings.max_queue_len,
        request_timeout=settings.request_timeout,
        stall_timeout=settings.stall_timeout,
        observer=Observers(metrics, live, _TraceExport(exporter)),
    )
    serving = OpenAIServing(
        llm,
        served_model_names=settings.served_model_names,
        log_prompts=settings.log_prompts,
        request_timeout=settings.request_timeout,
        gate=gate,
        tenant_metrics=tenant_metrics,
        tool_call_parser=settings.tool_call_parser,
        reasoning_parser=settings.reasoning_parser,
    )
    guard = ApiKeyGuard(table)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        llm.start()
        yield
        await asyncio.to_thread(llm.shutdown, settings.shutdown_timeout)
        if exporter is not None:
            await asyncio.to_thread(exporter.shutdown)

    app = FastAPI(title="inferlab", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(LimitsMiddleware, limits=settings.limits)
    app.state.llm = llm
    app.state.metrics = metrics
    app.state.live = live
    app.state.tenant_metrics = tenant_metrics
    app.state.gate = gate
    app.state.settings = settings
    app.state.serving = serving

    add_error_handlers(app)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug or a failing component (a tokenizer that raises): logged with its traceback,
        # answered in the same error shape as every other failure, the server stays up.
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_server_error"))

    guarded = [Depends(guard)]

    @app.get("/health")
    async def health() -> Response:
        if llm.load_error is not None:
            return error_response(ApiError(503, f"the model failed to load: {llm.load_error}", "unavailable_error"))
        if llm.dead_error is not None:
            return error_response(ApiError(503, f"the engine loop stopped: {llm.dead_error}", "unavailable_error"))
        if not llm.ready:
            return error_response(ApiError(503, "Loading model", "unavailable_error", headers={"Retry-After": "5"}))
        if not llm.is_healthy():
            return error_response(ApiError(503, "the engine loop has stalled", "unavailable_error"))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", dependencies=[] if settings.metrics_public else guarded)
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def loaded_engine() -> Any:
        if llm.engine is None or not llm.ready:
            raise ApiError(503, "Loading model", "unavailable_error", headers={"Retry-After": "5"})
        return llm.engine

    @app.get("/server_info", dependencies=guarded)
    async def server_info() -> JSONResponse:
        """The engine's own decisions (precision, kernels, KV cache), once it is loaded."""
        engine = loaded_engine()
        info = engine.info() if hasattr(engine, "info") else {"model": engine.model_name}
        return JSONResponse({**info, "served_model_names": list(serving.model_names())})

    def events_log() -> KVEventLog:
        loaded_engine()
        if not kv_log:
            raise ApiError(404, "KV events are off on this server (started with --no-kv-events, or the engine has "
                                "no prefix cache log)", "not_found_error")  # fmt: skip
        return kv_log[0]

    @app.get("/kv_events", dependencies=guarded)
    async def kv_events(after: int = Query(0, ge=0), limit: int = Query(1000, ge=1, le=10_000)) -> JSONResponse:
        """The prefix cache's changes after seq `after` (polled by `inferlab router`); `gap`: resync
        from /kv_events/snapshot."""
        log = events_log()
        return JSONResponse(page_json(log.since(after, limit), log.block_size))

    @app.get("/kv_events/snapshot", dependencies=guarded)
    async def kv_events_snapshot() -> JSONResponse:
        """Every cached block hash, as of the log's `seq`."""
        log = events_log()
        return JSONResponse(snapshot_json(log.snapshot(), log.block_size))

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse(server_props.version())

    @app.get("/props", dependencies=guarded)
    async def props() -> JSONResponse:
        """llama-server's /props: context, slots, sampling defaults; and our precision and kernels."""
        return JSONResponse(server_props.props(loaded_engine(), list(serving.model_names())))

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> JSONResponse:
        return JSONResponse(serving.models())

    async def counted(tenant: Tenant, raw: Request, body: type[BaseModel],
                      serve: Callable[..., Awaitable[Response]]) -> Response:  # fmt: skip
        """The route's response, its outcome counted for the tenant (a stream's when it ends)."""
        arrival = time.monotonic()
        try:
            response = await serve(await parse_body(raw, body), raw, arrival, tenant)
        except ApiError as e:
            tenant_metrics.outcome(tenant.name, outcome_of_status(e.status))
            raise
        except asyncio.CancelledError:
            tenant_metrics.outcome(tenant.name, "disconnected")
            raise
        except Exception:
            tenant_metrics.outcome(tenant.name, "error")
            raise
        if not isinstance(response, StreamingResponse):
            tenant_metrics.outcome(tenant.name, outcome_of_status(response.status_code))
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request, tenant: Tenant = Depends(guard)) -> Response:
        return await counted(tenant, raw, ChatCompletionRequest, serving.chat)

    @app.post("/v1/completions")
    async def completions(raw: Request, tenant: Tenant = Depends(guard)) -> Response:
        return await counted(tenant, raw, CompletionRequest, serving.completion)

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(raw: Request) -> JSONResponse:
        req = await parse_body(raw, TokenizeRequest)
        return JSONResponse(serving.tokenize(req))

    @app.get("/tokenizer_info", dependencies=guarded)
    async def tokenizer_info() -> JSONResponse:
        return JSONResponse(serving.tokenizer_info())

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(raw: Request) -> JSONResponse:
        req = await parse_body(raw, DetokenizeRequest)
        return JSONResponse(serving.detokenize(req))

    add_webui_routes(app, llm, live, guard)
    describe_bodies(app, {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest})  # fmt: skip
    return app


class _TraceExport:
    """Hands each finished request's trace to the OTLP exporter, once the engine has loaded."""

    def __init__(self, exporter: Callable[[Any], None] | None):
        self.exporter = exporter

    def on_ready(self, engine: Any) -> None:
        traces = getattr(engine, "traces", None)
        if self.exporter is not None and traces is not None:
            traces.on_complete.append(self.exporter)

    def on_outputs(self, outputs: Any, now: float) -> None:
        pass

    def on_stats(self, stats: Any) -> None:
        pass

    def on_request_dropped(self, request_id: str, reason: str) -> None:
        pass
