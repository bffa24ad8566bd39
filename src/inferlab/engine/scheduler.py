"""Continuous batching: one token budget per step, chunked prefill, prefix cache, preemption, FCFS.

Tokens, not phases. Each request has `num_tokens` (prompt + output so far) and
`num_computed_tokens` (K/V already in its blocks). A step gives each chosen request a number
of new tokens; prefill, a prefill chunk, a decode and recomputation after preemption are all
the same rule:

    all_token_ids:  | p0 p1 p2 p3 p4 p5 p6 p7 p8 | o0 o1 |
                    |<- cached ->|<- computed -->|<- new (this step) ->|
                    0        num_cached   num_computed        num_computed + num_new
                                                              == num_tokens  → sample one token

    start_pos = num_computed_tokens;  tokens computed = token_slice(start_pos, start_pos + num_new)
    sample    = (start_pos + num_new == num_tokens)
    limits:     Σ num_new ≤ max_num_batched_tokens;  num_computed + num_new ≤ max_model_len

Speculative decoding is the same rule with k more tokens: a decode (num_computed ==
num_tokens - 1) may carry k drafts from the proposer, so num_new = 1 + k under the same budget,
trimmed to what the budget, max_tokens and the context window leave. The runner verifies them;
`update_from_output` appends the accepted ones and the token after them, then rolls back what
was rejected: num_computed_tokens counts accepted tokens only and the blocks past them are
freed. Blocks enter the prefix cache only when full of real tokens (never of drafts).

Invariants:
- a request is in exactly one of `waiting` (deque, FCFS, WAITING/PREEMPTED) and `running`
  (list, in admission order) until it finishes; then it is in neither and its blocks are freed;
- a waiting request holds no blocks and has num_computed_tokens == 0;
- `schedule()` advances num_computed_tokens at once: the runner computes what the output
  says, and `update_from_output()` only appends sampled tokens.

Pure Python, no torch, no wall clock except the injectable `clock` for timestamps, so the
planner's simulator can drive it step by step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from inferlab.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from inferlab.engine.block_pool import KVBlock
from inferlab.engine.kv_cache_manager import KVCacheManager
from inferlab.engine.ngram_proposer import NgramProposer
from inferlab.engine.outputs import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)
from inferlab.engine.request import Request, RequestStatus, TokenLogprobs
from inferlab.engine.spec_decode import Proposer, SpecDecodeStats, until_end
from inferlab.engine.spec_policy import PRIOR_ROW_COST, SpecPolicy
from inferlab.engine.suffix_proposer import SuffixProposer


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The torch-free proposers; a draft model's is the engine's to build (it runs a model)."""
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min)
    if config.method == "suffix":
        return SuffixProposer(config.num_speculative_tokens, config.suffix_decoding_max_tree_depth,
                              config.suffix_decoding_max_cached_requests, config.suffix_decoding_max_spec_factor,
                              config.suffix_decoding_min_token_prob)
    raise ValueError(f"speculative method {config.method!r} needs its proposer passed in (the engine builds it)")


class Scheduler:
    """FCFS continuous-batching scheduler over a paged KV cache of `num_blocks` blocks."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        clock: Callable[[], float] = time.monotonic,
        speculative_config: SpeculativeConfig | None = None,
        proposer: Proposer | None = None,
        step_cost: tuple[float, float] | None = None,
    ) -> None:
        """`step_cost`: (a, b) of the decode step's a + b·rows measured by the engine at start-up,
        for the speculation rule (engine/spec_policy.py); None: its prior."""
        if scheduler_config.max_model_len is None:
            raise ValueError("the scheduler needs a resolved max_model_len (LLMEngine sets it from the model)")
        self.config = scheduler_config
        self.cache_config = cache_config
        self.clock = clock
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests that left since the last schedule(): the runner drops their state.
        self.finished_request_ids: set[str] = set()
        self.num_preemptions = 0  # cumulative
        # The drafts' source: the engine passes a draft model's; n-gram and suffix are made here.
        self.proposer: Proposer | None = proposer
        if proposer is None and speculative_config is not None:
            self.proposer = make_proposer(speculative_config)
        # Whether drafts are expected to pay, per request and step (None: always K).
        self.policy: SpecPolicy | None = None
        if speculative_config is not None and speculative_config.adaptive:
            # A proposer that is not a model drafts for the price of a search: probe in shadow.
            a, b = step_cost or (None, None)
            ratio = b / a if a and b else PRIOR_ROW_COST  # start-up's b / a: the first model and its floor
            self.policy = SpecPolicy(speculative_config.num_speculative_tokens,
                                     shadow_probes=speculative_config.method != "draft_model",
                                     row_cost_ratio=ratio, base_cost=a, base_ratio=ratio)
        self.spec_stats = SpecDecodeStats()  # cumulative

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a request (FCFS). The engine validates token counts for its users; checked
        again here so that a caller that skips it (the simulator, a test) fails at once."""
        self._check_new(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_computed_request(self, request: Request, num_computed_tokens: int) -> bool:
        """Admit a request whose first `num_computed_tokens` tokens have K/V computed elsewhere
        and copied in: prefill/decode disaggregation, where a prefill worker ran the prompt and
        sampled its first token and the K/V arrived over a link. It joins `running` holding
        blocks for those tokens, so its next step computes only what follows (a decode).

        False, changing nothing, when max_num_seqs or the free blocks cannot take it now: a
        decode worker reserves blocks before it accepts K/V, so the caller holds the request
        and asks again after a step."""
        self._check_new(request)
        if not 0 < num_computed_tokens < request.num_tokens:
            raise ValueError(f"request {request.request_id!r}: {num_computed_tokens} computed tokens must be in "
                             f"[1, {request.num_tokens - 1}] (at least one token left to compute)")
        if len(self.running) >= self.config.max_num_seqs:
            return False
        before, request.num_computed_tokens = request.num_computed_tokens, 0
        if self.kv_cache_manager.allocate_slots(request, num_computed_tokens) is None:
            request.num_computed_tokens = before
            return False
        request.num_computed_tokens = num_computed_tokens
        request.num_cached_tokens = 0
        request.status = RequestStatus.RUNNING
        request.first_scheduled_time = self.clock()
        self.requests[request.request_id] = request
        self.running.append(request)
        return True

    def _check_new(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        if request.num_tokens >= self._max_len(request):
            raise ValueError(f"request {request.request_id!r} has {request.num_tokens} tokens: no room to generate "
                             f"within its context window of {self._max_len(request)}")

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish requests from outside (abort, stop string, deadline), waiting or running.

        Unknown or already finished ids are ignored. Returns the requests finished here.
        """
        if not status.finished:
            raise ValueError(f"finish_requests needs a finished status, got {status}")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        finished: list[Request] = []
        for rid in ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            self._finish(request, status)
            finished.append(request)
        self._drop_finished(finished)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished and free blocks; the caller removes it from the queues (in one pass)."""
        request.status = status
        request.finished_time = self.clock()
        self.kv_cache_manager.free(request)
        self.finished_request_ids.add(request.request_id)
        del self.requests[request.request_id]
        if self.proposer is not None:
            self.proposer.finish(request)
        if self.policy is not None:
            self.policy.forget(request.request_id)

    def _drop_finished(self, finished: list[Request]) -> None:
        """Remove finished requests from both queues in one O(n) pass each (not O(n) per request)."""
        if not finished:
            return
        gone = {r.request_id for r in finished}
        if any(r.request_id in gone for r in self.running):
            self.running = [r for r in self.running if r.request_id not in gone]
        if any(r.request_id in gone for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if r.request_id not in gone)

    # ------------------------------------------------------------------ one step

    def _max_len(self, request: Request) -> int:
        limit = self.config.max_model_len
        assert limit is not None, "max_model_len unresolved (LLMEngine sets it from the model)"
        if request.max_model_len is not None:
            limit = min(limit, request.max_model_len)
        return limit

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        """Tokens to compute this step: what is left, capped by the chunk threshold, the budget
        and the context window."""
        n = request.num_tokens - num_computed
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        n = min(n, budget)
        return min(n, self._max_len(request) - num_computed)

    def _preempt(self, request: Request) -> None:
        """Recompute later (blocks ran out): counted as a preemption."""
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._requeue(request)

    def _requeue(self, request: Request) -> None:
        """Free its blocks and put it at the front of the waiting queue, to recompute."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        """Choose this step's (request, num_new_tokens) pairs under the token budget.

        1. Running requests, in order. If blocks run out, preempt the last running request
           (the newest: lowest priority under FCFS) and retry; if the victim is the request
           being scheduled, stop there.
        2. Only if nothing was preempted (memory is tight otherwise): admit waiting requests
           in FCFS order, with prefix-cache hits, until the budget, max_num_seqs or the blocks
           run out. The first request that does not fit stops admission (no skipping ahead).
        """
        budget = self.config.max_num_batched_tokens
        kv = self.kv_cache_manager
        now = self.clock()
        chosen: list[tuple[Request, int]] = []
        proposed = self._propose_all(budget) if self.proposer is not None else {}
        drafts_of: dict[str, list[int]] = {}
        preempted: set[str] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._num_new_tokens(request, request.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            drafts = proposed.get(request.request_id)
            if drafts and num_new == 1 and request.num_computed_tokens == request.num_tokens - 1:
                # What the budget left now, and drafts only where their blocks are free: never
                # preempt anyone for a guess.
                drafts = drafts[: min(budget - 1, kv.num_free_slots(request) - 1)]
                if drafts and kv.allocate_slots(request, 1 + len(drafts)) is not None:
                    drafts_of[request.request_id] = drafts
                    chosen.append((request, 1 + len(drafts)))
                    budget -= 1 + len(drafts)
                    i += 1
                    continue
            scheduled = True
            while kv.allocate_slots(request, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    scheduled = False
                    break
            if not scheduled:
                break
            chosen.append((request, num_new))
            budget -= num_new
            i += 1

        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = self.waiting[0]
                hits: list[KVBlock] = []
                num_hit_tokens = 0
                if request.num_computed_tokens == 0:
                    hits, num_hit_tokens = kv.get_computed_blocks(request)
                num_computed = request.num_computed_tokens + num_hit_tokens
                if not self.config.enable_chunked_prefill and request.num_tokens - num_computed > budget:
                    break
                num_new = self._num_new_tokens(request, num_computed, budget)
                if kv.allocate_slots(request, num_new, hits) is None:
                    break
                self.waiting.popleft()
                self.running.append(request)
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_computed
                if request.first_scheduled_time is None:
                    request.first_scheduled_time = now
                if request.num_cached_tokens is None:
                    request.num_cached_tokens = num_hit_tokens
                chosen.append((request, num_new))
                budget -= num_new

        scheduled_reqs = [self._make_scheduled(request, num_new, drafts_of.get(request.request_id, []))
                          for request, num_new in chosen]
        output = SchedulerOutput(
            scheduled=scheduled_reqs,
            num_scheduled_tokens=sum(n for _, n in chosen),
            finished_request_ids=self.finished_request_ids,
            preempted_request_ids=preempted,
        )
        self.finished_request_ids = set()
        # The runner computes exactly what the output says; count it as computed now.
        for request, num_new in chosen:
            request.num_computed_tokens += num_new
        return output

    def _propose_all(self, budget: int) -> dict[str, list[int]]:
        """Drafts for every running request in decode (one proposer call for the step), each
        no longer than the budget, max_tokens and the context window leave room for; the
        schedule loop trims them to what is left of the budget and the free blocks. Any
        sampling settings: the runner verifies by sampling each position as decoding one at a
        time would (engine/spec_decode.py), so greedy output is exact and sampled output keeps
        its distribution."""
        assert self.proposer is not None
        decoding = [r for r in self.running if r.num_computed_tokens == r.num_tokens - 1]  # not prefilling
        # Prompt tokens in this step (a running prefill, or one to admit): the policy drafts none.
        prefill = len(decoding) < len(self.running) or (bool(self.waiting) and len(self.running) < self.config.max_num_seqs)
        if self.policy is None:
            plans = [(budget, False)] * len(decoding)  # the proposer's own K bounds them
        else:  # asked first: most requests at many streams draft nothing, and need no room worked out
            plans = self.policy.plan_step([r.request_id for r in decoding], len(decoding), prefill)
        batch: list[tuple[Request, int]] = []
        shadows: list[str] = []
        for request, (k, shadow) in zip(decoding, plans):
            if not k:
                continue
            room = min(k, budget - 1, self._max_len(request) - request.num_tokens - 1)
            max_tokens = request.sampling_params.max_tokens
            if max_tokens is not None:
                room = min(room, max_tokens - request.num_output_tokens - 1)
            if room > 0:
                batch.append((request, room))
                if shadow:
                    shadows.append(request.request_id)
        if not batch:
            return {}
        t0 = self.clock()
        drafts = self.proposer.propose_requests(batch)
        for request, _ in batch:
            d = drafts.get(request.request_id)
            if d:  # a draft after the reply's end is never kept, and the end itself is sampled anyway
                drafts[request.request_id] = until_end(d, request.end_token_ids)
        if self.policy is not None:
            self.policy.observe_proposal(self.clock() - t0, sum(len(d) for d in drafts.values()), len(batch))
            for rid in shadows:  # checked against the tokens decoded, never scheduled
                self.policy.observe_shadow(rid, drafts.pop(rid, []))
        return drafts

    def _make_scheduled(self, request: Request, num_new: int, drafts: list[int]) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new - len(drafts)  # the real tokens end here; drafts follow
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.token_slice(start, end) + drafts if drafts else request.token_slice(start, end),
            start_pos=start,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            sample=end == request.num_tokens,
            sampling_params=request.sampling_params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            eos_token_ids=request.eos_token_ids,
            num_draft_tokens=len(drafts),
            grammar=request.grammar,
        )

    # ------------------------------------------------------------------ after the forward pass

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, check stop conditions, finish what is done.

        Stop order: stop_token_ids (stop_reason = the token), then EOS unless ignore_eos
        (stop_reason None), both only once min_tokens are out; then max_tokens or the context
        window (finish "length"). Requests aborted since the step was scheduled are skipped.
        """
        self.kv_cache_manager.mark_written()
        if self.policy is not None and scheduler_output.decode_only:
            self.policy.observe_step(scheduler_output.num_scheduled_tokens, runner_output.step_time)
        now = self.clock()
        outputs: list[EngineCoreOutput] = []
        finished: list[Request] = []
        logprobs = runner_output.logprobs
        spec_tokens = runner_output.spec_token_ids or {}
        spec_logprobs = runner_output.spec_logprobs or {}
        num_drafts = {s.request_id: s.num_draft_tokens for s in scheduler_output.scheduled if s.num_draft_tokens}
        for idx, rid in enumerate(runner_output.request_ids):
            request = self.requests.get(rid)
            if request is None or request.is_finished or request.status is not RequestStatus.RUNNING:
                continue
            k = num_drafts.get(rid, 0)
            # A runner that did not verify (none of ours) leaves only the first token: no draft accepted.
            sampled = runner_output.sampled_token_ids[idx]
            tokens = (spec_tokens.get(rid) or [sampled]) if k else [sampled]
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            # In order, up to the first that stops it: nothing after a stop is emitted.
            status = None
            new_tokens: list[int] = []
            for token in tokens:
                request.output_token_ids.append(token)
                new_tokens.append(token)
                status = self._check_stop(request, token)
                if status is not None:
                    break
            if k:
                self.spec_stats.observe(k, len(tokens) - 1)
                if self.policy is not None:
                    self.policy.observe_verdict(rid, k, len(tokens) - 1)
            elif self.policy is not None:
                self.policy.observe_tokens(rid, new_tokens)
            if status is not None:
                self._finish(request, status)
                finished.append(request)
            elif k and len(tokens) - 1 < k:
                # Roll back the rejected drafts: their K/V is not the request's.
                request.num_computed_tokens -= k - (len(tokens) - 1)
                self.kv_cache_manager.trim(request, request.num_computed_tokens)
            new_logprobs: list[TokenLogprobs] | None = None
            if k and rid in spec_logprobs:
                got = spec_logprobs[rid][: len(new_tokens)]
                new_logprobs = [lp for lp in got if lp is not None] or None
            elif logprobs is not None:
                token_logprobs = logprobs[idx]
                new_logprobs = [token_logprobs] if token_logprobs is not None else None
            outputs.append(
                EngineCoreOutput(
                    request_id=rid,
                    new_token_ids=new_tokens,
                    new_logprobs=new_logprobs,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens or 0,
                    first_scheduled_time=request.first_scheduled_time,
                    first_token_time=request.first_token_time,
                    last_token_time=request.last_token_time,
                    num_preemptions=request.num_preemptions,
                    num_draft_tokens=k,
                    num_accepted_tokens=len(tokens) - 1 if k else 0,
                    stop_token_is_text=status is RequestStatus.FINISHED_STOPPED and request.grammar is not None
                    and new_tokens[-1] not in request.sampling_params.stop_token_ids
                    and new_tokens[-1] not in request.eos_token_ids,
                )
            )
        self._drop_finished(finished)
        return outputs

    def discard_step(self, scheduler_output: SchedulerOutput) -> None:
        """The runner failed on this step: nothing it says was computed may be trusted.

        Each request the step carried goes back to the front of the waiting queue, in its FCFS
        order, to be recomputed from scratch, so the scheduler stays consistent whether the
        caller aborts them or steps on; freeing their blocks takes the ones cached for this step
        back out of the prefix cache (else a retried prompt is served K/V never written).
        """
        ids = {s.request_id for s in scheduler_output.scheduled}
        victims = [r for r in self.running if r.request_id in ids]
        self.running = [r for r in self.running if r.request_id not in ids]
        for request in reversed(victims):
            self._requeue(request)

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        """The finished status the new token causes, or None; sets request.stop_reason.
        A request with a grammar advances its matcher first: a finished grammar ends it ("stop"),
        a token the grammar refuses (only possible when other constraints left no token it
        allows) ends it as an error rather than return text that breaks the grammar."""
        params = request.sampling_params
        if request.grammar is not None:
            if not request.grammar.accept(token):
                return RequestStatus.FINISHED_ERROR
            if request.grammar.is_terminated():
                request.stop_reason = token if token in params.stop_token_ids else None
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.min_tokens:
            # The sampler masks these below min_tokens as well; checked again here so that a
            # runner that does not mask still cannot stop a request early.
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token in request.eos_token_ids:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self._max_len(request):
            return RequestStatus.FINISHED_LENGTH
        return None

    # ------------------------------------------------------------------ stats

    def get_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=kv.usage,
            num_blocks=kv.num_blocks,
            block_size=kv.block_size,
            prefix_cache_queries=kv.total_stats.queries,
            prefix_cache_hits=kv.total_stats.hits,
            num_preemptions=self.num_preemptions,
            spec_num_drafts=self.spec_stats.num_drafts,
            spec_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_accepted_per_pos=tuple(self.spec_stats.accepted_per_pos),
            spec_drafted_per_pos=tuple(self.spec_stats.drafted_per_pos),
        )

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns how many blocks were dropped from the cache."""
        return self.kv_cache_manager.reset_prefix_cache()
