"""A fake `LLMEngine` for server tests: the real interface, no model.

Tokens are UTF-8 bytes (id = byte + 3; 1 = BOS, 2 = EOS), so text and token counts are easy
to predict. "Generation" picks letters from a small alphabet with a generator seeded by the
request's seed (or at random without one, unless temperature is 0). Continuous batching, KV
block accounting (reserved at admission for prompt + max_tokens), a prefix cache of full
prompt blocks, aborts and injected step failures behave like the real engine's, so the
server's bookkeeping (metrics, freed blocks, queue limits) can be checked exactly.
"""

from __future__ import annotations

import hashlib
import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from inferlab.config import CacheConfig
from inferlab.engine.errors import ContextLengthError
from inferlab.engine.outputs import SchedulerStats
from inferlab.engine.request import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOptions,
    RequestOutput,
    SamplingParams,
)

ALPHABET = "abcdefghij "
OFFSET = 3
BOS, EOS = 1, 2


class FakeTokenizer:
    """Byte-level: one token per UTF-8 byte."""

    eos_token_ids = (EOS,)
    vocab_size = 256 + OFFSET

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            if i >= OFFSET:
                out.append(i - OFFSET)
            elif not skip_special_tokens:
                out.extend(b"<s>" if i == BOS else b"</s>" if i == EOS else b"<pad>")
        return out.decode("utf-8", errors="replace")

    def info(self) -> dict[str, Any]:
        return {"tokenizer_class": "FakeTokenizer", "bos_token": "<s>", "eos_token": "</s>", "pad_token": None,
                "model_max_length": 1 << 20, "chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"}  # fmt: skip

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.decode([i], skip_special_tokens=False) for i in ids]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        parts = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
                raise ValueError(f"message {i} needs a role and a text content")
            if m["role"] not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"message {i} has an unknown role {m['role']!r}")
            parts.append(f"<{m['role']}>{m['content']}\n")
        if add_generation_prompt:
            parts.append("<assistant>")
        return self.encode("".join(parts))


@dataclass
class _Seq:
    index: int
    rng: random.Random
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0  # characters of text already handed out as deltas
    finish_reason: str | None = None
    stop_reason: Any = None
    logprobs: list | None = None
    delta_text: str = ""
    delta_ids: list[int] = field(default_factory=list)
    delta_logprobs: list | None = None


@dataclass
class _Req:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[_Seq]
    options: RequestOptions
    blocks: int = 0
    prompt_logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


class FakeEngine:
    """The `LLMEngine` interface over fake tokens (see the module docstring)."""

    def __init__(
        self,
        *,
        step_delay: float = 0.0,
        num_blocks: int = 64,
        block_size: int = 4,
        max_model_len: int = 256,
        max_num_seqs: int = 4,
        eos_after: int | None = None,
        model_name: str = "fake-model",
        load_delay: float = 0.0,
        load_gate: threading.Event | None = None,
        enable_prefix_caching: bool = True,
    ):
        if load_delay:
            time.sleep(load_delay)
        if load_gate is not None:
            load_gate.wait()
        self.tokenizer = FakeTokenizer()
        self.vocab_size = self.tokenizer.vocab_size  # the server checks logit_bias / allowed_token_ids ids against it
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
        self.num_blocks = num_blocks
        self.step_delay = step_delay
        self.max_num_seqs = max_num_seqs
        self.eos_after = eos_after
        self.fail_next_steps = 0  # > 0: the next steps raise (tests of engine failures)
        self.num_steps = 0
        self.thread_ids: set[int] = set()  # threads that called the engine (must be one)
        self._waiting: deque[_Req] = deque()
        self._running: list[_Req] = []
        self._requests: dict[str, _Req] = {}
        self._pending: list[RequestOutput] = []
        self._used_blocks = 0
        self._cached_prefixes: set[bytes] = set()
        self._queries = 0
        self._hits = 0

    # ------------------------------------------------------------------ interface
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        options: RequestOptions | None = None,
    ) -> None:
        self.thread_ids.add(threading.get_ident())
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if any(not 0 <= t < self.tokenizer.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.tokenizer.vocab_size})")
        n_ctx = self.max_model_len
        if len(ids) >= n_ctx or (params.max_tokens is not None and len(ids) + params.max_tokens > n_ctx):
            raise ContextLengthError(len(ids), params.max_tokens, n_ctx)
        seqs = []
        for i in range(params.n):
            if params.seed is not None:
                rng = random.Random(params.seed * 1000 + i)
            elif params.temperature == 0:
                rng = random.Random(int.from_bytes(hashlib.sha256(bytes(ids)).digest()[:8], "little") + i)
            else:
                rng = random.Random()
            seqs.append(_Seq(index=i, rng=rng, logprobs=[] if params.logprobs is not None else None))
        options = (options or RequestOptions()).arrived(time.monotonic())
        assert options.arrival_time is not None
        req = _Req(request_id, ids, params, RequestMetrics(arrival_time=options.arrival_time, num_prompt_tokens=len(ids)),
                   seqs, options)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = self._prompt_logprobs(ids, params.prompt_logprobs)
        self._requests[request_id] = req
        self._waiting.append(req)

    def _prompt_logprobs(self, ids: list[int], k: int) -> list:
        """vLLM's shape: None, then {prompt token: logprob -1 - p/100, then the top k: 'z', 'y', ...
        at -0.5, -0.6, ...}, ranks after them unless the prompt token is one of them."""
        tops = [OFFSET + ord(c) for c in "zyxwv"][:k]
        out: list = [None]
        for p in range(1, len(ids)):
            tok = ids[p]
            top = [Logprob(t, -0.5 - 0.1 * r, r + 1, self.tokenizer.decode([t])) for r, t in enumerate(tops)]
            chosen = next((lp for lp in top if lp.token_id == tok), None)
            if chosen is None:
                chosen = Logprob(tok, -1.0 - p / 100, len(tops) + 1, self.tokenizer.decode([tok], skip_special_tokens=False))
            out.append({tok: chosen, **{lp.token_id: lp for lp in top if lp.token_id != tok}})
        return out

    def abort_request(self, request_ids: list[str] | str) -> None:
        self.thread_ids.add(threading.get_ident())
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            req = self._requests.pop(rid, None)
            if req is None:
                continue
            if req in self._waiting:
                self._waiting.remove(req)
            if req in self._running:
                self._running.remove(req)
            self._free(req)
            for s in req.seqs:
                if s.finish_reason is None:
                    s.finish_reason = "abort"
            self._pending.append(self._emit(req, time.monotonic()))

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending or self._waiting or self._running)

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_cache_usage=self._used_blocks / self.num_blocks,
            num_blocks=self.num_blocks,
            block_size=self.cache_config.block_size,
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
            num_preemptions=0,
        )

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        self.num_steps += 1
        # Only a step that carries requests fails: an idle step the engine loop takes right after
        # a failure must not use up the failure a test armed for its next request.
        if self.fail_next_steps > 0 and (self._waiting or self._running):
            self.fail_next_steps -= 1
            raise RuntimeError("injected engine failure")
        outputs, self._pending = self._pending, []
        self._admit()
        if self.step_delay:
            time.sleep(self.step_delay)
        now = time.monotonic()
        for req in list(self._running):
            m = req.metrics
            for s in req.seqs:
                if s.finish_reason is None:
                    self._generate_one(req, s)
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
            if req.finished:
                self._running.remove(req)
                del self._requests[req.request_id]
                self._free(req)
                m.finished_time = now
            outputs.append(self._emit(req, now))
        return outputs

    # ------------------------------------------------------------------ internals
    def _blocks_for(self, req: _Req) -> int:
        limit = req.params.max_tokens if req.params.max_tokens is not None else self.max_model_len - len(req.prompt_ids)
        return req.params.n * math.ceil((len(req.prompt_ids) + limit) / self.cache_config.block_size)

    def _admit(self) -> None:
        now = time.monotonic()
        while self._waiting and len(self._running) < self.max_num_seqs:
            req = self._waiting[0]
            need = self._blocks_for(req)
            if self._used_blocks + need > self.num_blocks:
                break
            self._waiting.popleft()
            req.blocks = need
            self._used_blocks += need
            req.metrics.first_scheduled_time = now
            req.metrics.num_cached_tokens = self._lookup_prefix(req)
            self._running.append(req)

    def _lookup_prefix(self, req: _Req) -> int:
        """Full prompt blocks seen before (same salt) count as cached."""
        if not self.cache_config.enable_prefix_caching:
            return 0
        bs = self.cache_config.block_size
        ids = req.prompt_ids
        self._queries += len(ids)
        salt = (req.options.cache_salt or "").encode()
        hits = 0
        keys = []
        for end in range(bs, len(ids) + 1, bs):
            key = hashlib.sha256(salt + b"|" + bytes(str(ids[:end]), "ascii")).digest()
            keys.append(key)
            if req.options.use_prefix_cache and hits == end - bs and key in self._cached_prefixes:
                hits = end
        hits = min(hits, len(ids) - 1)
        self._hits += hits
        self._cached_prefixes.update(keys)
        return hits

    def _free(self, req: _Req) -> None:
        self._used_blocks -= req.blocks
        req.blocks = 0

    def _generate_one(self, req: _Req, s: _Seq) -> None:
        p = req.params
        n_out = len(s.token_ids)
        if self.eos_after is not None and n_out >= max(self.eos_after, p.min_tokens) and not p.ignore_eos:
            tok = EOS
        else:
            tok = self.tokenizer.encode(s.rng.choice(ALPHABET))[0]
        s.token_ids.append(tok)
        s.delta_ids.append(tok)
        if s.logprobs is not None:
            entry = (Logprob(tok, -0.5, 1), [Logprob(tok, -0.5, 1), Logprob(OFFSET + ord("z"), -2.0, 2)][: p.logprobs])
            s.logprobs.append(entry)
            s.delta_logprobs = (s.delta_logprobs or []) + [entry]
        if tok == EOS or (tok in p.stop_token_ids and n_out + 1 >= p.min_tokens):
            s.finish_reason, s.stop_reason = "stop", tok
            self._release_text(s, p.stop)
            return
        s.text += self.tokenizer.decode([tok])
        for stop in p.stop:
            at = s.text.find(stop)
            if at >= 0:
                s.text = s.text[: at + len(stop) if p.include_stop_str_in_output else at]
                s.finish_reason, s.stop_reason = "stop", stop
                break
        limit = p.max_tokens if p.max_tokens is not None else self.max_model_len - len(req.prompt_ids)
        if s.finish_reason is None and len(s.token_ids) >= limit:
            s.finish_reason = "length"
        self._release_text(s, p.stop)

    @staticmethod
    def _release_text(s: _Seq, stops: list[str]) -> None:
        """Move text to the delta, holding back a tail that could still become a stop string."""
        safe = len(s.text)
        if s.finish_reason is None:
            for stop in stops:
                for k in range(min(len(stop) - 1, len(s.text)), 0, -1):
                    if s.text.endswith(stop[:k]):
                        safe = min(safe, len(s.text) - k)
                        break
        if safe > s.emitted:
            s.delta_text += s.text[s.emitted : safe]
            s.emitted = safe

    def _emit(self, req: _Req, now: float) -> RequestOutput:
        outs = []
        for s in req.seqs:
            outs.append(
                CompletionOutput(
                    index=s.index,
                    text=s.text,
                    token_ids=list(s.token_ids),
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                    logprobs=list(s.logprobs) if s.logprobs is not None else None,
                    text_delta=s.delta_text,
                    token_ids_delta=s.delta_ids,
                    logprobs_delta=s.delta_logprobs,
                )
            )
            s.delta_text, s.delta_ids, s.delta_logprobs = "", [], None
        req.metrics.num_generated_tokens = sum(len(s.token_ids) for s in req.seqs)
        return RequestOutput(
            request_id=req.request_id,
            prompt=None,
            prompt_token_ids=req.prompt_ids,
            outputs=outs,
            finished=req.finished,
            metrics=req.metrics,
            prompt_logprobs=req.prompt_logprobs,
        )
