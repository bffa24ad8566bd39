"""The request's data: what the user asked for (`SamplingParams`), the engine's state for it
(`Request`) and what comes back (`RequestOutput`).

Pure Python, no torch: the scheduler, the KV cache manager and the planner's simulator use it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the text (vLLM's `structured_outputs`): exactly one of a JSON schema (as
    JSON text), any JSON object, a regular expression, a choice of strings, or a grammar (Lark or
    llama.cpp's GBNF). Pure data; engine/structured_outputs.py compiles it, once per `key`."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    source: str = "structured_outputs"  # the request field it came from: errors name it

    def __post_init__(self) -> None:
        set_ = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            what = ", ".join(set_) if set_ else "none"
            raise ValueError(f"{self.source} must set exactly one of json, json_object, regex, choice, grammar (got {what})")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"{self.source}: choice must be a non-empty list of strings")

    @property
    def key(self) -> tuple[str, str]:
        """What a compiled grammar is cached by (the source field is not part of it)."""
        if self.json is not None:
            return ("json", self.json)
        if self.json_object:
            return ("json", '{"type": "object"}')
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", "\x00".join(self.choice))
        assert self.grammar is not None
        return ("grammar", self.grammar)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Invalid values raise `ValueError` naming the field."""

    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0  # in [0, 1]
    seed: int | None = None  # per-request generator: same tokens whatever else is in the batch
    presence_penalty: float = 0.0  # [-2, 2], OpenAI's
    frequency_penalty: float = 0.0  # [-2, 2], OpenAI's
    repetition_penalty: float = 1.0  # > 0, 1 = off; divides positive logits of seen tokens (prompt + output)
    max_tokens: int | None = 16  # None = up to the context window
    min_tokens: int = 0  # EOS and stop tokens are masked until this many tokens are out
    stop: list[str] = field(default_factory=list)  # stop strings, matched on decoded text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None = none; k >= 0 = the chosen token's logprob and the top k
    # None = none; k >= 0 = each prompt token's logprob and the top k at its position (vLLM's),
    # from the prefill's own logits. Such a request skips the prefix-cache lookup (see LLMEngine).
    # -1 = the prompt token's logprob (as 0) and the whole log-softmax row at every position, in
    # RequestOutput.prompt_logprob_rows (perplexity / KL divergence; offline only).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Added to the logits before penalties, temperature and truncation (OpenAI's logit_bias:
    # token id -> bias in [-100, 100]; -100 bans a token, +100 all but forces it).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: sample only among these tokens
    # The text must match this (JSON schema, regex, choice, grammar): a token mask per step.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {_token_id("logit_bias", t): _bias(b) for t, b in self.logit_bias.items()} or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [_token_id("allowed_token_ids", t) for t in self.allowed_token_ids]
        self._check()

    def _check(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature is None or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (off), -1 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and not -1 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20] or -1 (whole rows), got {self.prompt_logprobs!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")
        for t, b in (self.logit_bias or {}).items():
            if not -100.0 <= b <= 100.0:  # NaN fails too
                raise ValueError(f"logit_bias must map token ids to biases in [-100, 100], got {b!r} for token {t}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty (no token could be sampled)")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the model does not have are a ValueError naming the field (the engine and the
        server check before a request runs: the sampler indexes the logits with them)."""
        for name, ids in (("logit_bias", self.logit_bias or {}), ("allowed_token_ids", self.allowed_token_ids or [])):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} has token id {bad[0]}, outside the vocabulary (ids 0 to {vocab_size - 1})")

    @property
    def has_token_constraints(self) -> bool:
        """logit_bias or allowed_token_ids: the sampler's bias pass runs only for such rows."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _token_id(name: str, value: Any) -> int:
    """A token id as JSON gives it (OpenAI's logit_bias keys are strings) or as Python does."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must hold token ids (integers >= 0), got {value!r}")
    try:
        tid = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must hold token ids (integers >= 0), got {value!r}") from None
    if tid < 0 or (isinstance(value, float) and value != tid) or (isinstance(value, str) and not value.strip().isdigit()):
        raise ValueError(f"{name} must hold token ids (integers >= 0), got {value!r}")
    return tid


def _bias(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"logit_bias must map token ids to numbers in [-100, 100], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class RequestOptions:
    """How a request enters the engine, beside its prompt and sampling params: one type for
    `LLMEngine.add_request`, `AsyncLLM.add_request` and the tests' fake engine (they repeated
    these as keywords, and AsyncLLM carried them across threads as a dict)."""

    arrival_time: float | None = None  # time.monotonic() when it was received; None: when it is added
    cache_salt: str | None = None  # the prefix-cache namespace (a tenant's, then the request's); None: shared
    use_prefix_cache: bool = True  # look its prompt up in the prefix cache (its blocks enter the cache either way)

    def arrived(self, now: float) -> RequestOptions:
        """These options with `arrival_time` set (to `now` where it was None)."""
        return self if self.arrival_time is not None else replace(self, arrival_time=now)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; back in the waiting queue, recomputed when resumed
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context window
    FINISHED_ABORTED = "abort"  # cancelled by the client or a deadline
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason for a finished status, else None."""
        return self.value if self.finished else None


@dataclass
class Request:
    """The engine's state for one sequence. Tokens, not phases:

        all_token_ids:  | prompt ........................ | output ..... |
                        |<-- num_computed_tokens -->|<-- scheduled -->|
                        |<-- num_cached_tokens -->|  (prefix-cache hit at first schedule)

    A step computes tokens [num_computed_tokens, num_computed_tokens + n); when that reaches
    `num_tokens`, the step samples one new token. Prefill, chunked prefill, decode and
    recomputation after preemption are all this one rule.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None  # isolates prefix-cache entries (e.g. per tenant)
    use_prefix_cache: bool = True  # False: reuse no cached prefix (llama.cpp's cache_prompt=false)
    max_model_len: int | None = None  # the context window; checked by the scheduler

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit at the first schedule; None until then
    status: RequestStatus = RequestStatus.WAITING
    # Chained hashes of the full blocks of all_token_ids, filled by the KV cache manager.
    block_hashes: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # With structured outputs: this sequence's grammar matcher (engine/structured_outputs.py's
    # `Grammar`; duck-typed here: accept(token) -> bool, is_terminated() -> bool), advanced by
    # the scheduler with every token it appends; the sampler masks the logits with it.
    grammar: Any = None

    # Timings (time.monotonic()); None until they happen.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def end_token_ids(self) -> frozenset[int]:
        """The tokens that end its reply (once min_tokens are out): its stop_token_ids, and EOS
        unless ignore_eos."""
        params = self.sampling_params
        ends = frozenset(params.stop_token_ids)
        return ends if params.ignore_eos else ends | frozenset(self.eos_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def is_finished(self) -> bool:
        return self.status.finished


@dataclass
class Logprob:
    """One token's log-probability under the model (before temperature and penalties)."""

    token_id: int
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None  # the token's text; set on prompt logprobs (vLLM's field)


# Per generated token: the chosen token's Logprob and the top k alternatives (k = SamplingParams.logprobs).
TokenLogprobs = tuple[Logprob, list[Logprob]]

# Per prompt token, vLLM's shape: None for the first token (nothing predicts it), then
# {token_id: Logprob} with the prompt token first and the top k (SamplingParams.prompt_logprobs) after it.
PromptLogprobs = list[dict[int, Logprob] | None]


def _span_ms(start: float | None, end: float | None) -> float:
    """Milliseconds from `start` to `end`; 0 until both have happened."""
    return 0.0 if start is None or end is None else (end - start) * 1000.0


@dataclass
class RequestMetrics:
    """Where one request's time went, in llama.cpp's and vLLM's terms."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    # Speculative decoding: drafts verified for this request, and how many were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def queue_ms(self) -> float:
        """Arrival to first scheduled."""
        return _span_ms(self.arrival_time, self.first_scheduled_time)

    @property
    def prompt_ms(self) -> float:
        """First scheduled to first token: reading the prompt (prefill)."""
        return _span_ms(self.first_scheduled_time, self.first_token_time)

    @property
    def predicted_ms(self) -> float:
        """First token to last token: writing the answer (decode)."""
        return _span_ms(self.first_token_time, self.last_token_time)

    @property
    def ttft_ms(self) -> float:
        return _span_ms(self.arrival_time, self.first_token_time)

    def timings(self) -> dict[str, Any]:
        """llama.cpp's `timings` object plus `queue_ms` (and, with speculative decoding, its
        `draft_n` / `draft_n_accepted`).

        prompt_n counts the prompt tokens actually computed (cache hits excluded); decode
        rates count the tokens after the first, whose time `predicted_ms` measures.
        """
        prompt_n = max(self.num_prompt_tokens - self.num_cached_tokens, 0)
        predicted_n = self.num_generated_tokens
        pms, dms = self.prompt_ms, self.predicted_ms
        decode_tokens = max(predicted_n - 1, 0)
        out = {
            "cache_n": self.num_cached_tokens,
            "prompt_n": prompt_n,
            "prompt_ms": pms,
            "prompt_per_token_ms": pms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n * 1000.0 / pms if pms > 0 else 0.0,
            "predicted_n": predicted_n,
            "predicted_ms": dms,
            "predicted_per_token_ms": dms / decode_tokens if decode_tokens else 0.0,
            "predicted_per_second": decode_tokens * 1000.0 / dms if dms > 0 else 0.0,
            "queue_ms": self.queue_ms,
        }
        if self.num_draft_tokens:  # llama.cpp's names for its speculative decoding
            out["draft_n"] = self.num_draft_tokens
            out["draft_n_accepted"] = self.num_accepted_tokens
        return out


@dataclass
class CompletionOutput:
    """One of the n sequences of a request. `text`/`token_ids` are cumulative; the `*_delta`
    fields hold what is new since the previous RequestOutput (streaming)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    logprobs_delta: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What the engine reports for a request: after every step while streaming, once at the end offline."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # set when the request failed inside the engine
    # With SamplingParams.prompt_logprobs: one entry per prompt token so far (complete, one per
    # prompt token, by the time any sequence has a token); else None.
    prompt_logprobs: PromptLogprobs | None = None
    # With prompt_logprobs=-1, once the prompt is complete: a float32 numpy array
    # [num_prompt_tokens - 1, vocab], row i the log-softmax that predicted prompt token i + 1.
    prompt_logprob_rows: Any | None = None

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens
