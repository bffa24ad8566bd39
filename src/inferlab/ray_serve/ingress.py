"""The OpenAI endpoint on Ray Serve: our routes reach the engine replicas through a handle.

Serve's HTTP proxy hands each HTTP request to this ingress (a FastAPI app). Generation routes
are tokenized here once (the model's own tokenizer and chat template, as `inferlab router
--tokenizer` does), so the request router can score prefixes; then the request is streamed to
the replica the router picks. A replica that fails before its first byte (its actor died, it is
being replaced) costs a retry on another, up to `retries` times; after the first byte a failure
ends the response (an SSE error event for a stream), since the client has seen part of it.
"""

# No `from __future__ import annotations`: FastAPI must see the real `Request` annotations of
# methods that serve.ingress rebinds.
import json
import logging
from collections import Counter
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from inferlab.router.tokens import LocalTokenizer, prompt_spec

logger = logging.getLogger("inferlab.ray_serve")

app = FastAPI(title="inferlab (Ray Serve)", docs_url=None, redoc_url=None)
GENERATE = {"/v1/chat/completions": True, "/v1/completions": False}


def _error(status: int, message: str, kind: str = "service_unavailable") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status_code=status)


@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, engine: Any, model: str | None, retries: int = 3):
        self.engine = engine
        self.retries = retries
        self.tokenizer: LocalTokenizer | None = None
        try:
            self.tokenizer = LocalTokenizer.load(model or "SmolLM2-135M-Instruct")
        except Exception as e:  # noqa: BLE001 - no tokenizer here: route by load alone
            logger.warning("no local tokenizer (%s): routing by load only", e)
        self.served: Counter[str] = Counter()  # per replica, by this ingress
        self.retried = 0

    @app.get("/ray/replicas")
    async def replicas(self) -> dict[str, Any]:
        """Requests each replica answered (through this ingress) and the retries taken."""
        return {"served": dict(self.served), "retried": self.retried}

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PUT"])
    async def proxy(self, request: Request, path: str) -> Any:
        body = await request.body()
        route = await self._route("/" + path, body, request.headers.get("x-session-id"))
        headers = dict(request.headers)
        target = "/" + path + (("?" + request.url.query) if request.url.query else "")
        last: BaseException | None = None
        for attempt in range(self.retries):
            gen = self.engine.options(stream=True).forward.remote(request.method, target, headers, body, route=route)
            try:
                status, out, replica = await gen.__anext__()
            except Exception as e:  # noqa: BLE001 - the replica died or was unreachable before answering
                last = e
                self.retried += 1
                logger.warning("attempt %d failed before the first byte: %s", attempt + 1, type(e).__name__)
                continue
            self.served[replica] += 1
            out["x-inferlab-replica"] = replica
            sse = out.get("content-type", "").startswith("text/event-stream")
            return StreamingResponse(self._rest(gen, sse), status_code=status, headers=out)
        return _error(503, f"no replica answered after {self.retries} attempts: {type(last).__name__}: {last}")

    async def _rest(self, gen: Any, sse: bool) -> Any:
        try:
            async for chunk in gen:
                yield chunk
        except Exception as e:  # noqa: BLE001 - the replica died mid-response
            if sse:
                err = {"error": {"message": f"replica failed mid-stream: {type(e).__name__}", "type": "upstream_error",
                                 "param": None, "code": 502}}  # fmt: skip
                yield f"data: {json.dumps(err)}\n\n".encode()
        finally:
            gen.cancel()

    async def _route(self, path: str, body: bytes, session: str | None) -> dict[str, Any] | None:
        if path not in GENERATE:
            return None
        try:
            payload = json.loads(body)
        except ValueError:
            return None  # the replica answers the 400
        if not isinstance(payload, dict):
            return None
        spec = prompt_spec(GENERATE[path], payload)
        ids = await self.tokenizer.token_ids(spec, ()) if spec is not None and self.tokenizer is not None else None
        session = session or (payload.get("user") if isinstance(payload.get("user"), str) else None)
        return {"token_ids": ids or [], "prompt_tokens": len(ids or ()), "session": session}
