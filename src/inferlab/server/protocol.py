"""The OpenAI-compatible request bodies (pydantic) and their translation to `SamplingParams`.

Unknown fields are ignored, not rejected: benchmark clients send extras (vLLM's and llama.cpp's
own fields, `user`, ...). But a field we know and cannot honour (`best_of` > n, `suffix`,
`bad_words`, llama.cpp's other samplers, ...) is a 400
naming it when it carries anything but its neutral value: ignoring it would answer a different
question without saying so (lm-eval scored chance while `echo` was ignored). Absent sampling
fields get the engine's sampling defaults (engine/generation_config.py: the model's own, else
llama.cpp's for a GGUF, else OpenAI's), applied here, in `to_sampling_params`, for every route.
Range checks live in `SamplingParams`; its `ValueError` names the field, which becomes the
error's `param`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from inferlab.engine.generation_config import SamplingDefaults
from inferlab.engine.request import SamplingParams, StructuredOutputsParams


class ApiError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code", ...extra}}`; `code`
    is the HTTP status unless given (429s carry OpenAI's "rate_limit_exceeded")."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        *,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ):
        super().__init__(message)
        self.code = status if code is None else code  # the HTTP status, or OpenAI's string code
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.headers = headers
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        err: dict[str, Any] = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        err.update(self.extra)
        return {"error": err}


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _unset(value: Any, body: dict[str, Any]) -> bool:
    return value is None


def _empty(value: Any, body: dict[str, Any]) -> bool:
    return value is None or value is False or value == "" or value == [] or value == {}


def _is(*neutral: Any) -> Callable[[Any, dict[str, Any]], bool]:
    """Neutral when absent or one of `neutral` (llama.cpp's samplers at their 'off' values)."""
    return lambda value, body: value is None or any(value == n and type(value) is not bool for n in neutral)


def _tool_choice(value: Any, body: dict[str, Any]) -> bool:
    return value is None or (value in ("none", "auto") and not body.get("tools"))


def _best_of_n(value: Any, body: dict[str, Any]) -> bool:
    return value is None or value == 1 or value == body.get("n", 1)  # best of n from n: every one


# Fields both routes know but do not implement → "is this value neutral?" (then it is accepted).
_UNSUPPORTED: dict[str, Callable[[Any, dict[str, Any]], bool]] = {
    "functions": _empty,
    "function_call": _unset,
    "bad_words": _empty,  # vLLM's
    "priority": _is(0),  # vLLM's
    "chat_template": _unset,
    "reasoning_effort": _unset,
    "prediction": _unset,
    "typical_p": _is(1),  # llama.cpp's samplers, off at these values
    "mirostat": _is(0),
    "tfs_z": _is(1),
    "xtc_probability": _is(0),
    "dry_multiplier": _is(0),
    "dynatemp_range": _is(0),
    "top_n_sigma": _is(-1),
    "use_beam_search": _empty,
    "logits_processors": _empty,
    "return_tokens_as_token_ids": _empty,
    "truncate_prompt_tokens": _unset,
}


_STRUCTURED_KEYS = frozenset({"json", "json_object", "regex", "choice", "grammar"})


def _schema_text(schema: Any, source: str) -> str:
    """A JSON schema as canonical text (the compiled-grammar cache's key): sent as an object,
    or as a string holding one (vLLM's guided_json takes both)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise bad_request(f"{source}: the JSON schema is not valid JSON: {e}", param=source) from None
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{source}: a JSON schema must be an object, got {type(schema).__name__}", param=source)
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


def _structured(source: str, **kwargs: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(source=source, **kwargs)
    except ValueError as e:
        raise bad_request(str(e), param=source) from None


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk


class _GenerationRequest(_Lenient):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=128)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    cache_prompt: bool = True  # llama.cpp's: False = reuse no cached prefix for this request
    timeout: float | None = Field(default=None, gt=0)  # per-request deadline in seconds (the server caps it)
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (a string) -> bias in [-100, 100]
    allowed_token_ids: list[StrictInt] | None = None  # vLLM's
    # Structured outputs (see structured_outputs_params): OpenAI's, vLLM's (and its older
    # guided_* fields), llama.cpp's.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    json_schema: dict[str, Any] | None = None
    grammar: StrictStr | None = None

    # This route's own known-but-unimplemented fields, on top of _UNSUPPORTED.
    _unsupported: ClassVar[dict[str, Callable[[Any, dict[str, Any]], bool]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        """A known field we cannot honour, set to anything but its neutral value → 400 naming it."""
        if isinstance(data, dict):
            for name, neutral in (_UNSUPPORTED | cls._unsupported).items():
                if name in data and not neutral(data[name], data):
                    raise bad_request(f"{name} is not supported by this server (got {data[name]!r})", param=name)
        return data

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _logprobs(self) -> int | None:
        return None

    def _prompt_logprobs(self) -> int | None:
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage and self.stream_options.continuous_usage_stats)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one text constraint the request asks for, from whichever field it used; two at
        once is a 400 naming the second (which one would win is not ours to guess)."""
        found: list[StructuredOutputsParams] = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type", "text")
            if kind == "json_object":
                found.append(StructuredOutputsParams(json_object=True, source="response_format"))
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
                    raise bad_request("response_format.json_schema must be an object with a 'schema' (a JSON schema object)",
                                      param="response_format")
                found.append(StructuredOutputsParams(json=_schema_text(spec["schema"], "response_format"),
                                                     source="response_format"))
            elif kind != "text":
                raise bad_request(f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
                                  param="response_format")
        so = self.structured_outputs
        if so:
            unknown = [k for k, v in so.items() if k not in _STRUCTURED_KEYS and v not in (None, False, "", [], {})]
            if unknown:
                raise bad_request(f"structured_outputs.{unknown[0]} is not supported (json, json_object, regex, "
                                  "choice, grammar)", param="structured_outputs")
            kwargs: dict[str, Any] = {}
            for key in ("json", "regex", "choice", "grammar", "json_object"):
                value = so.get(key)
                if value is None or value is False:
                    continue
                if key == "json":
                    value = _schema_text(value, "structured_outputs")
                elif key == "choice":
                    if not isinstance(value, list):
                        raise bad_request("structured_outputs.choice must be a list of strings", param="structured_outputs")
                    value = tuple(value)
                elif key == "json_object":
                    value = bool(value)
                elif not isinstance(value, str):
                    raise bad_request(f"structured_outputs.{key} must be a string", param="structured_outputs")
                kwargs[key] = value
            found.append(_structured("structured_outputs", **kwargs))
        for name, key, value in (("guided_json", "json", self.guided_json), ("guided_regex", "regex", self.guided_regex),
                                 ("guided_choice", "choice", self.guided_choice),
                                 ("guided_grammar", "grammar", self.guided_grammar),
                                 ("json_schema", "json", self.json_schema or None),
                                 ("grammar", "grammar", self.grammar or None)):  # fmt: skip
            if value is not None:
                if key == "json":
                    value = _schema_text(value, name)
                elif key == "choice":
                    value = tuple(value)  # type: ignore[arg-type]
                found.append(_structured(name, **{key: value}))
        if len(found) > 1:
            raise bad_request(f"{found[1].source} and {found[0].source} both constrain the output: send one",
                              param=found[1].source)
        return found[0] if found else None

    def to_sampling_params(self, defaults: SamplingDefaults | None = None) -> SamplingParams:
        """The request's values, else `defaults` (the engine's; OpenAI's neutral ones without);
        a bad value raises ApiError(400) naming the field."""
        d = defaults or SamplingDefaults()

        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        try:
            return SamplingParams(
                n=self.n,
                temperature=pick(self.temperature, d.temperature),
                top_p=pick(self.top_p, d.top_p),
                top_k=pick(self.top_k, d.top_k),
                min_p=pick(self.min_p, d.min_p),
                seed=self.seed,
                presence_penalty=pick(self.presence_penalty, 0.0),
                frequency_penalty=pick(self.frequency_penalty, 0.0),
                repetition_penalty=pick(self.repetition_penalty, d.repetition_penalty),
                max_tokens=self._max_tokens(),
                min_tokens=self.min_tokens,
                stop=pick(self.stop, []),
                stop_token_ids=pick(self.stop_token_ids, []),
                ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logprobs=self._logprobs(),
                prompt_logprobs=self._prompt_logprobs(),
                skip_special_tokens=self.skip_special_tokens,
                logit_bias=dict(self.logit_bias) if self.logit_bias else None,  # type: ignore[arg-type]
                allowed_token_ids=self.allowed_token_ids,
                structured_outputs=self.structured_outputs_params(),
            )
        except ValueError as e:
            raise bad_request(str(e), param=str(e).split(" ", 1)[0]) from e


class TextPart(_Lenient):
    type: str = "text"
    text: str | None = None


class ChatMessage(_Lenient):
    role: StrictStr
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool result's

    def plain(self) -> dict[str, Any]:
        """The message as the chat template wants it: role and one text string (and a tool
        turn's fields)."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"only text content is supported, got a content part of type {part.type!r}", param="messages"
                    )
                texts.append(part.text)
            content = "".join(texts)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


# What the server passes to the chat template itself (or transformers takes as its own options).
_TEMPLATE_OWN = frozenset({"messages", "tools", "documents", "add_generation_prompt", "tokenize", "chat_template",
                           "continue_final_message", "return_dict", "return_tensors", "padding", "truncation",
                           "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"})


class ChatCompletionRequest(_GenerationRequest):
    _unsupported = {"echo": _empty, "prompt_logprobs": _unset}

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the template (enable_thinking)

    @model_validator(mode="after")
    def _check_template_kwargs(self) -> ChatCompletionRequest:
        taken = sorted(set(self.chat_template_kwargs or {}) & _TEMPLATE_OWN)
        if taken:
            raise bad_request(f"chat_template_kwargs may not set {taken[0]!r} (the server sets it)",
                              param="chat_template_kwargs")
        return self

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
            return None
        return self.top_logprobs or 0


# A prompt: text, texts, token ids, or lists of token ids (StrictInt: "1" is text, not a token).
PromptInput = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(_GenerationRequest):
    """Legacy completions. `echo` puts the prompt before the completion (with `logprobs`, one
    entry per prompt token first, the first one null: OpenAI's shape, what lm-eval scores);
    `max_tokens: 0` with `echo` scores the prompt alone; `prompt_logprobs` is vLLM's."""

    _unsupported = {"suffix": _empty, "best_of": _best_of_n, "tools": _empty, "tool_choice": _tool_choice}

    prompt: PromptInput
    max_tokens: int | None = Field(default=None, ge=0)  # 0 only with echo
    logprobs: int | None = Field(default=None, ge=0, le=20)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    add_special_tokens: bool = True

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt scored, nothing generated (shown)."""
        return self.echo and self.max_tokens == 0

    def _max_tokens(self) -> int | None:
        if self.max_tokens == 0:
            if not self.echo:
                raise bad_request("max_tokens must be >= 1 unless echo is true", param="max_tokens")
            return 1  # as vLLM: the engine samples one token, which the response leaves out
        return self.max_tokens

    def _logprobs(self) -> int | None:
        return self.logprobs

    def _prompt_logprobs(self) -> int | None:
        """What the engine computes: vLLM's prompt_logprobs, and with echo the logprobs top k."""
        want = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(want) if want else None

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per engine request (a list of ints is one tokenized prompt)."""
        p = self.prompt
        if isinstance(p, str):
            out: list[str | list[int]] = [p]
        elif not p:
            raise bad_request("prompt must not be empty", param="prompt")
        elif isinstance(p[0], int):
            out = [list(p)]  # type: ignore[arg-type]
        else:
            out = list(p)  # type: ignore[arg-type]
        for item in out:
            if isinstance(item, list) and not item:
                raise bad_request("a token-id prompt must not be empty", param="prompt")
        return out


class TokenizeRequest(_Lenient):
    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[StrictInt]


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)

