"""The OpenAI routes' logic: request body → prompts → engine requests → response.

Prompts are tokenized here, on the event loop, before the engine sees them: the engine thread
then spends its time on forward passes, and the arrival time stamped before tokenizing makes
TTFT include tokenization (as clients measure it).

Tenants: every generation request carries the `Tenant` its key belongs to. Its caps on prompt
and completion length are checked here once the prompt is tokenized (400 naming the field, as
OpenAI answers a max_tokens beyond a model's limit: not retryable, where a 429 would make SDKs
retry in vain); then `TenantGate` admits it or answers 429; the engine gets the tenant's cache
salt; when the response ends, the lease is released with the tokens really used.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from inferlab.engine.async_llm import AsyncLLM, EngineNotReadyError, RequestStream
from inferlab.engine.errors import EngineDeadError
from inferlab.engine.generation_config import SamplingDefaults
from inferlab.engine.request import RequestOptions, RequestOutput, SamplingParams
from inferlab.server.admission import effective_timeout, to_api_error
from inferlab.server.httputil import ClientGone, ClosingStream, unless_client_gone
from inferlab.server.metrics import TenantMetrics
from inferlab.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
)
from inferlab.server.quotas import Lease, TenantGate
from inferlab.server.render import TokenText
from inferlab.server.streaming import ResponseContext, merge_streams, response_dict, sse_stream
from inferlab.server.tenants import Tenant
from inferlab.server.tool_calls import (
    ToolOutput,
    ToolRequest,
    choose_parser,
    message_for_template,
    template_renders_tools,
    tool_request,
    tools_system_prompt,
)

logger = logging.getLogger("inferlab.server")

async def parse_body(raw: Request, model: type[BaseModel]) -> Any:
    """The JSON body validated against `model`; malformed JSON or wrong types → ApiError(400)."""
    body = await raw.body()
    try:
        data = json.loads(body) if body else None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def validation_error(e: ValidationError | Any) -> ApiError:
    """The first problem pydantic found, as one readable message naming the field."""
    errors = e.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return bad_request(f"{param}: {msg}{more}" if param else f"{msg}{more}", param=param)


class OpenAIServing:
    """Chat, completions, models, tokenize and detokenize over one `AsyncLLM`."""

    def __init__(
        self,
        llm: AsyncLLM,
        *,
        served_model_names: tuple[str, ...] = (),
        log_prompts: bool = False,
        request_timeout: float | None = None,
        gate: TenantGate | None = None,
        tenant_metrics: TenantMetrics | None = None,
        tool_call_parser: str = "auto",
        reasoning_parser: str | None = None,
    ):
        self.llm = llm
        self.gate = gate
        self.tenant_metrics = tenant_metrics
        self.served_model_names = served_model_names
        self.log_prompts = log_prompts
        self.request_timeout = request_timeout
        self.created = int(time.time())
        self._token_text: TokenText | None = None
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser

    # ------------------------------------------------------------------ basics
    @property
    def engine(self) -> Any:
        """The loaded engine (its tokenizer is read-only, safe to use off the engine thread)."""
        llm = self.llm
        if llm.load_error is not None or llm.dead_error is not None:
            raise to_api_error(EngineDeadError(f"the engine is not available: {llm.load_error or llm.dead_error}"))
        if not llm.ready or llm.engine is None:
            raise to_api_error(EngineNotReadyError("the model is still loading; retry later"))
        return llm.engine

    def model_names(self) -> list[str]:
        if self.served_model_names:
            return list(self.served_model_names)
        return [self.engine.model_name]

    def check_model(self, name: str | None) -> str:
        """The name to report; an unknown model name → 404."""
        names = self.model_names()
        if name is None or name == "":
            return names[0]
        if name not in names:
            raise ApiError(
                404, f"the model {name!r} does not exist; this server serves {names}", "not_found_error", "model"
            )
        return name

    def token_text(self) -> TokenText:
        if self._token_text is None:
            self._token_text = TokenText(self.engine.tokenizer)
        return self._token_text

    def models(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "inferlab",
                    "root": engine.model_name,
                    "parent": None,
                    "max_model_len": engine.max_model_len,
                }
                for name in self.model_names()
            ],
        }

    # ------------------------------------------------------------------ tokenizer routes
    def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        engine = self.engine
        self.check_model(req.model)
        tok = engine.tokenizer
        if req.messages is not None:
            ids = self._chat_prompt(tok, req.messages, req.add_generation_prompt)
        elif req.prompt is not None:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise bad_request("send a 'prompt' (text) or 'messages' (chat) to tokenize", param="prompt")
        out: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": list(ids)}
        if req.return_token_strs:
            out["token_strs"] = list(tok.convert_ids_to_tokens(ids))
        return out

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's GET /tokenizer_info: the tokenizer's configuration (bos/eos/pad tokens as text,
        tokenizer_class, chat_template, ...), what lm-eval's remote tokenizer reads. Its
        model_max_length is this server's context window, not the tokenizer file's guess."""
        engine = self.engine
        tok = engine.tokenizer
        if tok is None:
            raise ApiError(404, "this model has no tokenizer", "not_found_error")
        info = dict(tok.info()) if hasattr(tok, "info") else {"tokenizer_class": type(tok).__name__}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template"):
            info.setdefault(key, None)
        info["model_max_length"] = engine.max_model_len
        return info

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        engine = self.engine
        self.check_model(req.model)
        try:
            text = engine.tokenizer.decode(req.tokens, skip_special_tokens=False)
        except Exception as e:  # noqa: BLE001 - out-of-range ids and the like
            raise bad_request(f"cannot decode these tokens: {e}", param="tokens") from None
        return {"prompt": text}

    def sampling_params(self, req: ChatCompletionRequest | CompletionRequest) -> SamplingParams:
        """The request's sampling parameters over the engine's defaults (the one place both routes
        get them), its token ids checked against the vocabulary: 400 naming the field."""
        engine = self.engine
        params = req.to_sampling_params(sampling_defaults(engine))
        vocab = getattr(engine, "vocab_size", None)
        if vocab is not None:
            try:
                params.check_vocab(vocab)
            except ValueError as e:
                raise bad_request(str(e), param=str(e).split(" ", 1)[0]) from None
        return params

    @staticmethod
    def _decode_prompt(tokenizer: Any, ids: list[int]) -> str:
        try:
            return tokenizer.decode(ids, skip_special_tokens=False)
        except Exception as e:  # noqa: BLE001 - out-of-range ids: the engine names them
            raise bad_request(f"cannot decode the prompt's token ids: {e}", param="prompt") from None

    @staticmethod
    def _chat_prompt(
        tokenizer: Any, messages: list, add_generation_prompt: bool = True, tools: ToolRequest | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        plain = [message_for_template(m.plain()) for m in messages]
        kwargs: dict[str, Any] = {"template_kwargs": dict(template_kwargs)} if template_kwargs else {}
        if tools is not None and tools.rendered:
            if template_renders_tools(getattr(tokenizer, "chat_template", None)):
                kwargs.setdefault("template_kwargs", {})["tools"] = tools.tools
            elif plain[0]["role"] == "system":  # a template without tools: they go in the system message
                plain[0] = {**plain[0], "content": plain[0]["content"] + "\n\n" + tools_system_prompt(tools.tools)}
            else:
                plain.insert(0, {"role": "system", "content": tools_system_prompt(tools.tools)})
        try:
            return list(tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt, **kwargs))
        except ValueError as e:
            raise bad_request(str(e), param="messages") from None

    # ------------------------------------------------------------------ generation routes
    async def chat(self, req: ChatCompletionRequest, raw: Request, arrival: float, tenant: Tenant) -> Response:
        engine = self.engine
        model = self.check_model(req.model)
        tools = tool_request(req.tools, req.tool_choice, req.parallel_tool_calls)
        prompt_ids = self._chat_prompt(engine.tokenizer, req.messages, req.add_generation_prompt, tools,
                                       req.chat_template_kwargs)
        params = self.sampling_params(req)
        tool_output = None
        if tools is not None and tools.rendered:
            forced = tools.constraint()
            if forced is not None:
                if params.structured_outputs is not None:
                    raise bad_request(f"tool_choice {tools.choice!r} forces the output, and "
                                      f"{params.structured_outputs.source} constrains it too: send one", param="tool_choice")
                params = dataclasses.replace(params, structured_outputs=forced)
            parser = choose_parser(self.tool_call_parser, getattr(engine.tokenizer, "chat_template", None))
            tool_output = ToolOutput(tools, parser)
        ctx = self._context("chat", "chatcmpl", model, params, req, params.logprobs is not None, tools=tool_output,
                            reasoning=self.reasoning_parser is not None)
        log_text = req.messages[-1].plain()["content"] if self.log_prompts else None
        return await self._serve(ctx, [prompt_ids], params, req, raw, arrival, "messages", log_text, tenant)

    async def completion(self, req: CompletionRequest, raw: Request, arrival: float, tenant: Tenant) -> Response:
        engine = self.engine
        model = self.check_model(req.model)
        prompts: list[list[int]] = []
        texts: list[str | None] = []
        for p in req.prompts():
            if isinstance(p, str):
                prompts.append(list(engine.tokenizer.encode(p, add_special_tokens=req.add_special_tokens)))
                texts.append(p)
            else:
                prompts.append(p)
                texts.append(None)
        params = self.sampling_params(req)
        echo_prompts = None
        if req.echo:  # the prompt as sent; token ids as their text (special tokens spelled out)
            echo_prompts = [
                (t if t is not None else self._decode_prompt(engine.tokenizer, ids), ids) for t, ids in zip(texts, prompts)
            ]
        need_text = params.logprobs is not None or req.prompt_logprobs is not None
        ctx = self._context("completion", "cmpl", model, params, req, need_text, echo_prompts=echo_prompts,
                            echo_only=req.echo_only, logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs)
        log_text = None
        if self.log_prompts:
            log_text = req.prompt if isinstance(req.prompt, str) else str(req.prompt)[:2000]
        return await self._serve(ctx, prompts, params, req, raw, arrival, "prompt", log_text, tenant)

    def _context(self, kind: str, id_prefix: str, model: str, params: SamplingParams,
                 req: ChatCompletionRequest | CompletionRequest, need_text: bool, **route: Any) -> ResponseContext:
        """What the response is built from: the fields both routes share, then the route's own."""
        return ResponseContext(kind=kind, response_id=f"{id_prefix}-{uuid.uuid4().hex}", created=int(time.time()),
                               model=model, n=params.n, include_usage=req.include_usage,
                               continuous_usage=req.continuous_usage, want_logprobs=params.logprobs is not None,
                               token_text=self.token_text() if need_text else None, **route)  # fmt: skip

    async def _serve(
        self,
        ctx: ResponseContext,
        prompts: list[list[int]],
        params: SamplingParams,
        req: ChatCompletionRequest | CompletionRequest,
        raw: Request,
        arrival: float,
        prompt_param: str,
        log_text: str | None,
        tenant: Tenant,
    ) -> Response:
        params = self._apply_tenant_caps(tenant, prompts, params, req, prompt_param)
        if params.structured_outputs is not None:
            await self._compile_grammar(params)
        estimate = sum(map(len, prompts)) + len(prompts) * params.n * (params.max_tokens or 0)
        lease = self._admit(tenant, estimate, ctx, arrival, log_text)

        ended = False
        rids = [ctx.response_id] if len(prompts) == 1 else [f"{ctx.response_id}-{i}" for i in range(len(prompts))]

        def done(status: str, finals: list[RequestOutput | None], outcome: str | None = None) -> None:
            nonlocal ended
            if not ended:
                ended = True
                self._complete_traces(rids, ctx.first_output_time)
                self._end(ctx, tenant, lease, status, finals, arrival, log_text, outcome)

        ctx.on_done = lambda status, finals: done(status, finals, _stream_outcome(status))
        timeout = effective_timeout(self.request_timeout, req.timeout)
        options = RequestOptions(arrival_time=arrival, cache_salt=tenant.request_salt(req.cache_salt),
                                 use_prefix_cache=req.cache_prompt)
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                params_i = dataclasses.replace(params) if i else params
                streams.append(await self.llm.add_request(rids[i], prompt, params_i, options, timeout=timeout))
        except BaseException as e:
            for s in streams:
                s.abort()
            if isinstance(e, Exception):
                err = to_api_error(e, prompt_param)
                done(f"rejected {err.status}: {err.message}", [])
                raise err from None
            done("cancelled", [])
            raise
        if req.stream:

            def never_streamed() -> None:  # the client left before the first chunk was asked for
                for s in streams:
                    s.abort()
                done("disconnected", [], "disconnected")

            return ClosingStream(sse_stream(ctx, streams), never_streamed)
        finals: list[RequestOutput | None] = [None] * len(streams)
        status = "disconnected"
        try:
            finals, logprobs = await self._collect(ctx, streams, raw)
            body = response_dict(ctx, finals, logprobs)
            status = "ok"
            return JSONResponse(body)
        except ClientGone:
            return Response(status_code=499)
        except Exception as e:
            err = to_api_error(e, prompt_param)
            status = f"error {err.status}: {err.message}"
            raise err from None
        finally:
            for s in streams:
                s.abort()
            done(status, finals)

    async def _compile_grammar(self, params: SamplingParams) -> None:
        """Compile the request's constraint on a worker thread, before the engine sees it: a new
        schema costs milliseconds that no engine step waits for, and an invalid one is a 400
        naming the problem. The engine then finds it in its cache."""
        so = params.structured_outputs
        assert so is not None
        compile_grammar = getattr(self.engine, "compile_grammar", None)
        if compile_grammar is None:
            raise bad_request(f"{so.source} is not supported by this engine", param=so.source)
        try:
            await asyncio.to_thread(compile_grammar, so)
        except ValueError as e:
            raise bad_request(str(e), param=so.source) from None

    async def _collect(
        self, ctx: ResponseContext, streams: list[RequestStream], raw: Request
    ) -> tuple[list[RequestOutput], list[list[list[Any]]]]:
        """Run the requests to the end; abort them if the client goes away first."""
        finals: list[RequestOutput | None] = [None] * len(streams)
        logprobs: list[list[list[Any]]] = [[[] for _ in range(ctx.n)] for _ in streams]

        async def drain() -> None:
            async for p, out in merge_streams(streams):
                if ctx.first_output_time is None:
                    ctx.first_output_time = time.monotonic()
                finals[p] = out
                if ctx.want_logprobs:
                    for c in out.outputs:
                        if c.logprobs_delta:
                            logprobs[p][c.index].extend(c.logprobs_delta)

        await unless_client_gone(raw, drain())
        return finals, logprobs  # type: ignore[return-value]

    def _apply_tenant_caps(
        self,
        tenant: Tenant,
        prompts: list[list[int]],
        params: SamplingParams,
        req: ChatCompletionRequest | CompletionRequest,
        prompt_param: str,
    ) -> SamplingParams:
        """400 beyond the tenant's prompt or completion cap; its max_tokens when none is asked."""
        lim = tenant.limits
        if lim.max_prompt_tokens is not None:
            longest = max(map(len, prompts))
            if longest > lim.max_prompt_tokens:
                raise bad_request(
                    f"the prompt has {longest} tokens; this API key allows at most {lim.max_prompt_tokens}",
                    param=prompt_param,
                )
        if lim.max_tokens is not None:
            if params.max_tokens is None:
                try:
                    return dataclasses.replace(params, max_tokens=lim.max_tokens)
                except ValueError as e:  # e.g. min_tokens above the tenant's cap
                    raise bad_request(str(e), param=str(e).split(" ", 1)[0]) from None
            if params.max_tokens > lim.max_tokens:
                field = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
                raise bad_request(
                    f"{field} is too large: {params.max_tokens}; this API key allows at most {lim.max_tokens}",
                    param=field,
                )
        return params

    def _complete_traces(self, request_ids: list[str], first_output_time: float | None) -> None:
        """The response has ended: the engine's traces of its requests get their last span."""
        traces = getattr(self.llm.engine, "traces", None)
        if traces is not None:
            now = time.monotonic()
            for rid in request_ids:
                traces.complete(rid, now, first_output_time)

    def _admit(self, tenant: Tenant, estimate: int, ctx: ResponseContext, arrival: float, log_text: str | None) -> Lease | None:
        if self.gate is None:
            return None
        try:
            return self.gate.admit(tenant, estimate)
        except ApiError as err:
            self._log(ctx, tenant, f"rejected {err.status}: {err.message}", [], arrival, log_text)
            raise

    def _end(self, ctx: ResponseContext, tenant: Tenant, lease: Lease | None, status: str,
             finals: list[RequestOutput | None], arrival: float, log_text: str | None, outcome: str | None) -> None:
        """Once per admitted request: its log line, its tenant's tokens, its lease back; a
        stream's outcome (a plain response's is counted by the route, from its status)."""
        n_in, n_out = _token_counts(finals)
        if lease is not None:
            lease.release(n_in + n_out)
        if self.tenant_metrics is not None:
            self.tenant_metrics.tokens(tenant.name, n_in, n_out)
            if outcome is not None:
                self.tenant_metrics.outcome(tenant.name, outcome)
        self._log(ctx, tenant, status, finals, arrival, log_text)

    def _log(self, ctx: ResponseContext, tenant: Tenant, status: str, finals: list[RequestOutput | None],
             arrival: float, log_text: str | None) -> None:
        """One line per request; the prompt text only with --log-prompts."""
        done = [o for o in finals if o is not None]
        n_in, n_out = _token_counts(done)
        cached = sum(o.metrics.num_cached_tokens for o in done)
        ttfts = [o.metrics.ttft_ms for o in done if o.metrics.first_token_time is not None]
        ttft = f"{min(ttfts):.1f}" if ttfts else "-"
        total_ms = (time.monotonic() - arrival) * 1000.0
        prompt = f" prompt={log_text!r}" if log_text is not None else ""
        logger.info("%s %s tenant=%s status=%s prompt_tokens=%d cached_tokens=%d completion_tokens=%d ttft_ms=%s "
                    "total_ms=%.1f%s", ctx.response_id, ctx.kind, tenant.name, status, n_in, cached, n_out, ttft,
                    total_ms, prompt)  # fmt: skip


def sampling_defaults(engine: Any) -> SamplingDefaults:
    """The engine's resolved defaults (an engine without them: OpenAI's neutral values)."""
    return getattr(engine, "sampling_defaults", None) or SamplingDefaults()


def _token_counts(finals: list[RequestOutput | None]) -> tuple[int, int]:
    """(prompt tokens, generated tokens) of the outputs that came back."""
    done = [o for o in finals if o is not None]
    return sum(len(o.prompt_token_ids) for o in done), sum(len(c.token_ids) for o in done for c in o.outputs)


def _stream_outcome(status: str) -> str:
    """The outcome label of a stream from its status word (see `sse_stream`)."""
    return status if status in ("ok", "disconnected") else "error"

