"""Turns a `SchedulerOutput` into tensors, runs one forward pass for the whole flat batch,
samples, and returns a `ModelRunnerOutput`. Knows nothing of queues.

The batch is laid out decodes first, then prefill chunks (see models/attention.py), whatever
order the scheduler listed the requests in; the output maps back to the scheduler's order.

A request with speculative drafts is laid out as 1 + k decode rows (row j at position
start + j sees context 0 .. start + j: every row's K/V is written before any row attends), so
it runs through the very kernels a plain decode does (the whole-step kernel, the paged decode
attention) and its argmax at each position is the token decoding one at a time would give.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from inferlab.config import CacheConfig, ModelConfig
from inferlab.engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from inferlab.engine.rejection_sampler import rejection_sample
from inferlab.engine.request import Logprob, TokenLogprobs
from inferlab.engine.sampler import Sampler, SamplerOutput, gather_logprobs, plain_greedy
from inferlab.engine.spec_decode import accept_greedy, position_rows
from inferlab.models.attention import (
    TILED_FRESH_MAX,
    AttentionMetadata,
    ContinuingChunk,
    FreshRun,
    GatheredDecode,
    PagedDecode,
    PrefillBatch,
    causal_bias_band,
    meta_to,
    padded_slots_and_mask,
    prefill_tile,
)
from inferlab.models.backends import Backends, select_backends
from inferlab.models.decoder import DecoderModel
from inferlab.models.kv_cache import allocate_kv_cache
from inferlab.models.precision import ResolvedPrecision, dtype_name

if TYPE_CHECKING:
    from inferlab.engine.tp_worker import TensorParallelGroup

log = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 1 << 30  # 1 GiB on the CPU when nothing else is said
# Prompt logprobs take the log-softmax of this many positions' logits at a time: a whole
# 2,048-token prefill over a 49,152-token vocabulary would be 400 MB of float32 at once.
PROMPT_LOGPROB_ROWS = 256


def num_kv_blocks(cache: CacheConfig, bytes_per_token: int) -> int:
    """Blocks that fit the KV budget at `bytes_per_token` (ResolvedPrecision.kv_bytes_per_token:
    2 (K, V) x layers x kv heads x (head dim x bytes, plus an int8 row's scale))."""
    if cache.num_blocks_override is not None:
        return cache.num_blocks_override
    budget = cache.kv_cache_memory or DEFAULT_KV_CACHE_BYTES
    per_block = bytes_per_token * cache.block_size
    n = budget // per_block
    if n < 1:
        raise ValueError(f"kv_cache_memory of {budget} bytes holds no block of {per_block} bytes")
    return int(n)


class ModelRunner:
    """`precision` is the engine's (models/precision.py resolve_precision of the same LoadConfig
    and CacheConfig): the runner and its model take every dtype from it and decide none."""

    def __init__(
        self,
        model_config: ModelConfig,
        weights: dict[str, torch.Tensor],
        precision: ResolvedPrecision,
        cache_config: CacheConfig,
        seed: int = 0,
        backends: Backends | None = None,
        parallel: TensorParallelGroup | None = None,
    ):
        self.model_config = model_config
        self.precision = precision
        # Which code runs each step, chosen once (models/backends.py); default: the fastest.
        self.backends = backends or select_backends(precision, model_config)
        self.device = torch.device(precision.device)
        self.block_size = cache_config.block_size
        # Tensor parallel (engine/tp_worker.py): rank 0's shard, which hands each call to the
        # other ranks too, and a KV cache of its own KV heads; the pool's blocks (and so the
        # scheduler's view) are the whole model's, the same on every rank.
        self.model = (DecoderModel(model_config, weights, precision, self.backends) if parallel is None
                      else parallel.rank0_model(model_config, weights, precision, self.backends))
        self.kv_bytes_per_token = precision.kv_bytes_per_token(model_config)
        self.num_blocks = num_kv_blocks(cache_config, self.kv_bytes_per_token)
        assert parallel is None or parallel.spec.num_blocks == self.num_blocks  # the other ranks' pools
        self.kv_caches = allocate_kv_cache(
            model_config.num_layers,
            model_config.num_kv_heads if parallel is None else parallel.local_kv_heads(),
            model_config.head_dim,
            self.num_blocks * self.block_size,
            precision.kv_cache,  # the caches carry it on: every reader and writer takes it from them
            device=self.device,
        )
        log.info("KV cache: %d blocks of %d tokens, %s, %d bytes per token, %.0f MiB", self.num_blocks,
                 self.block_size, describe_kv_dtype(precision.kv_cache), self.kv_bytes_per_token,
                 sum(c.nbytes for c in self.kv_caches) / 2**20)
        self.sampler = Sampler(seed, fused=self.backends.fused_sampler)
        # A step whose rows all take the argmax of their raw logits (sampler.plain_greedy) asks
        # the lm_head for those argmaxes straight away where it has them without the logits
        # (DecoderModel.greedy_tokens: w8a8's or bf16 panels on our kernels): no [N, vocab]
        # logits written, read back and passed through the sampler's Python.
        self.fused_greedy = self.backends.fused_sampler and getattr(self.model, "fused_greedy", False)
        # A draft model's proposer: request id → the [k, V] distributions its drafts were
        # sampled from (None for argmax drafts), for rejection sampling against them.
        self.draft_probs: Callable[[str], torch.Tensor | None] | None = None

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput, want_probs: bool = False) -> ModelRunnerOutput:
        """One step; `want_probs`: also the distribution each sampled row was drawn from."""
        t0 = time.perf_counter()
        decodes = [s for s in so.scheduled if len(s.token_ids) == 1 or s.num_draft_tokens]
        prefills = [s for s in so.scheduled if len(s.token_ids) > 1 and not s.num_draft_tokens]
        ordered = decodes + prefills
        input_ids, positions, meta, sample_index = self._prepare(decodes, prefills)
        if self.device.type != "cpu":  # the batch is built on the host, then copied over once
            input_ids, positions = (t.to(self.device, non_blocking=True) for t in (input_ids, positions))
            if sample_index is not None:
                sample_index = sample_index.to(self.device, non_blocking=True)
            meta = meta_to(meta, self.device)
        hidden = self.model.forward(input_ids, positions, self.kv_caches, meta)
        prompt_lps = prompt_rows = None
        if any(s.sampling_params.prompt_logprobs is not None for s in ordered):  # only requests asking pay
            prompt_lps, prompt_rows = self._prompt_logprobs(hidden, ordered)
        sampled_rows = [s for s in ordered if s.sample]
        if not sampled_rows:
            return ModelRunnerOutput([], [], None, time.perf_counter() - t0, prompt_lps, prompt_rows or None)
        sampled = hidden if sample_index is None else hidden.index_select(0, sample_index)
        spec = any(s.num_draft_tokens for s in sampled_rows)
        # One logits row per position of a request with drafts (each seeing the drafts before it
        # as its output so far), one per other sampled request.
        rows = [v for s in sampled_rows for v in position_rows(s)] if spec else sampled_rows
        if self.fused_greedy and not spec and not want_probs and plain_greedy(rows):
            out = SamplerOutput(self.model.greedy_tokens(sampled).tolist(), None)
        else:
            logits = self.model.compute_logits(sampled)
            if self.device.type != "cpu":
                logits = logits.cpu()  # the sampler (penalties, seeds, logprobs) runs on the host
            out = self.sampler(logits, rows)  # grammar rows come back masked, each draft position its own
        # Back to the scheduler's order.
        by_id: dict[str, int] = {}
        spec_toks: dict[str, list[int]] = {}
        spec_lps: dict[str, list[TokenLogprobs | None]] = {}
        i = 0
        for s in sampled_rows:
            by_id[s.request_id] = i
            if s.num_draft_tokens:
                n = 1 + s.num_draft_tokens
                q = self.draft_probs(s.request_id) if self.draft_probs is not None else None
                if q is not None and not s.sampling_params.greedy:
                    # Drafts sampled from a draft model's q: min(1, p/q), else the residual.
                    view = rows[i : i + n]
                    p = self.sampler.probs(logits[i : i + n], view)
                    accepted = rejection_sample(p, q[: n - 1], s.draft_token_ids, self.sampler.uniforms(view[:-1], 2),
                                                self.sampler.uniforms(view, 3))
                    if s.sampling_params.logprobs is not None:
                        m = len(accepted)
                        spec_lps[s.request_id] = gather_logprobs(torch.log_softmax(logits[i : i + m], dim=-1),
                                                                 accepted, view[:m])
                else:
                    accepted = accept_greedy(s.draft_token_ids, out.token_ids[i : i + n])
                    if out.logprobs is not None:
                        spec_lps[s.request_id] = out.logprobs[i : i + len(accepted)]
                spec_toks[s.request_id] = accepted
            i += 1 + s.num_draft_tokens
        ids = [s.request_id for s in so.scheduled if s.sample]
        toks = [out.token_ids[by_id[r]] for r in ids]
        lps = [out.logprobs[by_id[r]] for r in ids] if out.logprobs is not None else None
        probs = None
        if want_probs:
            probs = self.sampler.probs(logits, rows).index_select(0, torch.tensor([by_id[r] for r in ids]))
        return ModelRunnerOutput(ids, toks, lps, time.perf_counter() - t0, prompt_lps, prompt_rows or None,
                                 spec_toks or None, spec_lps or None, probs)

    def _prompt_logprobs(
        self, hidden: torch.Tensor, ordered: list[ScheduledRequest]
    ) -> tuple[dict[str, tuple[int, list[TokenLogprobs]]], dict[str, tuple[int, object]]]:
        """Prompt logprobs from this step's own hidden states (no second pass): for each chunk of
        a request that asked, the log-softmax of the lm_head output at every row that predicts
        a prompt token (row j of a chunk at start_pos predicts the token at start_pos + j + 1),
        raw like the sampler's logprobs (no temperature or penalties). Rows follow `ordered`,
        the flat batch's order. Returns request id → (first position predicted, entries), and
        for requests with prompt_logprobs=-1 request id → (that position, the whole rows as a
        float32 numpy array): perplexity's KL divergence needs every token's probability."""
        spans: list[tuple[ScheduledRequest, int, int]] = []  # (request, its first row, rows that predict prompt tokens)
        row = 0
        for s in ordered:
            n = len(s.token_ids)
            if s.sampling_params.prompt_logprobs is not None:
                m = min(n, len(s.prompt_token_ids) - 1 - s.start_pos)
                if m > 0:
                    spans.append((s, row, m))
            row += n
        if not spans:
            return {}, {}
        index = torch.cat([torch.arange(r, r + m) for _, r, m in spans]).to(hidden.device)
        targets = torch.tensor(
            [t for s, _, m in spans for t in s.prompt_token_ids[s.start_pos + 1 : s.start_pos + 1 + m]], dtype=torch.long
        ).to(hidden.device)
        k_max = max(max(s.sampling_params.prompt_logprobs or 0, 0) for s, _, _ in spans)
        whole = [s.sampling_params.prompt_logprobs == -1 for s, _, _ in spans]
        keep = torch.cat([torch.full((m,), w) for (_, _, m), w in zip(spans, whole)]) if any(whole) else None
        vals, ranks, top_vals, top_ids, kept = [], [], [], [], []
        for a in range(0, index.numel(), PROMPT_LOGPROB_ROWS):
            logits = self.model.compute_logits(hidden.index_select(0, index[a : a + PROMPT_LOGPROB_ROWS]))
            lp = torch.log_softmax(logits, dim=-1)
            val = lp.gather(1, targets[a : a + PROMPT_LOGPROB_ROWS].unsqueeze(1))
            vals.append(val.squeeze(1))
            ranks.append((lp > val).sum(dim=1) + 1)
            if k_max:
                v, i = lp.topk(k_max, dim=-1)
                top_vals.append(v)
                top_ids.append(i)
            if keep is not None:
                kept.append(lp[keep[a : a + PROMPT_LOGPROB_ROWS].to(lp.device)].float().cpu())
        val_list = torch.cat(vals).tolist()
        rank_list = torch.cat(ranks).tolist()
        tv = torch.cat(top_vals).tolist() if k_max else None
        ti = torch.cat(top_ids).tolist() if k_max else None
        out: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        rows: dict[str, tuple[int, object]] = {}
        all_kept = torch.cat(kept).numpy() if kept else None
        j = kj = 0
        for (s, _, m), w in zip(spans, whole):
            k = max(s.sampling_params.prompt_logprobs or 0, 0)
            entries: list[TokenLogprobs] = []
            for p in range(s.start_pos + 1, s.start_pos + 1 + m):
                top = [Logprob(t, x, r + 1) for r, (t, x) in enumerate(zip(ti[j][:k], tv[j][:k]))] if k else []
                entries.append((Logprob(s.prompt_token_ids[p], val_list[j], rank_list[j]), top))
                j += 1
            out[s.request_id] = (s.start_pos + 1, entries)
            if w:
                rows[s.request_id] = (s.start_pos + 1, all_kept[kj : kj + m])
                kj += m
        return out, rows

    def _prepare(
        self, decodes: list[ScheduledRequest], prefills: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None]:
        """The flat batch's token ids, positions and attention metadata, and the rows whose last
        position samples: None when every row does (a decode-only step: no gather to pay for)."""
        bs = self.block_size
        if any(s.num_draft_tokens for s in decodes):  # drafts: one decode row per position
            pairs = [(s, j) for s in decodes for j in range(len(s.token_ids))]
            decodes = [s for s, _ in pairs]
            ids = [s.token_ids[j] for s, j in pairs]
            pos = [s.start_pos + j for s, j in pairs]
        else:
            # Decodes (every step, batch 32-64): one comprehension per list, no per-request tensors.
            ids = [s.token_ids[0] for s in decodes]
            pos = [s.start_pos for s in decodes]
        nd = len(decodes)
        slots = [s.block_ids[p // bs] * bs + p % bs for s, p in zip(decodes, pos)]
        decode_lens = [p + 1 for p in pos]  # the new token is written before it attends
        for s in prefills:
            n = len(s.token_ids)
            ids.extend(s.token_ids)
            pos.extend(range(s.start_pos, s.start_pos + n))
            table = s.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(s.start_pos, s.start_pos + n))
        # One conversion for the three lists (each torch.tensor call has a fixed cost).
        flat = torch.tensor([ids, pos, slots], dtype=torch.long)
        input_ids, positions, slot_mapping = flat[0], flat[1], flat[2]

        decode_group = None
        if decodes:
            decode_group = self._decode_group(decodes, decode_lens)
        prefill = self._prefill_batch(prefills, nd) if prefills else None
        meta = AttentionMetadata(slot_mapping, nd, decode_group, prefill)

        # Rows whose last position samples, in decodes-then-prefills order.
        sample_index = [i for i, s in enumerate(decodes) if s.sample]
        off = nd
        for s in prefills:
            off += len(s.token_ids)
            if s.sample:
                sample_index.append(off - 1)
        if len(sample_index) == len(ids):  # every row, in order (the indices ascend)
            return input_ids, positions, meta, None
        return input_ids, positions, meta, torch.tensor(sample_index, dtype=torch.long)

    def _prefill_batch(self, prefills: list[ScheduledRequest], row: int) -> PrefillBatch:
        """The step's prefill chunks from flat-batch row `row` on: fresh chunks (start 0) in runs
        of one length, continuing chunks with their block tables (one tensor conversion), and the
        causal mask band when some query tile starts past position 0."""
        bs = self.block_size
        fresh: list[FreshRun] = []
        continuing: list[ContinuingChunk] = []
        tables: list[list[int]] = []
        longest = max_context = 0
        for s in prefills:
            n = len(s.token_ids)
            longest = max(longest, n)
            max_context = max(max_context, s.start_pos + n)
            if s.start_pos > 0:
                continuing.append(ContinuingChunk(row, n, s.start_pos))
                tables.append(s.block_ids[: -(-(s.start_pos + n) // bs)])
            elif fresh and fresh[-1].num_tokens == n and fresh[-1].row + fresh[-1].count * n == row:
                last = fresh[-1]
                fresh[-1] = FreshRun(last.row, last.count + 1, n)
            else:
                fresh.append(FreshRun(row, 1, n))
            row += n
        tile = prefill_tile(self.device, longest)
        block_tables = padded_block_tables(tables, torch.long) if tables else None
        # A step of fresh chunks that are each one `is_causal` call (no longer than a tile, or
        # longer than TILED_FRESH_MAX) needs no mask.
        tiled = continuing or any(tile < r.num_tokens <= TILED_FRESH_MAX for r in fresh)
        bias = causal_bias_band(tile, max_context, self.precision.compute) if tiled else None
        return PrefillBatch(tuple(fresh), tuple(continuing), block_tables, bs, tile, bias)

    def _decode_group(self, decodes: list[ScheduledRequest], ctx_lens: list[int]) -> PagedDecode | GatheredDecode:
        """The step's decodes, attended in one call: block tables and context lengths for the paged
        decode kernel (the "paged" attention backend), else the padded slot table and mask for
        SDPA. Decode b's one query sits at position ctx_lens[b] - 1 and sees positions
        0 .. ctx_lens[b] - 1."""
        bs = self.block_size
        paged = self.backends.paged_decode
        tables = padded_block_tables([s.block_ids[: -(-n // bs)] for s, n in zip(decodes, ctx_lens)],
                                     torch.int32 if paged else torch.long)
        if paged:
            return PagedDecode(tables, torch.tensor(ctx_lens, dtype=torch.int32), bs)
        starts = torch.tensor(ctx_lens, dtype=torch.long) - 1
        return GatheredDecode(*padded_slots_and_mask(tables, bs, starts, 1, max(ctx_lens)))


def describe_kv_dtype(dtype: torch.dtype) -> str:
    """The K/V storage in words, for the load log."""
    return "int8 (codes + a float32 scale per token and KV head)" if dtype == torch.int8 else dtype_name(dtype)


def padded_block_tables(tables: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    """Requests' block lists as one [B, longest] tensor, zero-padded, in one conversion."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=dtype)
