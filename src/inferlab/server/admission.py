"""Admission control's answers: what each refusal or failure looks like on the wire.

The limits themselves are enforced by `AsyncLLM` (bounded waiting queue, per-request deadline)
and the engine (context window); this module maps their exceptions to OpenAI-style errors with
the right HTTP status, so that clients can tell "retry later" (503 + Retry-After) from "fix your
request" (400) from "too slow" (504).
"""

from __future__ import annotations

from inferlab.engine.async_llm import (
    EngineNotReadyError,
    EngineStepError,
    QueueFullError,
    RequestAbortedError,
    RequestTimeoutError,
)
from inferlab.engine.errors import ContextLengthError, EngineDeadError
from inferlab.server.protocol import ApiError

RETRY_AFTER_QUEUE_FULL_S = 1  # a full queue drains in about one request's time: retry soon
RETRY_AFTER_LOADING_S = 5


def to_api_error(exc: BaseException, prompt_param: str = "prompt") -> ApiError:
    """The ApiError for an exception raised while admitting or running a request."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ContextLengthError):
        return ApiError(
            400,
            str(exc),
            "exceed_context_size_error",  # llama.cpp's type; its n_prompt_tokens / n_ctx fields too
            prompt_param,
            extra={"n_prompt_tokens": exc.n_prompt_tokens, "n_ctx": exc.n_ctx},
        )
    if isinstance(exc, QueueFullError):
        return ApiError(503, str(exc), "service_unavailable_error", headers={"Retry-After": str(RETRY_AFTER_QUEUE_FULL_S)})
    if isinstance(exc, EngineNotReadyError):
        return ApiError(503, str(exc), "service_unavailable_error", headers={"Retry-After": str(RETRY_AFTER_LOADING_S)})
    if isinstance(exc, EngineDeadError):
        return ApiError(503, str(exc), "service_unavailable_error")
    if isinstance(exc, RequestTimeoutError):
        return ApiError(504, str(exc), "timeout_error")
    if isinstance(exc, RequestAbortedError):
        return ApiError(503, str(exc), "service_unavailable_error")
    if isinstance(exc, EngineStepError):
        return ApiError(500, str(exc), "server_error")
    if isinstance(exc, ValueError):
        return ApiError(400, str(exc), "invalid_request_error", prompt_param)
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


def effective_timeout(server_timeout: float | None, request_timeout: float | None) -> float | None:
    """A request may ask for a shorter deadline than the server's, never a longer one."""
    return min((t for t in (server_timeout, request_timeout) if t is not None), default=None)
