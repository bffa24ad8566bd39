"""Paged attention on the CPU: write each new token's K/V into its cache slot, then attend
over the request's blocks.

The KV cache of one layer is a pair of tensors laid out head-major,

    k_cache, v_cache: [num_kv_heads, num_blocks * block_size, head_dim]

so that gathering a batch of block tables with one `index_select` on dim 1 lands directly in
the [batch, kv_heads, context, head_dim] shape that scaled_dot_product_attention wants (a
token-major layout would need a second copy to transpose). A token at position p of a
request lives in slot `block_ids[p // B] * B + p % B`.

The flat batch is ordered decodes first, then prefill chunks (the model runner sorts it):

    tokens:  | d0 d1 ... d(n-1) | prefill chunk a ......... | prefill chunk b .... |
             |<- one token each ->|<- one or more requests with several tokens ->|

Decodes are one batched SDPA call over padded contexts; prefill chunks are a second call over
padded query blocks. Two calls per layer, whatever the number of requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class BatchGroup:
    """Requests attended together in one SDPA call (padded to the longest)."""

    slots: torch.Tensor  # [B, L] long: cache slots of each request's context positions 0..L-1 (padded)
    mask: torch.Tensor  # [B, 1, Q, L] bool: True = attend (causal within the context, padding off)
    # Prefill only: positions of this group's queries in the flat batch, [B, Q] long (padding
    # points at a scratch row), and which rows of the padded [B * Q] block are real queries, in
    # flat-batch order (prefill tokens are contiguous after the decodes).
    query_index: torch.Tensor | None = None
    valid_rows: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """What attention needs to know about one step's flat batch; shared by all layers."""

    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V is written
    num_decode_tokens: int  # the first num_decode_tokens tokens are single-token requests
    decode: BatchGroup | None
    prefill: BatchGroup | None
    # A lone prefill chunk starting at position 0 needs no cache reads: plain causal attention
    # over its own fresh K/V (the common case of a new prompt).
    prefill_is_fresh: bool = False


def allocate_kv_cache(
    num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int, dtype: torch.dtype, device: str = "cpu"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer. Zero-filled: padded context positions point at real slots
    whose contents are masked out, and masked-out NaNs would still poison the output (0 * NaN)."""
    return [
        (
            torch.zeros(num_kv_heads, num_slots, head_dim, dtype=dtype, device=device),
            torch.zeros(num_kv_heads, num_slots, head_dim, dtype=dtype, device=device),
        )
        for _ in range(num_layers)
    ]


def _gather_context(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[kvH, S, D] cache, [B, L] slots -> [B, kvH, L, D] (a strided view of one gathered copy)."""
    b, l = slots.shape
    g = cache.index_select(1, slots.reshape(-1))  # [kvH, B*L, D]
    return g.view(cache.shape[0], b, l, cache.shape[2]).transpose(0, 1)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, kvH, D]
    v: torch.Tensor,  # [T, kvH, D]
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write k/v into the cache, attend, return [T, H * D]."""
    k_cache, v_cache = kv_cache
    k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))

    t, h, d = q.shape
    out = q.new_empty(t, h, d)
    nd = meta.num_decode_tokens
    if meta.decode is not None:
        g = meta.decode
        qd = q[:nd].unsqueeze(2)  # [B, H, 1, D]
        kd = _gather_context(k_cache, g.slots)
        vd = _gather_context(v_cache, g.slots)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask, scale=scale, enable_gqa=True)
        out[:nd] = o.squeeze(2)
    if meta.prefill_is_fresh:
        qp = q[nd:].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
        kp = k[nd:].transpose(0, 1).unsqueeze(0)
        vp = v[nd:].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
        out[nd:] = o[0].transpose(0, 1)
    elif meta.prefill is not None:
        g = meta.prefill
        assert g.query_index is not None and g.valid_rows is not None
        b, qn = g.query_index.shape
        # A scratch zero row at index T absorbs the padded query positions.
        q_ext = torch.cat([q, q.new_zeros(1, h, d)], 0)
        qp = q_ext.index_select(0, g.query_index.reshape(-1)).view(b, qn, h, d).transpose(1, 2)
        kp = _gather_context(k_cache, g.slots)
        vp = _gather_context(v_cache, g.slots)
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=g.mask, scale=scale, enable_gqa=True)
        o = o.transpose(1, 2).reshape(b * qn, h, d)
        out[nd:] = o.index_select(0, g.valid_rows)
    return out.view(t, h * d)
