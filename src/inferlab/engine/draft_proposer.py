"""Draft-model speculation: a second, small model sharing the target's vocabulary proposes K
tokens per request and step, autoregressively (K forward passes of the draft for the whole
batch at once: one catch-up pass over the tokens it has not seen, then one decode row per
request and draft).

The draft has its own ModelRunner (its own weights, KV cache and block tables). Its K/V is
kept per request and rolled back with the target's: before each proposal the tokens it holds
K/V for are compared with the request's tokens, and everything past the common prefix (its
rejected drafts) is dropped and its blocks freed, so only the tokens the target accepted (or
corrected) are fed again. For a greedy request its drafts are its argmax (a one-hot proposal:
engine/spec_decode.py verifies by argmax); for a sampled one they are drawn from its own
distribution q under the request's sampling settings, and the target verifies them by
rejection sampling against q (engine/rejection_sampler.py): min(1, p/q), else the residual.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from inferlab.config import CacheConfig, LoadConfig, ModelConfig, SpeculativeConfig
from inferlab.engine.model_runner import ModelRunner
from inferlab.engine.outputs import ScheduledRequest, SchedulerOutput
from inferlab.engine.request import Request, SamplingParams
from inferlab.engine.sampler import inverse_cdf
from inferlab.models.precision import ResolvedPrecision

log = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0)


@dataclass
class _DraftState:
    tokens: list[int] = field(default_factory=list)  # the tokens whose K/V the draft holds, in order
    blocks: list[int] = field(default_factory=list)


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, num_speculative_tokens: int, max_model_len: int) -> None:
        self.runner = runner
        self.k = num_speculative_tokens
        self.max_len = max_model_len  # the draft's context window (positions it can embed)
        self.block_size = runner.block_size
        self.free_blocks = list(range(runner.num_blocks - 1, -1, -1))
        self.state: dict[str, _DraftState] = {}
        self.q: dict[str, torch.Tensor] = {}  # this step's draft distributions of sampled requests

    def probs_of(self, request_id: str) -> torch.Tensor | None:
        """[drafts, V]: what this step's drafts of a sampled request were drawn from; None for argmax drafts."""
        return self.q.get(request_id)

    def reset(self) -> None:
        """Forget every request (the engine's scheduler is made anew after its warm-up)."""
        self.state.clear()
        self.q.clear()
        self.free_blocks = list(range(self.runner.num_blocks - 1, -1, -1))

    def finish(self, request: Request) -> None:
        self.q.pop(request.request_id, None)
        st = self.state.pop(request.request_id, None)
        if st is not None:
            self.free_blocks.extend(st.blocks)

    def _fit(self, st: _DraftState, num_tokens: int) -> bool:
        """Hold blocks for `num_tokens` positions exactly (freeing the ones past them); False,
        holding what it had, when the pool cannot give more."""
        need = -(-num_tokens // self.block_size)
        if need > len(st.blocks) + len(self.free_blocks):
            return False
        while len(st.blocks) > need:
            self.free_blocks.append(st.blocks.pop())
        while len(st.blocks) < need:
            st.blocks.append(self.free_blocks.pop())
        return True

    def propose_requests(self, batch: list[tuple[Request, int]]) -> dict[str, list[int]]:
        rows: list[ScheduledRequest] = []
        want: dict[str, int] = {}
        reqs: dict[str, Request] = {}
        self.q = {}
        for request, room in batch:
            rid = request.request_id
            tokens = request.all_token_ids
            n = min(self.k, room, self.max_len - len(tokens))
            if n <= 0:
                continue
            st = self.state.setdefault(rid, _DraftState())
            # Roll back to the common prefix with the request's tokens, keeping at least the last
            # token to feed: its logits give the first draft.
            keep = 0
            limit = min(len(st.tokens), len(tokens) - 1)
            while keep < limit and st.tokens[keep] == tokens[keep]:
                keep += 1
            del st.tokens[keep:]
            if not self._fit(st, len(tokens) + n - 1):
                self._fit(st, keep)
                continue
            reqs[rid] = request
            rows.append(self._row(request, tokens[keep:], keep, st, []))
            st.tokens.extend(tokens[keep:])
            want[rid] = n
        drafts: dict[str, list[int]] = {rid: [] for rid in want}
        q_rows: dict[str, list[torch.Tensor]] = {}
        while rows:
            sampled = [r for r in rows if not r.sampling_params.greedy]
            out = self.runner.execute(SchedulerOutput(scheduled=rows, num_scheduled_tokens=sum(len(r.token_ids) for r in rows)),
                                      want_probs=bool(sampled))
            tokens_out = list(out.sampled_token_ids)
            if sampled:  # draw from q itself, so that q is exactly what the draft came from
                by_row = {r.request_id: r for r in rows}
                u = self.runner.sampler.uniforms([by_row[rid] for rid in out.request_ids], 1)
                for i, rid in enumerate(out.request_ids):
                    if not by_row[rid].sampling_params.greedy:
                        tokens_out[i] = int(inverse_cdf(out.probs[i : i + 1], u[i : i + 1])[0])
                        q_rows.setdefault(rid, []).append(out.probs[i])
            nxt: list[ScheduledRequest] = []
            for rid, tok in zip(out.request_ids, tokens_out):
                drafts[rid].append(tok)
                if len(drafts[rid]) < want[rid]:
                    st = self.state[rid]
                    nxt.append(self._row(reqs[rid], [tok], len(st.tokens), st, drafts[rid]))
                    st.tokens.append(tok)
            rows = nxt
        self.q = {rid: torch.stack(q) for rid, q in q_rows.items()}
        return drafts

    def _row(self, request: Request, token_ids: list[int], start: int, st: _DraftState,
             drafts: list[int]) -> ScheduledRequest:
        """A draft row: argmax for a greedy request; for a sampled one its sampling settings,
        with the drafts so far as output (penalties, min_tokens and a seed's uniform see them)."""
        params = request.sampling_params
        if params.greedy:
            return ScheduledRequest(request_id=request.request_id, token_ids=token_ids, start_pos=start,
                                    block_ids=st.blocks, sample=True, sampling_params=_GREEDY,
                                    prompt_token_ids=[], output_token_ids=[])
        return ScheduledRequest(request_id=request.request_id, token_ids=token_ids, start_pos=start,
                                block_ids=st.blocks, sample=True, sampling_params=params,
                                prompt_token_ids=request.prompt_token_ids,
                                output_token_ids=request.output_token_ids + drafts, eos_token_ids=request.eos_token_ids)


def build_draft_proposer(spec: SpeculativeConfig, target: ModelConfig, target_name: str, load: LoadConfig,
                         cache: CacheConfig, num_blocks: int, max_num_seqs: int,
                         precision: ResolvedPrecision) -> DraftModelProposer:
    """Load `spec.model` as the draft, in the target's precision (the engine's `precision`), with a KV pool of the target's
    token capacity plus K + 1 per running request (its drafts beyond the target's tokens).
    Refuses a draft whose vocabulary differs from the target's, naming both."""
    from inferlab.models.backends import select_backends
    from inferlab.models.loader import load_model
    from inferlab.models.registry import resolve_model

    assert spec.model is not None  # SpeculativeConfig checks it for draft_model
    resolved = resolve_model(spec.model)
    draft_load = dataclasses.replace(load, model=spec.model, load_format="auto", hf_config_path=None)
    loaded = load_model(draft_load, resolved.path, precision=precision)
    cfg = loaded.config
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config: the draft model {spec.model} has a vocabulary of {cfg.vocab_size} "
                         f"tokens, the target {target_name} one of {target.vocab_size}: a draft must share the "
                         "target's tokenizer")
    per_request = -(-(spec.num_speculative_tokens + 1) // cache.block_size) + 1
    draft_cache = dataclasses.replace(cache, num_blocks_override=num_blocks + max_num_seqs * per_request,
                                      enable_prefix_caching=False)
    backends = select_backends(precision, cfg, load.decoder_backend, load.attention_backend)  # the target's choice
    runner = ModelRunner(cfg, loaded.weights, precision, draft_cache, seed=draft_load.seed, backends=backends)
    log.info("draft model %s: %d layers, hidden %d, K = %d", spec.model, cfg.num_layers, cfg.hidden_size,
             spec.num_speculative_tokens)
    return DraftModelProposer(runner, spec.num_speculative_tokens, cfg.max_position_embeddings)
