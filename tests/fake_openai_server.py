"""A small OpenAI-compatible server for the bench's tests that misbehaves on purpose.

A raw asyncio HTTP/1.1 server on 127.0.0.1 (free port) in a thread of its own, so that
tests fully control the bytes: SSE tokens with set timing, and per-request behaviours taken
in turn from `schedule` (request k gets schedule[k % len(schedule)]):

- "ok": stream max_tokens tokens, usage (when asked), [DONE]
- "http500": a 500 with an OpenAI error body
- "error_event": a 200 stream, two tokens, then `data: {"error": ...}` and [DONE]
- "drop": a 200 chunked stream, two tokens, then the socket closes mid-body (protocol error)
- "eof": a 200 un-chunked stream, two tokens, then a clean close without [DONE]
- "stall": a 200 stream, one token, then silence for `stall_s` (past the client's timeout)
- "no_usage": like "ok" but never sends usage, whatever the client asked

Its tokenizer is one token per whitespace-separated word (ids given on first sight), with a
BOS token added for completions prompts, so prompt lengths can be checked exactly.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

BEHAVIOURS = ("ok", "http500", "error_event", "drop", "eof", "stall", "no_usage")


@dataclass
class FakeServerStats:
    chat_or_completion_requests: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    behaviours: list[str] = field(default_factory=list)
    tokenize_calls: int = 0
    metrics_calls: int = 0
    max_running: int = 0  # most generation requests in flight at once


class WordTokenizer:
    """One token per whitespace-separated word; id 0 is BOS."""

    def __init__(self) -> None:
        self.words = ["<s>"]
        self.ids: dict[str, int] = {"<s>": 0}
        self.lock = threading.Lock()

    def encode(self, text: str, add_special: bool) -> list[int]:
        out = [0] if add_special else []
        with self.lock:
            for w in text.split():
                if w not in self.ids:
                    self.ids[w] = len(self.words)
                    self.words.append(w)
                out.append(self.ids[w])
        return out

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids if 0 < i < len(self.words))


class FakeOpenAIServer:
    def __init__(
        self,
        schedule: tuple[str, ...] = ("ok",),
        *,
        ttft_s: float = 0.0,
        token_delay_s: float = 0.0,
        tokens_per_chunk: int = 1,
        stall_s: float = 5.0,
        model: str = "fake-model",
        max_model_len: int = 4096,
        default_max_tokens: int = 16,
        tokenize: bool = True,
        metrics: bool = True,
    ) -> None:
        bad = [b for b in schedule if b not in BEHAVIOURS]
        if bad or not schedule:
            raise ValueError(f"unknown behaviours {bad}")
        self.schedule = schedule
        self.ttft_s, self.token_delay_s, self.tokens_per_chunk = ttft_s, token_delay_s, tokens_per_chunk
        self.stall_s, self.model, self.max_model_len = stall_s, model, max_model_len
        self.default_max_tokens = default_max_tokens
        self.serve_tokenize, self.serve_metrics = tokenize, metrics
        self.tokenizer = WordTokenizer()
        self.stats = FakeServerStats()
        self.running = 0
        self.generated = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task] = set()
        self.port = 0

    # ---- lifecycle ------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeOpenAIServer:
        ready = threading.Event()

        def main() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()
            # shutdown: cancel live handlers (stalled streams), close the listener
            for t in list(self._tasks):
                t.cancel()
            self._loop.run_until_complete(asyncio.gather(*self._tasks, return_exceptions=True))
            self._server.close()
            self._loop.run_until_complete(self._server.wait_closed())
            self._loop.close()

        self._thread = threading.Thread(target=main, name="fake-openai-server", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._thread = None

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- HTTP -----------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
            n = int(headers.get("content-length", "0") or 0)
            body = json.loads(await reader.readexactly(n)) if n else {}
            await self._route(method, path, body, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            self._tasks.discard(task)
            try:
                writer.close()
            except Exception:
                pass

    async def _json(self, writer: asyncio.StreamWriter, status: int, obj: Any, reason: str = "OK") -> None:
        data = json.dumps(obj).encode()
        writer.write(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            f"Connection: close\r\n\r\n".encode() + data
        )
        await writer.drain()

    async def _route(self, method: str, path: str, body: dict, writer: asyncio.StreamWriter) -> None:
        if method == "GET" and path == "/v1/models":
            await self._json(writer, 200, {"object": "list", "data": [
                {"id": self.model, "object": "model", "owned_by": "test", "max_model_len": self.max_model_len}]})
        elif method == "GET" and path == "/health":
            await self._json(writer, 200, {"status": "ok"})
        elif method == "GET" and path == "/metrics" and self.serve_metrics:
            self.stats.metrics_calls += 1
            text = (
                "# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{model_name="{self.model}",engine="0"}} {self.running}\n'
                "# TYPE vllm:num_requests_waiting gauge\n"
                f'vllm:num_requests_waiting{{model_name="{self.model}",engine="0"}} 0\n'
                "# TYPE vllm:kv_cache_usage_perc gauge\n"
                f'vllm:kv_cache_usage_perc{{model_name="{self.model}",engine="0"}} {min(1.0, self.running / 10)}\n'
                "# TYPE vllm:generation_tokens counter\n"
                f'vllm:generation_tokens_total{{model_name="{self.model}",engine="0"}} {self.generated}\n'
            ).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                         + f"Content-Length: {len(text)}\r\nConnection: close\r\n\r\n".encode() + text)
            await writer.drain()
        elif method == "POST" and path == "/tokenize" and self.serve_tokenize:
            self.stats.tokenize_calls += 1
            text = body.get("prompt", body.get("content", ""))
            ids = self.tokenizer.encode(text, bool(body.get("add_special_tokens", True)))
            await self._json(writer, 200, {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len})
        elif method == "POST" and path == "/detokenize" and self.serve_tokenize:
            await self._json(writer, 200, {"prompt": self.tokenizer.decode(list(body.get("tokens", [])))})
        elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            await self._generate(path.endswith("chat/completions"), body, writer)
        else:
            await self._json(writer, 404, {"error": {"message": "not found", "type": "not_found", "code": 404}}, "Not Found")

    # ---- generation -------------------------------------------------------------------------
    def _prompt_tokens(self, chat: bool, body: dict) -> int:
        if chat:
            text = " ".join(str(m.get("content", "")) for m in body.get("messages", []))
            return len(self.tokenizer.encode(text, False)) + 5  # a pretend chat template
        return len(self.tokenizer.encode(str(body.get("prompt", "")), True))

    async def _generate(self, chat: bool, body: dict, writer: asyncio.StreamWriter) -> None:
        k = self.stats.chat_or_completion_requests
        self.stats.chat_or_completion_requests += 1
        behaviour = self.schedule[k % len(self.schedule)]
        self.stats.bodies.append(body)
        self.stats.behaviours.append(behaviour)
        if behaviour == "http500":
            await self._json(writer, 500, {"error": {"message": "injected failure", "type": "server_error", "code": 500}},
                             "Internal Server Error")
            return
        chunked = behaviour != "eof"
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            + (b"Transfer-Encoding: chunked\r\n" if chunked else b"")
            + b"Connection: close\r\n\r\n"
        )

        async def send(payload: str) -> None:
            data = f"data: {payload}\n\n".encode()
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n" if chunked else data)
            await writer.drain()

        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or self.default_max_tokens)
        opts = body.get("stream_options") or {}
        usage_on = bool(opts.get("include_usage")) and behaviour != "no_usage"
        continuous = usage_on and bool(opts.get("continuous_usage_stats"))
        prompt_tokens = self._prompt_tokens(chat, body)
        rid, created = f"cmpl-{k}", int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str, done_tokens: int, finish: str | None = None) -> str:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                choice["delta"] = {"content": text} if text else {}
            else:
                choice["text"] = text
            c: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": self.model, "choices": [choice]}
            if continuous:
                c["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": done_tokens,
                              "total_tokens": prompt_tokens + done_tokens}
            elif usage_on:
                c["usage"] = None
            return json.dumps(c)

        self.running += 1
        self.stats.max_running = max(self.stats.max_running, self.running)
        try:
            if chat:
                await send(json.dumps({"id": rid, "object": obj, "created": created, "model": self.model,
                                       "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}))
            if self.ttft_s:
                await asyncio.sleep(self.ttft_s)
            limit = {"error_event": 2, "drop": 2, "eof": 2, "stall": 1}.get(behaviour, max_tokens)
            done = 0
            while done < min(limit, max_tokens):
                step = min(self.tokens_per_chunk, max_tokens - done)
                if done and self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                text = "".join(f" w{done + j}" for j in range(step))
                done += step
                self.generated += step
                await send(chunk(text, done))
            if behaviour == "error_event":
                await send(json.dumps({"error": {"message": "injected mid-stream error", "type": "server_error", "code": 500}}))
                await send("[DONE]")
            elif behaviour == "drop":
                writer.transport.abort()  # mid-body: no terminating chunk
                return
            elif behaviour == "eof":
                return  # clean close, no [DONE]
            elif behaviour == "stall":
                await asyncio.sleep(self.stall_s)
                return
            else:
                await send(chunk("", done, "length"))
                if usage_on:
                    await send(json.dumps({"id": rid, "object": obj, "created": created, "model": self.model, "choices": [],
                                           "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": done,
                                                     "total_tokens": prompt_tokens + done}}))
                await send("[DONE]")
            if chunked:
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        finally:
            self.running -= 1
