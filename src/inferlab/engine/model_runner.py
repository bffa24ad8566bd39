"""Turns a `SchedulerOutput` into tensors, runs one forward pass for the whole flat batch,
samples, and returns a `ModelRunnerOutput`. Knows nothing of queues.

The batch is laid out decodes first, then prefill chunks (see models/attention.py), whatever
order the scheduler listed the requests in; the output maps back to the scheduler's order.
"""

from __future__ import annotations

import time

import torch

from inferlab.config import CacheConfig, LoadConfig, ModelConfig
from inferlab.engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from inferlab.engine.sampler import Sampler
from inferlab.models.attention import AttentionMetadata, BatchGroup, allocate_kv_cache
from inferlab.models.decoder import DecoderModel
from inferlab.models.loader import resolve_dtype

DEFAULT_KV_CACHE_BYTES = 1 << 30  # 1 GiB on the CPU when nothing else is said


def num_kv_blocks(model: ModelConfig, cache: CacheConfig, dtype: torch.dtype) -> int:
    """Blocks that fit the KV budget: 2 (K, V) x layers x kv heads x head dim x bytes, per token."""
    if cache.num_blocks_override is not None:
        return cache.num_blocks_override
    budget = cache.kv_cache_memory or DEFAULT_KV_CACHE_BYTES
    elem = torch.empty((), dtype=dtype).element_size()
    per_block = 2 * model.num_layers * model.num_kv_heads * model.head_dim * elem * cache.block_size
    n = budget // per_block
    if n < 1:
        raise ValueError(f"kv_cache_memory of {budget} bytes holds no block of {per_block} bytes")
    return int(n)


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        weights: dict[str, torch.Tensor],
        load_config: LoadConfig,
        cache_config: CacheConfig,
    ):
        self.model_config = model_config
        self.dtype = resolve_dtype(load_config.dtype, load_config.device)
        self.block_size = cache_config.block_size
        self.model = DecoderModel(model_config, weights, self.dtype)
        self.num_blocks = num_kv_blocks(model_config, cache_config, self.dtype)
        self.kv_caches = allocate_kv_cache(
            model_config.num_layers,
            model_config.num_kv_heads,
            model_config.head_dim,
            self.num_blocks * self.block_size,
            self.dtype,
        )
        self.sampler = Sampler(load_config.seed)

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        decodes = [s for s in so.scheduled if len(s.token_ids) == 1]
        prefills = [s for s in so.scheduled if len(s.token_ids) > 1]
        ordered = decodes + prefills
        input_ids, positions, meta, sample_index = self._prepare(decodes, prefills)
        hidden = self.model.forward(input_ids, positions, self.kv_caches, meta)
        sampled_rows = [s for s in ordered if s.sample]
        if not sampled_rows:
            return ModelRunnerOutput([], [], None, time.perf_counter() - t0)
        logits = self.model.compute_logits(hidden.index_select(0, sample_index))
        out = self.sampler(logits, sampled_rows)
        # Back to the scheduler's order.
        by_id = {s.request_id: i for i, s in enumerate(sampled_rows)}
        ids = [s.request_id for s in so.scheduled if s.sample]
        toks = [out.token_ids[by_id[r]] for r in ids]
        lps = [out.logprobs[by_id[r]] for r in ids] if out.logprobs is not None else None
        return ModelRunnerOutput(ids, toks, lps, time.perf_counter() - t0)

    def _prepare(
        self, decodes: list[ScheduledRequest], prefills: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for s in decodes:
            p = s.start_pos
            ids.append(s.token_ids[0])
            pos.append(p)
            slots.append(s.block_ids[p // bs] * bs + p % bs)
        for s in prefills:
            n = len(s.token_ids)
            ids.extend(s.token_ids)
            pos.extend(range(s.start_pos, s.start_pos + n))
            table = s.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(s.start_pos, s.start_pos + n))
        t = len(ids)
        input_ids = torch.tensor(ids, dtype=torch.long)
        positions = torch.tensor(pos, dtype=torch.long)
        slot_mapping = torch.tensor(slots, dtype=torch.long)

        nd = len(decodes)
        decode_group = None
        if decodes:
            lens = [s.start_pos + 1 for s in decodes]
            decode_group = self._group(decodes, lens, [1] * nd, [s.start_pos for s in decodes])
        fresh = len(prefills) == 1 and prefills[0].start_pos == 0
        prefill_group = None
        if prefills and not fresh:
            q_lens = [len(s.token_ids) for s in prefills]
            lens = [s.start_pos + q for s, q in zip(prefills, q_lens)]
            prefill_group = self._group(prefills, lens, q_lens, [s.start_pos for s in prefills])
            qmax = max(q_lens)
            qi = torch.full((len(prefills), qmax), t, dtype=torch.long)
            rows: list[int] = []
            off = nd
            for b, q in enumerate(q_lens):
                qi[b, :q] = torch.arange(off, off + q)
                rows.extend(range(b * qmax, b * qmax + q))
                off += q
            prefill_group.query_index = qi
            prefill_group.valid_rows = torch.tensor(rows, dtype=torch.long)
        meta = AttentionMetadata(slot_mapping, nd, decode_group, prefill_group, prefill_is_fresh=fresh)

        # Rows whose last position samples, in decodes-then-prefills order.
        sample_index: list[int] = []
        off = 0
        for s in decodes + prefills:
            off += len(s.token_ids)
            if s.sample:
                sample_index.append(off - 1)
        return input_ids, positions, meta, torch.tensor(sample_index, dtype=torch.long)

    def _group(
        self, reqs: list[ScheduledRequest], ctx_lens: list[int], q_lens: list[int], starts: list[int]
    ) -> BatchGroup:
        """Padded slot table and mask for requests attended in one call.

        Query i of request b sits at position starts[b] + i and may see context positions
        0 .. starts[b] + i; positions past ctx_lens[b] are padding.
        """
        bs = self.block_size
        b = len(reqs)
        lmax = max(ctx_lens)
        nblk = (lmax + bs - 1) // bs
        table = torch.zeros(b, nblk, dtype=torch.long)
        for i, s in enumerate(reqs):
            need = (ctx_lens[i] + bs - 1) // bs
            table[i, :need] = torch.tensor(s.block_ids[:need], dtype=torch.long)
        slots = (table.unsqueeze(2) * bs + torch.arange(bs)).view(b, nblk * bs)[:, :lmax]
        qmax = max(q_lens)
        key_pos = torch.arange(lmax).view(1, 1, lmax)
        q_pos = torch.tensor(starts).view(b, 1, 1) + torch.arange(qmax).view(1, qmax, 1)
        mask = key_pos <= q_pos  # causal; also hides padding since ctx_len = start + q_len
        return BatchGroup(slots=slots.contiguous(), mask=mask.unsqueeze(1))
