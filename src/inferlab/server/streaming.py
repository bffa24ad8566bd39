"""Server-Sent Events for streamed chat and completions.

    data: {chunk}\\n\\n ... data: {chunk}\\n\\n [data: {usage chunk, choices: []}\\n\\n] data: [DONE]\\n\\n

One chunk per choice that has something new (text, logprobs or a finish reason); steps that
produced only held-back text (a possible stop string, half a UTF-8 character) send nothing.
An error after the 200 has gone out becomes `data: {"error": {...}}`, then `[DONE]`.
A client that disconnects cancels the generator: its `finally` aborts the engine requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from inferlab.engine.async_llm import EngineStepError, RequestStream
from inferlab.engine.request import RequestOutput
from inferlab.server.admission import to_api_error
from inferlab.server.reasoning import ReasoningStream, split_reasoning
from inferlab.server.render import (
    SSE_DONE,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    echo_items,
    prompt_logprobs_json,
    sse,
    timings,
    usage,
)
from inferlab.server.tool_calls import Delta, ToolOutput, ToolStream


@dataclass
class ResponseContext:
    """How to answer one HTTP request (shared by the streamed and the plain response)."""

    kind: str  # "chat" | "completion"
    response_id: str
    created: int
    model: str
    n: int
    include_usage: bool = False
    continuous_usage: bool = False
    want_logprobs: bool = False
    token_text: TokenText | None = None
    # Completions with echo: each prompt's (text, token ids), shown before its completions.
    echo_prompts: list[tuple[str, list[int]]] | None = None
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone, finish_reason "length"
    logprobs: int | None = None  # completions' top k, for the echoed prompt's entries too
    prompt_logprobs: int | None = None  # vLLM's: each choice carries `prompt_logprobs`
    tools: ToolOutput | None = None  # chat with tools: answers read as tool calls
    reasoning: bool = False  # chat under --reasoning-parser: <think> blocks into reasoning_content
    # Called once at the end with (status, the last output of each prompt): the request's log line.
    on_done: Callable[[str, list[RequestOutput | None]], None] | None = None
    first_output_time: float | None = None  # the first output reached the HTTP side (the trace's stream span)

    @property
    def chat(self) -> bool:
        return self.kind == "chat"


_END = object()


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several request streams, as they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - re-raised by the reader
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, _END))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


def _check_finish(reason: str | None) -> None:
    if reason in ("abort", "error"):
        raise EngineStepError(f"the engine ended the request ({reason})")


def completion_text_and_logprobs(
    ctx: ResponseContext, p: int, out: RequestOutput, text: str, items: list[Any], first: bool, offset: int = 0
) -> tuple[str, dict[str, Any] | None]:
    """A completion choice's text and logprobs; in its `first` piece under echo, prompt p's
    text and entries go before them (under echo_only, alone)."""
    if ctx.echo_prompts is None or not first:
        lp = completion_logprobs(items, ctx.token_text, offset) if ctx.want_logprobs else None
        return text, lp
    prompt_text, prompt_ids = ctx.echo_prompts[p]
    if ctx.echo_only:
        text, items = "", []
    lp = None
    if ctx.want_logprobs:
        head = completion_logprobs(echo_items(prompt_ids, out.prompt_logprobs, ctx.logprobs or 0), ctx.token_text)
        lp = completion_logprobs(items, ctx.token_text, len(prompt_text), prefix=head)
    return prompt_text + text, lp


def _finish_fields(ctx: ResponseContext, reason: str | None, stop_reason: Any) -> tuple[str | None, Any]:
    """echo_only answers "length" (max_tokens 0 reached) whatever ended the one sampled token."""
    if ctx.echo_only and reason is not None:
        return "length", None
    return reason, stop_reason


def _prompt_logprobs_field(ctx: ResponseContext, out: RequestOutput) -> list[Any] | None:
    return prompt_logprobs_json(out.prompt_token_ids, out.prompt_logprobs, ctx.prompt_logprobs or 0, ctx.token_text)


async def sse_stream(ctx: ResponseContext, streams: list[RequestStream]) -> AsyncIterator[bytes]:
    """The SSE body of a streamed chat or completion request."""
    head = {
        "id": ctx.response_id,
        "object": "chat.completion.chunk" if ctx.chat else "text_completion",
        "created": ctx.created,
        "model": ctx.model,
    }
    latest: list[RequestOutput | None] = [None] * len(streams)
    text_offsets: dict[int, int] = {}
    started: set[int] = set()  # completion choices that sent their first piece (the echo)
    tool_streams: dict[int, ToolStream] = {}  # chat choices' tool-call readers
    reasoning_streams: dict[int, ReasoningStream] = {}  # and their <think> splitters
    status = "disconnected"
    try:
        if ctx.chat:
            for i in range(ctx.n):
                chunk = {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
                if ctx.include_usage:
                    chunk["usage"] = None
                yield sse(chunk)
        async for p, out in merge_streams(streams):
            if ctx.first_output_time is None:
                ctx.first_output_time = time.monotonic()
            latest[p] = out
            base = p * ctx.n
            for c in out.outputs:
                reason = c.finish_reason
                _check_finish(reason)
                if not c.text_delta and reason is None and not c.logprobs_delta:
                    continue
                if ctx.echo_only and reason is None:
                    continue  # its one piece comes with the finish
                index = base + c.index
                lp = None
                stop_reason = c.stop_reason
                if ctx.chat:
                    if ctx.want_logprobs and c.logprobs_delta:
                        lp = chat_logprobs(c.logprobs_delta, ctx.token_text)
                    text = c.text_delta
                    delta: dict[str, Any] = {}
                    if ctx.reasoning:
                        rs = reasoning_streams.setdefault(index, ReasoningStream())
                        thought, text = rs.feed(text) if text else ("", "")
                        if reason is not None:
                            more_thought, more_text = rs.finish()
                            thought, text = thought + more_thought, text + more_text
                        if thought:
                            delta["reasoning_content"] = thought
                    if ctx.tools is not None:
                        ts = tool_streams.setdefault(index, ctx.tools.stream())
                        d = ts.feed(text) if text else Delta()
                        if reason is not None:
                            tail = ts.finish()
                            d = Delta(d.content + tail.content, d.tool_calls + tail.tool_calls)
                            if ts.num_calls and reason == "stop":
                                reason = "tool_calls"
                        if d.content:
                            delta["content"] = d.content
                        if d.tool_calls:
                            delta["tool_calls"] = d.tool_calls
                    elif text:
                        delta["content"] = text
                    if not delta and reason is None and lp is None:
                        continue  # held back: it may be the start of a tag
                    choice = {"index": index, "delta": delta}
                else:
                    first = index not in started
                    started.add(index)
                    offset = text_offsets.get(index, 0)
                    text, lp = completion_text_and_logprobs(
                        ctx, p, out, c.text_delta, c.logprobs_delta or [], first, offset
                    )
                    if lp is not None and not lp["tokens"]:
                        lp = None
                    text_offsets[index] = offset + len(text)
                    choice = {"index": index, "text": text}
                    if first and ctx.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = _prompt_logprobs_field(ctx, out)
                    reason, stop_reason = _finish_fields(ctx, reason, stop_reason)
                choice["logprobs"] = lp
                choice["finish_reason"] = reason
                if reason is not None:
                    choice["stop_reason"] = stop_reason
                chunk = {**head, "choices": [choice]}
                if ctx.include_usage:
                    chunk["usage"] = (usage([o for o in latest if o is not None], ctx.echo_only)
                                      if ctx.continuous_usage else None)  # fmt: skip
                if out.finished and reason is not None and len(streams) == 1:
                    chunk["timings"] = timings([out])
                yield sse(chunk)
        finals = [o for o in latest if o is not None]
        if ctx.include_usage:
            chunk = {**head, "choices": [], "usage": usage(finals, ctx.echo_only)}
            t = timings(finals)
            if t is not None:
                chunk["timings"] = t
            yield sse(chunk)
        status = "ok"
    except Exception as e:  # noqa: BLE001 - the 200 is out: report in-band
        err = to_api_error(e)
        status = f"error {err.status}: {err.message}"
        yield sse(err.body())
    finally:
        for s in streams:
            s.abort()  # a no-op for finished ones; frees the KV blocks of the rest
        if ctx.on_done is not None:
            ctx.on_done(status, latest)
    yield SSE_DONE


def response_dict(ctx: ResponseContext, finals: list[RequestOutput], logprobs: list[list[list[Any]]]) -> dict[str, Any]:
    """The non-streamed response body; `logprobs[p][i]` holds sequence i of prompt p's entries."""
    choices = []
    for p, out in enumerate(finals):
        for c in out.outputs:
            _check_finish(c.finish_reason)
            index = p * ctx.n + c.index
            items = (logprobs[p][c.index] if logprobs[p][c.index] else (c.logprobs or [])) if ctx.want_logprobs else []
            reason, stop_reason = c.finish_reason, c.stop_reason
            if ctx.chat:
                lp = chat_logprobs(items, ctx.token_text) if ctx.want_logprobs else None
                message: dict[str, Any] = {"role": "assistant", "content": c.text}
                if ctx.reasoning:
                    thought, message["content"] = split_reasoning(c.text)
                    message["reasoning_content"] = thought
                if ctx.tools is not None:
                    content, calls = ctx.tools.extract(message["content"])
                    if calls:
                        message.update(content=content, tool_calls=[t.as_dict() for t in calls])
                        if reason == "stop":
                            reason = "tool_calls"
                choice = {"index": index, "message": message}
            else:
                text, lp = completion_text_and_logprobs(ctx, p, out, c.text, items, first=True)
                choice = {"index": index, "text": text}
                if ctx.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = _prompt_logprobs_field(ctx, out)
                reason, stop_reason = _finish_fields(ctx, reason, stop_reason)
            choice.update({"logprobs": lp, "finish_reason": reason, "stop_reason": stop_reason})
            choices.append(choice)
    choices.sort(key=lambda ch: ch["index"])
    body = {
        "id": ctx.response_id,
        "object": "chat.completion" if ctx.chat else "text_completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
        "usage": usage(finals, ctx.echo_only),
    }
    t = timings(finals)
    if t is not None:
        body["timings"] = t
    return body
