"""One streaming request to an OpenAI-compatible server, timed chunk by chunk.

Works with any server that speaks the OpenAI streaming protocol (ours, llama.cpp's
llama-server, vLLM): always `stream: true` with `stream_options.include_usage` (token counts
from the server) and `continuous_usage_stats` (vLLM's per-chunk counts, which tell us when
one chunk carries several tokens; servers that do not know it ignore it).

Every way a request can go wrong ends in a record with its own status, never an exception:
non-200 and `data: {"error": ...}` → failed; a stream cut before `[DONE]` → incomplete;
no answer within `timeout_s` → timeout.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from inferlab.bench.datasets import SampleRequest
from inferlab.bench.records import RequestRecord, RequestStatus

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def tls_verify(url: str) -> bool:
    """Certificates matter only for https; skipping them for http saves loading a CA bundle per client."""
    return url.startswith("https://")


def normalize_base_url(url: str) -> str:
    """`http://host:port[/v1][/]` → `http://host:port`; anything else → ValueError."""
    url = (url or "").strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--base-url must look like http://HOST:PORT, got {url!r}")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


@dataclass(frozen=True)
class EndpointConfig:
    """Where and how to send: the server, the route, the model and the knobs every request shares."""

    base_url: str  # http://host:port, no /v1
    model: str
    endpoint: str = "completions"  # "completions" (exact prompt tokens) | "chat" (the server's chat template)
    api_key: str | None = None
    timeout_s: float = 600.0  # a request still unanswered after this long counts as a timeout
    ignore_eos: bool = False  # generate exactly max_tokens (vLLM's --ignore-eos)
    continuous_usage: bool = True  # ask for per-chunk usage (vLLM); harmless elsewhere

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {self.timeout_s}")

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINTS[self.endpoint]

    def headers(self) -> dict[str, str]:
        h = {"Accept": "text/event-stream"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


def build_payload(cfg: EndpointConfig, req: SampleRequest) -> dict[str, Any]:
    """The JSON body: the prompt in the endpoint's shape, max_tokens, streaming with usage."""
    body: dict[str, Any] = {"model": cfg.model}
    if cfg.endpoint == "chat":
        if req.messages is not None:
            body["messages"] = [dict(m) for m in req.messages]
        else:
            msgs = [{"role": "system", "content": req.system}] if req.system else []
            body["messages"] = msgs + [{"role": "user", "content": req.prompt}]
    else:
        if req.messages is not None:
            raise ValueError("chat-format prompts (messages) need --endpoint chat")
        body["prompt"] = req.system + req.prompt
    if req.output_len is not None:
        body["max_tokens"] = req.output_len
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    if cfg.continuous_usage:
        body["stream_options"]["continuous_usage_stats"] = True
    return body


def _error_message(obj: Any) -> str:
    """The `message` of an OpenAI error object (or whatever the server sent), one line."""
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        err = err.get("message") or json.dumps(err)
    return " ".join(str(err).split())[:300]


def _chunk_text(obj: dict[str, Any]) -> str:
    """Text of the first choice: completions' `text`, chat's `delta.content` or `delta.reasoning_content`."""
    choices = obj.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    c = choices[0]
    if isinstance(c.get("text"), str):
        return c["text"]
    delta = c.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


class _StreamState:
    """Token accounting across chunks: a content chunk carries the tokens the server's running
    count (continuous usage) grew by since the tokens already credited, else one.

    Crediting every chunk, counted or not, matters for servers that send no per-chunk usage but
    attach the final total to the last content chunk: that chunk brings one token, not all of them.
    """

    def __init__(self, rec: RequestRecord) -> None:
        self.rec = rec
        self.reported = 0  # the server's latest completion_tokens (cumulative)
        self.credited = 0  # tokens given to content chunks so far

    def usage(self, usage: dict[str, Any]) -> None:
        if isinstance(usage.get("prompt_tokens"), int):
            self.rec.prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            self.rec.cached_tokens = details["cached_tokens"]
        c = usage.get("completion_tokens")
        if isinstance(c, int):
            self.reported = max(self.reported, c)
            self.rec.output_tokens = c
            self.rec.output_tokens_source = "usage"

    def content(self, t: float, text: str) -> None:
        tokens = max(1, self.reported - self.credited)
        self.credited += tokens
        self.rec.chunk_times.append(t)
        self.rec.chunk_tokens.append(tokens)
        self.rec.text += text


async def _read_stream(resp: httpx.Response, rec: RequestRecord, now: Callable[[], float]) -> None:
    """Consume SSE events until [DONE]; sets status and end_time for every outcome but timeouts."""
    state = _StreamState(rec)
    async for line in resp.aiter_lines():
        t = now()
        if line.startswith("error:"):  # llama.cpp's server sends mid-stream errors as an `error:` field
            rec.status, rec.end_time = RequestStatus.FAILED, t
            try:
                rec.error = f"error event: {_error_message(json.loads(line[6:]))}"
            except json.JSONDecodeError:
                rec.error = f"error event: {' '.join(line[6:].split())[:200]}"
            return
        if not line.startswith("data:"):
            continue  # blank separators, `event:` lines and `:` keep-alive comments
        data = line[5:].strip()
        if data == "[DONE]":
            rec.end_time = t
            if not rec.chunk_times:
                rec.status, rec.error = RequestStatus.FAILED, "the stream carried no content"
            return
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            rec.status, rec.end_time = RequestStatus.FAILED, t
            rec.error = f"malformed SSE event: {data[:80]!r}"
            return
        if isinstance(obj, dict) and obj.get("error"):
            rec.status, rec.end_time = RequestStatus.FAILED, t
            rec.error = f"error event: {_error_message(obj)}"
            return
        if not isinstance(obj, dict):
            continue
        if isinstance(obj.get("usage"), dict):
            state.usage(obj["usage"])
        text = _chunk_text(obj)
        if text:
            state.content(t, text)
    rec.status, rec.end_time = RequestStatus.INCOMPLETE, now()
    rec.error = "the stream ended before [DONE]"


async def send_request(
    http: httpx.AsyncClient,
    cfg: EndpointConfig,
    req: SampleRequest,
    index: int,
    *,
    now: Callable[[], float] = time.perf_counter,
) -> RequestRecord:
    """Send one streaming request and time it; never raises for a server's misbehaviour."""
    rec = RequestRecord(index=index, prompt_tokens=req.prompt_len)
    payload = build_payload(cfg, req)
    got_response = False
    rec.send_time = now()
    try:
        async with asyncio.timeout(cfg.timeout_s):
            async with http.stream("POST", cfg.url, json=payload, headers=cfg.headers()) as resp:
                got_response = True
                rec.http_status = resp.status_code
                if resp.status_code != 200:
                    body = await resp.aread()
                    try:
                        msg = _error_message(json.loads(body))
                    except (json.JSONDecodeError, UnicodeDecodeError):
                        msg = " ".join(body.decode("utf-8", "replace").split())[:200]
                    rec.status, rec.end_time = RequestStatus.FAILED, now()
                    rec.error = f"HTTP {resp.status_code}: {msg}" if msg else f"HTTP {resp.status_code}"
                    return rec
                await _read_stream(resp, rec, now)
    except (TimeoutError, httpx.TimeoutException):
        rec.status, rec.end_time = RequestStatus.TIMEOUT, now()
        rec.error = f"no complete answer within {cfg.timeout_s:g} s"
    except (httpx.RemoteProtocolError, httpx.ReadError) as e:
        # The connection broke: mid-stream that is an incomplete answer, before any response a failure.
        rec.end_time = now()
        rec.status = RequestStatus.INCOMPLETE if got_response else RequestStatus.FAILED
        rec.error = f"{'connection lost mid-stream' if got_response else 'connection error'}: {type(e).__name__}"
    except httpx.HTTPError as e:
        rec.status, rec.end_time = RequestStatus.FAILED, now()
        rec.error = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return rec


@dataclass(frozen=True)
class ServerInfo:
    """What `GET /v1/models` says: the model to ask for and its context window (when given)."""

    model: str
    model_ids: tuple[str, ...]
    max_model_len: int | None


def fetch_server_info(base_url: str, api_key: str | None = None, model: str | None = None, timeout_s: float = 30.0) -> ServerInfo:
    """Ask the server for its models; an unreachable or non-OpenAI server → ValueError in one line."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url + "/v1/models"
    try:
        r = httpx.get(url, headers=headers, timeout=timeout_s, verify=tls_verify(url))
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach the server at {base_url} ({type(e).__name__}: {' '.join(str(e).split())[:120]})") from None
    if r.status_code == 401:
        raise ValueError(f"the server at {base_url} wants an API key (--api-key)")
    if r.status_code != 200:
        raise ValueError(f"GET {url} answered HTTP {r.status_code}; is this an OpenAI-compatible server?")
    try:
        cards = [c for c in r.json().get("data", []) if isinstance(c, dict) and c.get("id")]
    except (json.JSONDecodeError, AttributeError):
        raise ValueError(f"GET {url} did not return an OpenAI model list") from None
    ids = tuple(str(c["id"]) for c in cards)
    if model is None:
        if not ids:
            raise ValueError(f"the server at {base_url} lists no models; pass --model NAME")
        model = ids[0]
    card = next((c for c in cards if c["id"] == model), {})
    mml = card.get("max_model_len")
    return ServerInfo(model=model, model_ids=ids, max_model_len=int(mml) if isinstance(mml, int) else None)
