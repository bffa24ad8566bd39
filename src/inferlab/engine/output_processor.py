"""From the scheduler's token ids to what users see: detokenized text deltas, stop strings,
n > 1 fan-in, timings.

Each user request becomes n scheduler requests ("children"); this module folds their
progress back into one `RequestOutput` per user request per step. A stop string found here
ends a child early: the engine then tells the scheduler to finish it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from inferlab.engine.outputs import EngineCoreOutput
from inferlab.engine.request import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
)


@dataclass
class _Sequence:
    """One of a request's n sequences."""

    index: int
    detok: object | None  # an IncrementalDetokenizer, or None when detokenize is off
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    delta_text: str = ""
    delta_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] | None = None


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[_Sequence]
    metrics: RequestMetrics
    error: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # one per prompt position known so far
    # prompt_logprobs=-1: blocks of whole log-softmax rows (numpy), positions 1.. in order;
    # joined into one array once every prompt position has its row.
    prompt_logprob_rows: list[Any] | None = None
    num_rows: int = 0
    joined_rows: Any | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


class OutputProcessor:
    def __init__(self, make_detokenizer, token_text: Callable[[int], str] | None = None):
        """make_detokenizer(prompt_token_ids, params) -> IncrementalDetokenizer | None;
        token_text(token_id) -> its text, for prompt logprobs' decoded_token (None: left unset)."""
        self._make_detok = make_detokenizer
        self._token_text = token_text
        self._token_text_cache: dict[int, str] = {}
        self.requests: dict[str, _RequestState] = {}
        self.child_to_parent: dict[str, tuple[str, int]] = {}

    def add_request(self, request_id: str, child_ids: list[str], prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float) -> None:
        seqs = [_Sequence(i, self._make_detok(prompt_token_ids, params), logprobs=[] if params.logprobs is not None
                          else None) for i in range(len(child_ids))]  # fmt: skip
        self.child_to_parent.update((cid, (request_id, i)) for i, cid in enumerate(child_ids))
        self.requests[request_id] = _RequestState(
            request_id, prompt, prompt_token_ids, params, seqs,
            RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=len(prompt_token_ids)),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            prompt_logprob_rows=[] if params.prompt_logprobs == -1 else None)  # fmt: skip

    def child_ids(self, request_id: str) -> list[str]:
        return [c for c, (p, _) in self.child_to_parent.items() if p == request_id]

    def add_prompt_logprobs(self, chunks: dict[str, tuple[int, list[TokenLogprobs]]]) -> None:
        """Fold one step's prompt logprobs in (before `process`, which may finish the request).

        Keyed by position: a child recomputing its prompt after preemption, or another of n
        children computing the same prompt, reports positions already known; only new ones
        are appended. Every chunk follows its child's earlier chunks from position 0 (such a
        request takes no prefix-cache hit), so there are no gaps.
        """
        for cid, (start, entries) in chunks.items():
            ref = self.child_to_parent.get(cid)
            if ref is None:
                continue
            have = self.requests[ref[0]].prompt_logprobs
            if have is None or start > len(have):
                continue
            for chosen, top in entries[len(have) - start :]:
                entry = {chosen.token_id: self._decoded(chosen)}
                for alt in top:
                    if alt.token_id not in entry:
                        entry[alt.token_id] = self._decoded(alt)
                have.append(entry)

    def add_prompt_logprob_rows(self, chunks: dict[str, tuple[int, Any]]) -> None:
        """Fold one step's whole log-softmax rows in (prompt_logprobs=-1), keyed by position
        like `add_prompt_logprobs`: rows for positions already known are dropped."""
        for cid, (start, block) in chunks.items():
            ref = self.child_to_parent.get(cid)
            if ref is None:
                continue
            state = self.requests[ref[0]]
            if state.prompt_logprob_rows is None or start > state.num_rows + 1:
                continue
            new = block[state.num_rows + 1 - start :]
            if len(new):
                state.prompt_logprob_rows.append(new)
                state.num_rows += len(new)

    def _joined_rows(self, state: _RequestState) -> Any | None:
        if state.joined_rows is None and state.prompt_logprob_rows is not None:
            if state.num_rows == len(state.prompt_token_ids) - 1 and state.prompt_logprob_rows:
                import numpy as np

                blocks = state.prompt_logprob_rows
                state.joined_rows = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
                state.prompt_logprob_rows = []
        return state.joined_rows

    def _decoded(self, lp: Logprob) -> Logprob:
        if self._token_text is not None and lp.decoded_token is None:
            text = self._token_text_cache.get(lp.token_id)
            if text is None:
                text = self._token_text(lp.token_id)
                if len(self._token_text_cache) < 200_000:
                    self._token_text_cache[lp.token_id] = text
            lp.decoded_token = text
        return lp

    def process(self, core_outputs: list[EngineCoreOutput], now: float) -> tuple[list[RequestOutput], list[str]]:
        """Fold one step's outputs in. Returns the RequestOutputs to emit and the child ids a
        stop string finished (the engine finishes them in the scheduler)."""
        touched: dict[str, _RequestState] = {}
        stopped_children: list[str] = []
        for co in core_outputs:
            ref = self.child_to_parent.get(co.request_id)
            if ref is None:
                continue
            state = self.requests[ref[0]]
            seq = state.sequences[ref[1]]
            if seq.finish_reason is not None:
                continue
            touched[state.request_id] = state
            self._update_metrics(state.metrics, co)
            if self._apply_tokens(state, seq, co):
                stopped_children.append(co.request_id)
            if seq.finish_reason is not None:
                del self.child_to_parent[co.request_id]
        outputs = [self._emit(s, now) for s in touched.values()]
        return outputs, stopped_children

    def abort(self, request_id: str, now: float, reason: str = "abort", error: str | None = None) -> RequestOutput | None:
        """Finish every unfinished sequence of a request (client gone, deadline, engine error)."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        for seq in state.sequences:
            if seq.finish_reason is None:
                seq.finish_reason = reason
        for cid in self.child_ids(request_id):
            del self.child_to_parent[cid]
        state.error = error
        return self._emit(state, now)

    @staticmethod
    def _update_metrics(m: RequestMetrics, co: EngineCoreOutput) -> None:
        """The request's times over its n sequences: the earliest start and first token, the latest token."""
        m.first_scheduled_time = _either(min, m.first_scheduled_time, co.first_scheduled_time)
        m.first_token_time = _either(min, m.first_token_time, co.first_token_time)
        m.last_token_time = _either(max, m.last_token_time, co.last_token_time)
        m.num_cached_tokens = max(m.num_cached_tokens, co.num_cached_tokens)
        m.num_preemptions = max(m.num_preemptions, co.num_preemptions)
        m.num_generated_tokens += len(co.new_token_ids)
        m.num_draft_tokens += co.num_draft_tokens
        m.num_accepted_tokens += co.num_accepted_tokens

    def _apply_tokens(self, state: _RequestState, seq: _Sequence, co: EngineCoreOutput) -> bool:
        """Append new tokens and text; True if a stop string ended the sequence here."""
        params = state.params
        new = co.new_token_ids
        if len(new) > 1 and params.stop and seq.detok is not None:
            # Several tokens in one step (speculative decoding): one at a time, so that a stop
            # string ends the sequence at the token that completed it, as decoding one token per
            # step would; the tokens after it are dropped.
            for j in range(len(new)):
                last = j == len(new) - 1
                one = EngineCoreOutput(
                    co.request_id, new[j : j + 1], co.new_logprobs[j : j + 1] if co.new_logprobs else None,
                    finish_reason=co.finish_reason if last else None, stop_reason=co.stop_reason if last else None)
                if self._apply_tokens(state, seq, one):
                    state.metrics.num_generated_tokens -= len(new) - j - 1
                    return True
            return False
        seq.token_ids.extend(new)
        seq.delta_ids.extend(new)
        if co.new_logprobs is not None and seq.logprobs is not None:
            seq.logprobs.extend(co.new_logprobs)
            seq.delta_logprobs = (seq.delta_logprobs or []) + list(co.new_logprobs)
        if seq.detok is not None:
            feed = new
            # The token that ended the request by EOS or stop_token_ids is not part of the text.
            if co.finish_reason == "stop" and new and not params.include_stop_str_in_output and not co.stop_token_is_text:
                feed = new[:-1]
            upd = seq.detok.update(feed) if feed else None
            if upd is not None:
                seq.text += upd.text_delta
                seq.delta_text += upd.text_delta
                if upd.stop_string is not None:
                    seq.finish_reason = "stop"
                    seq.stop_reason = upd.stop_string
                    return True
            if co.finish_reason is not None:
                tail = seq.detok.finalize()
                seq.text += tail
                seq.delta_text += tail
                if seq.detok.stop_string is not None:  # the flushed tail completed a stop string
                    seq.finish_reason = "stop"
                    seq.stop_reason = seq.detok.stop_string
                    return False
        if co.finish_reason is not None:
            seq.finish_reason = co.finish_reason
            seq.stop_reason = co.stop_reason
        return False

    def _emit(self, state: _RequestState, now: float) -> RequestOutput:
        outs = []
        for seq in state.sequences:  # token_ids: the live list (no O(n) copy per step), final once finished
            outs.append(CompletionOutput(index=seq.index, text=seq.text, token_ids=seq.token_ids,
                                         finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                                         logprobs=seq.logprobs, text_delta=seq.delta_text,
                                         token_ids_delta=seq.delta_ids, logprobs_delta=seq.delta_logprobs))
            seq.delta_text, seq.delta_ids, seq.delta_logprobs = "", [], None
        finished = state.finished
        if finished:
            state.metrics.finished_time = now
            del self.requests[state.request_id]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outs,
            finished=finished,
            metrics=state.metrics,
            error=state.error,
            prompt_logprobs=state.prompt_logprobs,
            prompt_logprob_rows=self._joined_rows(state),
        )


def _either(pick: Callable[[float, float], float], old: float | None, new: float | None) -> float | None:
    """`pick` of the two times, the one that is set if only one is."""
    return old if new is None else new if old is None else pick(old, new)
