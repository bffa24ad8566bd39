"""The plain dataclasses where the scheduler and the model runner meet.

    Scheduler.schedule() ──► SchedulerOutput ──► ModelRunner.execute()
    Scheduler.update()   ◄── ModelRunnerOutput ◄──┘
    Scheduler.update()   ──► list[EngineCoreOutput] ──► output processor (detokenize, stop strings)

Scheduler and runner live in one process, so lists here may be references to the
request's own lists: the runner only reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inferlab.engine.request import SamplingParams, TokenLogprobs


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute `token_ids` at positions start_pos, start_pos+1, ..."""

    request_id: str
    token_ids: list[int]  # the tokens computed this step (a prompt chunk, or the last sampled token)
    start_pos: int  # num_computed_tokens before this step = position of token_ids[0]
    block_ids: list[int]  # the request's whole block table (read only); slot of position p: block_ids[p // B] * B + p % B
    sample: bool  # this chunk reaches the end of the known tokens: sample one new token from its last position
    sampling_params: SamplingParams
    prompt_token_ids: list[int]  # read only: repetition penalty
    output_token_ids: list[int]  # read only: penalties, min_tokens, the seeded generator's offset
    eos_token_ids: tuple[int, ...] = ()  # masked out while fewer than min_tokens are out
    # Speculative decoding: the last num_draft_tokens of token_ids are drafts (after the last
    # sampled token): the runner takes logits at every position and verifies them.
    num_draft_tokens: int = 0
    grammar: Any = None  # the request's grammar matcher (structured outputs): the sampler masks with it
    # A sampler row of a request with drafts (spec_decode.position_rows): the target after this
    # many of its drafts, so its grammar mask is the matcher's state after them.
    draft_depth: int = 0

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens :] if self.num_draft_tokens else []


@dataclass
class SchedulerOutput:
    """One engine step: which requests compute how many tokens. No tensors."""

    scheduled: list[ScheduledRequest]  # order = order of tokens in the flat batch
    num_scheduled_tokens: int  # sum of len(s.token_ids)
    # Requests that left since the last step (finished, aborted or preempted): the runner drops their state.
    finished_request_ids: set[str] = field(default_factory=set)
    preempted_request_ids: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def decode_only(self) -> bool:
        """Every request computes one token and its drafts: no prompt tokens in this step (the
        speculation rule's step costs are fitted on such steps, and drafts are verified only there)."""
        return all(len(s.token_ids) == 1 + s.num_draft_tokens for s in self.scheduled)


@dataclass
class ModelRunnerOutput:
    """What one forward pass produced: one sampled token per request with `sample=True`."""

    request_ids: list[str]  # requests that sampled, in the order of SchedulerOutput.scheduled
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None  # parallel to request_ids when any request asked
    step_time: float = 0.0  # seconds spent in the forward pass and sampling
    # Requests with prompt_logprobs whose chunk this step predicted prompt tokens: request id →
    # (position of the first entry, >= 1; one (prompt token, top k) entry per position after it).
    # A chunk recomputed after preemption reports its positions again: the reader keeps the first.
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None
    # Requests with prompt_logprobs=-1: request id → (position of the first row, float32 numpy
    # array [rows, vocab] of whole log-softmax rows, parallel to that request's entries above).
    prompt_logprob_rows: dict[str, tuple[int, Any]] | None = None
    # Requests that verified drafts: request id → every token the step yields (the accepted
    # drafts, then the target's token after them; sampled_token_ids holds the first), and their
    # logprobs when asked.
    spec_token_ids: dict[str, list[int]] | None = None
    spec_logprobs: dict[str, list[TokenLogprobs | None]] | None = None
    # When asked (a draft model's runner): the distribution each sampled row was drawn from,
    # [len(request_ids), vocab] in request_ids' order (Sampler.probs).
    probs: Any = None


@dataclass
class EngineCoreOutput:
    """What the scheduler reports per request after a step (new tokens, finish)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # drafts this step verified for the request
    num_accepted_tokens: int = 0  # of them, accepted
    # A "stop" whose last token is text, not an EOS or stop token (a grammar completed by it):
    # the detokenizer keeps it.
    stop_token_is_text: bool = False


@dataclass
class SchedulerStats:
    """A snapshot for /metrics and logs."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1, used blocks / all blocks (cached-but-free blocks count as free)
    num_blocks: int = 0
    block_size: int = 16
    prefix_cache_queries: int = 0  # tokens looked up, cumulative
    prefix_cache_hits: int = 0  # tokens found, cumulative
    num_preemptions: int = 0  # cumulative
    # Speculative decoding, cumulative (vllm:spec_decode_*); all 0 without it.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    spec_drafted_per_pos: tuple[int, ...] = ()  # verifications with a draft at each position
