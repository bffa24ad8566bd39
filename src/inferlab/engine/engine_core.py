"""`RequestBook`: what every engine does with its requests outside the forward pass.

`LLMEngine` and the simulated replica (`server/sim_engine.py`, which must stay torch-free) both
keep a scheduler, an output processor and the outputs made between steps (aborts); how a
request is checked, split into its n sequences and queued, how a step's results reach the
requests, how one is aborted, whether work is left, the stats and new ids are the same for
both, so they are written once here. The engine class sets the attributes declared below.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from inferlab.config import CacheConfig, SchedulerConfig
from inferlab.engine.detokenizer import IncrementalDetokenizer
from inferlab.engine.errors import ContextLengthError
from inferlab.engine.kv_events import KVEventLog
from inferlab.engine.output_processor import OutputProcessor
from inferlab.engine.outputs import ModelRunnerOutput, SchedulerOutput, SchedulerStats
from inferlab.engine.request import (
    Request,
    RequestOptions,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    StructuredOutputsParams,
)
from inferlab.engine.scheduler import Scheduler
from inferlab.engine.tracing import TraceRecorder

logger = logging.getLogger(__name__)


def resolve_max_model_len(asked: int | None, model_len: int, pool_tokens: int) -> int:
    """The context window, logged: what the user asked (else the model's context length), no more
    than the model was trained for and than the KV pool holds for one request (else a lone long
    request would preempt itself forever). vLLM and llama-server default to the model's too."""
    want = model_len if asked is None else asked
    max_len = min(want, model_len, pool_tokens)
    why = "the model's context length" if asked is None else "asked"
    if max_len < want:
        limit = "the model's context length" if max_len == model_len else f"what the KV pool holds ({pool_tokens} tokens)"
        logger.info("max_model_len %d (%s %d, capped by %s)", max_len, why, want, limit)
    else:
        logger.info("max_model_len %d (%s; the KV pool holds %d tokens)", max_len, why, pool_tokens)
    return max_len


class RequestBook:
    scheduler: Scheduler
    scheduler_config: SchedulerConfig  # max_model_len resolved
    cache_config: CacheConfig
    output_processor: OutputProcessor
    tokenizer: Any  # inferlab.tokenizer.Tokenizer, or None (prompts must be token ids)
    eos_token_ids: tuple[int, ...]
    traces: TraceRecorder
    _pending: list[RequestOutput]  # outputs produced outside step() (aborts), returned by the next step
    _ids: itertools.count
    clock: Callable[[], float] = staticmethod(time.monotonic)

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def max_model_len(self) -> int:
        assert self.scheduler_config.max_model_len is not None  # resolved when the engine was built
        return self.scheduler_config.max_model_len

    @property
    def max_num_seqs(self) -> int:
        """Requests that can run at once (AsyncLLM's admission counts waiting beyond these)."""
        return self.scheduler_config.max_num_seqs

    def enable_kv_events(self, capacity: int = 8192) -> KVEventLog:
        """The prefix cache's changes from now on, as a KV event log (block_pool.enable_events)."""
        return self.scheduler.kv_cache_manager.block_pool.enable_events(capacity, self.cache_config.block_size)

    def _make_detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, stop=params.stop,
                                      include_stop_str_in_output=params.include_stop_str_in_output,
                                      skip_special_tokens=params.skip_special_tokens)  # fmt: skip

    # ------------------------------------------------------------------ requests
    def encode_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        vocab = self.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return None, ids

    def check_length(self, n_prompt: int, params: SamplingParams) -> None:
        """Raises ContextLengthError when prompt + max_tokens exceed the context window."""
        if n_prompt == 0:
            raise ValueError("the prompt is empty")
        n_ctx = self.max_model_len
        if n_prompt >= n_ctx or (params.max_tokens is not None and n_prompt + params.max_tokens > n_ctx):
            raise ContextLengthError(n_prompt, params.max_tokens, n_ctx)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        options: RequestOptions | None = None,
    ) -> None:
        """Validate and queue a request; raises ValueError (ContextLengthError) on bad input.

        A request with `prompt_logprobs` does not look the prefix cache up (its blocks still
        enter the cache for others): prompt logprobs come from the prefill's own logits, and
        cached positions are never computed, so a hit would leave them out. Recomputing the
        prompt is the simple correct choice, as vLLM makes it; only requests asking pay.
        """
        options = (options or RequestOptions()).arrived(self.clock())
        arrival = options.arrival_time
        assert arrival is not None  # set by arrived()
        if request_id in self.output_processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.encode_prompt(prompt)
        params.check_vocab(self.vocab_size)
        self.check_length(len(ids), params)
        so = params.structured_outputs
        grammar = self._grammar_factory(so) if so is not None else None
        n = params.n
        child_ids = [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]
        self.output_processor.add_request(request_id, child_ids, text, ids, params, arrival)
        self.traces.start(request_id, arrival)
        for i, cid in enumerate(child_ids):
            child_params = params
            if n > 1:
                # Each child is its own sequence; seeded requests get distinct, reproducible seeds.
                child_params = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            self.scheduler.add_request(
                Request(
                    request_id=cid,
                    prompt_token_ids=ids,
                    sampling_params=child_params,
                    eos_token_ids=() if params.ignore_eos else self.eos_token_ids,
                    arrival_time=arrival,
                    cache_salt=options.cache_salt,
                    use_prefix_cache=options.use_prefix_cache and params.prompt_logprobs is None,
                    max_model_len=self.max_model_len,
                    grammar=grammar() if grammar is not None else None,
                )
            )

    def _grammar_factory(self, so: StructuredOutputsParams) -> Callable[[], Any]:
        """What makes each sequence's matcher for `so` (checked before the request is queued)."""
        raise ValueError(f"{so.source} is not supported by this engine")

    # ------------------------------------------------------------------ the step
    def _end_step(self, so: SchedulerOutput, ro: ModelRunnerOutput, outputs: list[RequestOutput],
                  now: float | None = None) -> list[RequestOutput]:  # fmt: skip
        """The step's results into its requests (tokens, stops), and their outputs after
        `outputs` (`now`: their time; default the clock's, after the update)."""
        core = self.scheduler.update_from_output(so, ro)
        step_outputs, stopped = self.output_processor.process(core, self.clock() if now is None else now)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        outputs.extend(step_outputs)
        return self._trace_finished(outputs)

    def _trace_finished(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for out in outputs:
            if out.finished:
                self.traces.finish(out)
        return outputs

    def abort_request(self, request_ids: list[str] | str, reason: str = "abort", error: str | None = None) -> None:
        """Finish requests now (client gone, deadline): blocks freed; a final output with
        finish_reason `reason` comes out of the next step()."""
        status = RequestStatus.FINISHED_ERROR if reason == "error" else RequestStatus.FINISHED_ABORTED
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.scheduler.finish_requests(self.output_processor.child_ids(rid), status)
            out = self.output_processor.abort(rid, self.clock(), reason, error)
            if out is not None:
                self._pending.append(out)

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or self.scheduler.has_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"
