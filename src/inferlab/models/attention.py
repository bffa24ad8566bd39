"""Paged attention on the CPU: write each new token's K/V into its cache slot, then attend
over the request's blocks.

The KV cache of one layer is a pair of tensors laid out head-major,

    k_cache, v_cache: [num_kv_heads, num_blocks * block_size, head_dim]

so that one KV head's block of block_size tokens is block_size contiguous rows (what the decode
kernel streams), and gathering a batch of block tables with one `index_select` on dim 1 lands
directly in the [batch, kv_heads, context, head_dim] shape that scaled_dot_product_attention
wants (a token-major layout would need a second copy to transpose). A token at position p of a
request lives in slot `block_ids[p // B] * B + p % B`.

The flat batch is ordered decodes first, then prefill chunks (the model runner sorts it):

    tokens:  | d0 d1 ... d(n-1) | prefill chunk a ......... | prefill chunk b .... |
             |<- one token each ->|<- one or more requests with several tokens ->|

Decodes go to our paged-attention kernel (`torch.ops.inferlab.paged_attention_decode`, see
kernels/csrc/attention.cpp) when it is built: it reads K/V straight from the blocks through the
block tables. Otherwise (INFERLAB_KERNELS=0, no compiler, another cache dtype) they are one
batched SDPA call over contexts gathered out of the cache and padded, with a mask; the results
agree to float32 rounding. Prefill chunks are a second SDPA call over padded query blocks.
Two calls per layer, whatever the number of requests.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

from inferlab.kernels import build

# Tests set this to False to run the SDPA fallback while the kernels are built.
USE_DECODE_KERNEL = True
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class BatchGroup:
    """Requests attended together in one call.

    For SDPA: `slots` and `mask`, padded to the longest context. For the decode kernel:
    `block_tables`, `context_lens` and `block_size` instead (slots and mask stay None; building
    them is per-step work the kernel does not need).
    """

    slots: torch.Tensor | None = None  # [B, L] long: cache slots of each request's context positions 0..L-1 (padded)
    mask: torch.Tensor | None = None  # [B, 1, Q, L] bool: True = attend (causal within the context, padding off)
    # Prefill only: positions of this group's queries in the flat batch, [B, Q] long (padding
    # points at a scratch row), and which rows of the padded [B * Q] block are real queries, in
    # flat-batch order (prefill tokens are contiguous after the decodes).
    query_index: torch.Tensor | None = None
    valid_rows: torch.Tensor | None = None
    # Decode kernel only: each request's blocks in order, zero-padded, [B, max_blocks] int32;
    # its context length (the new token included), [B] int32; tokens per block.
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    block_size: int = 0


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


def meta_to(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """The same metadata with its tensors on `device` (the runner builds it on the host)."""

    def move(g: BatchGroup | None) -> BatchGroup | None:
        if g is None:
            return None
        return replace(g, **{f.name: getattr(g, f.name).to(device, non_blocking=True) for f in fields(g)
                             if isinstance(getattr(g, f.name), torch.Tensor)})

    return replace(meta, slot_mapping=meta.slot_mapping.to(device, non_blocking=True), decode=move(meta.decode),
                   prefill=move(meta.prefill))


def decode_kernel_enabled(dtype: torch.dtype) -> bool:
    """Whether decodes over a cache of this dtype go to the paged-attention kernel (the model
    runner asks once per step, and then builds block tables instead of slots and a mask)."""
    return USE_DECODE_KERNEL and dtype in KERNEL_DTYPES and build.available()


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


def padded_slots_and_mask(
    block_tables: torch.Tensor, block_size: int, starts: torch.Tensor, max_queries: int, max_context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SDPA path's view of a group: [B, L] slots and a [B, 1, Q, L] mask.

    block_tables: [B, >= ceil(L / block_size)] (zero-padded past each request's blocks);
    query i of request b sits at position starts[b] + i and sees context positions
    0 .. starts[b] + i. Padding positions point at real slots (block 0) and are masked off.
    """
    b, nblk = block_tables.shape
    table = block_tables.long()
    slots = (table.unsqueeze(2) * block_size + torch.arange(block_size)).view(b, nblk * block_size)
    slots = slots[:, :max_context].contiguous()
    key_pos = torch.arange(max_context).view(1, 1, max_context)
    q_pos = starts.view(b, 1, 1) + torch.arange(max_queries).view(1, max_queries, 1)
    mask = key_pos <= q_pos  # causal; also hides padding since ctx_len = start + q_len
    return slots, mask.unsqueeze(1)


def _gather_context(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[kvH, S, D] cache, [B, L] slots -> [B, kvH, L, D] (a strided view of one gathered copy)."""
    b, l = slots.shape
    g = cache.index_select(1, slots.reshape(-1))  # [kvH, B*L, D]
    return g.view(cache.shape[0], b, l, cache.shape[2]).transpose(0, 1)


def decode_attention_sdpa(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """The fallback (and the tests' reference): q [B, H, D] -> [B, H, D] over gathered contexts."""
    kd = _gather_context(k_cache, slots)
    vd = _gather_context(v_cache, slots)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(2)


def decode_attention_kernel(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D], K/V read through the block tables; needs `build.available()`."""
    return torch.ops.inferlab.paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, block_size, scale)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, kvH, D]
    v: torch.Tensor,  # [T, kvH, D]
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
    kv_written: bool = False,
) -> torch.Tensor:
    """Write k/v into the cache (unless `kv_written`: a fused op already did), attend, return
    [T, H * D]."""
    k_cache, v_cache = kv_cache
    if not kv_written:
        k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))

    t, h, d = q.shape
    nd = meta.num_decode_tokens
    decoded = None
    if meta.decode is not None:
        g = meta.decode
        if g.slots is None:  # the runner built block tables: decode_kernel_enabled() said yes
            assert g.block_tables is not None and g.context_lens is not None
            decoded = decode_attention_kernel(q[:nd], k_cache, v_cache, g.block_tables, g.context_lens,
                                              g.block_size, scale)
        else:
            assert g.mask is not None
            decoded = decode_attention_sdpa(q[:nd], k_cache, v_cache, g.slots, g.mask, scale)
        if nd == t:  # all decodes (most steps): no copy into a shared output
            return decoded.reshape(t, h * d)
    out = q.new_empty(t, h, d)
    if decoded is not None:
        out[:nd] = decoded
    if meta.prefill_is_fresh:
        qp = q[nd:].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
        kp = k[nd:].transpose(0, 1).unsqueeze(0)
        vp = v[nd:].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
        out[nd:] = o[0].transpose(0, 1)
    elif meta.prefill is not None:
        g = meta.prefill
        assert g.slots is not None and g.mask is not None
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
