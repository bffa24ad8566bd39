"""Paged attention on the CPU: write each new token's K/V into its cache slot, then attend
over the request's blocks.

The KV cache of one layer (a `KVCache`, models/kv_cache.py) is a pair of tensors laid out
head-major, plus one scale per (head, slot) each when they hold int8 codes,

    k_cache, v_cache: [num_kv_heads, num_blocks * block_size, head_dim]
    k_scale, v_scale: [num_kv_heads, num_blocks * block_size]   (int8 only)

so that one KV head's block of block_size tokens is block_size contiguous rows (what the decode
kernel streams), and gathering a batch of block tables with one `index_select` on dim 1 lands
directly in the [batch, kv_heads, context, head_dim] shape that scaled_dot_product_attention
wants (a token-major layout would need a second copy to transpose). A token at position p of a
request lives in slot `block_ids[p // B] * B + p % B`.

The flat batch is ordered decodes first, then prefill chunks (the model runner sorts it):

    tokens:  | d0 d1 ... d(n-1) | prefill chunk a ......... | prefill chunk b .... |
             |<- one token each ->|<- one or more requests with several tokens ->|

Decodes go to our paged-attention kernel (`torch.ops.inferlab.paged_attention_decode`, see
kernels/csrc/attention.cpp; the metadata is a `PagedDecode`) where the engine chose the "paged"
attention backend (models/backends.py: the kernels loaded, a cache dtype it reads, the CPU): it
reads K/V straight from the blocks through the block tables. Otherwise (a `GatheredDecode`) they
are one batched SDPA call over contexts gathered out of the cache and padded, with a mask; the
results agree to float32 rounding.

Prefill chunks are attended chunk by chunk, never padded to each other:

- a chunk that starts at position 0 (a fresh prompt) reads no cache: causal attention over its
  own new K/V. Consecutive fresh chunks of one length go together as one batch.
- a chunk that continues a prompt (chunked prefill, a prefix-cache hit) gathers its own context
  from its blocks, and query i (at position start + i) sees keys 0 .. start + i: a causal mask
  aligned to the bottom-right corner of its [queries, context] square.

On the CPU each chunk's queries go in tiles of `CPU_PREFILL_TILE`, each tile over only the keys
its queries can see (`attend_causal`): torch's CPU flash kernel works in 512-key blocks and
computes a block whole, so one causal call over a few hundred tokens costs the full square.
(Fresh chunks past `TILED_FRESH_MAX` tokens are the exception: one call does better there.)
Where our kernels run the model (`ResolvedPrecision.prefill_attention`), prefill goes to our
flash attention instead (`flash_attention`, kernels/csrc/prefill_attention.cpp: bf16 or float32
products): causal by blocks of keys, and continuing chunks read their context from the blocks in
place rather than gathering it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

from inferlab.models.kv_cache import KVCache, dequantize_kv, write_kv

# Queries per SDPA call for prefill on the CPU. Measured on SmolLM2's shapes (9 heads over 3 KV
# heads of 64, 2 threads): 64 is the best or near it for 256-token prompts and continued chunks.
CPU_PREFILL_TILE = 64
# A fresh chunk longer than this is one `is_causal` call instead: past one of the CPU kernel's
# 512-key blocks it skips whole blocks itself, and its larger query blocks beat our masked tiles
# (a 2,048-token prompt: 0.83-0.93x tiled).
TILED_FRESH_MAX = 512


@dataclass
class PagedDecode:
    """Decodes attended in one call of our paged-attention kernel (the "paged" backend): it reads
    K/V through the block tables, so nothing is gathered or masked per step."""

    block_tables: torch.Tensor  # [B, max_blocks] int32: each request's blocks in order, zero-padded
    context_lens: torch.Tensor  # [B] int32: each context's length, the new token included
    block_size: int  # tokens per block


@dataclass
class GatheredDecode:
    """Decodes attended in one SDPA call (the "sdpa" backend) over contexts gathered from the
    cache and padded to the longest."""

    slots: torch.Tensor  # [B, L] long: cache slots of each request's context positions 0..L-1 (padded)
    mask: torch.Tensor  # [B, 1, Q, L] bool: True = attend (causal within the context, padding off)


@dataclass(frozen=True)
class FreshRun:
    """`count` prompt chunks of `num_tokens` tokens each, all starting at position 0, one after
    another in the flat batch from row `row` on: causal attention over their own new K/V, as one
    batch of `count` (no cache reads, no padding)."""

    row: int
    count: int
    num_tokens: int


@dataclass(frozen=True)
class ContinuingChunk:
    """A prompt chunk after `start` tokens already in the cache (chunked prefill, a prefix-cache
    hit): flat-batch rows row .. row + num_tokens - 1 at positions start .. start + num_tokens - 1.
    It attends over its first start + num_tokens positions, gathered from its blocks."""

    row: int
    num_tokens: int
    start: int


@dataclass
class PrefillBatch:
    """A step's prefill chunks (the flat batch's rows after the decodes), attended chunk by chunk.

    Every tile of `tile` queries at positions o .. o + r - 1 (r <= tile) of one chunk attends over
    keys 0 .. o + r - 1 with the additive mask `causal_bias[:r, M - o : M + r]`, M = max_context:

        causal_bias[i, c] = 0 if c - i <= M else -inf          [tile, M + tile]
        slice[i, c] = causal_bias[i, M - o + c] = 0 iff c <= o + i  (query o + i sees keys 0..o + i)

    One float tensor per step, sliced (a view) for every tile of every chunk in every layer: a
    bool mask would be converted to a float one inside every SDPA call.
    """

    fresh: tuple[FreshRun, ...] = ()
    continuing: tuple[ContinuingChunk, ...] = ()
    # [len(continuing), max_blocks] long: each continuing chunk's blocks in order, zero-padded
    # (only the first ceil((start + num_tokens) / block_size) of a row are read).
    block_tables: torch.Tensor | None = None
    block_size: int = 0
    tile: int = CPU_PREFILL_TILE  # queries per SDPA call
    # The mask band above, in the activations' dtype; None when no tile starts past position 0
    # (such a tile is plain `is_causal` attention).
    causal_bias: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """What attention needs to know about one step's flat batch; shared by all layers."""

    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V is written
    num_decode_tokens: int  # the first num_decode_tokens tokens are single-token requests
    decode: PagedDecode | GatheredDecode | None
    prefill: PrefillBatch | None


def meta_to(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """The same metadata with its tensors on `device` (the runner builds it on the host)."""

    def move(g: PagedDecode | GatheredDecode | PrefillBatch | None) -> PagedDecode | GatheredDecode | PrefillBatch | None:
        if g is None:
            return None
        return replace(g, **{f.name: getattr(g, f.name).to(device, non_blocking=True) for f in fields(g)
                             if isinstance(getattr(g, f.name), torch.Tensor)})

    return replace(meta, slot_mapping=meta.slot_mapping.to(device, non_blocking=True), decode=move(meta.decode),
                   prefill=move(meta.prefill))


def prefill_tile(device: torch.device, longest_chunk: int) -> int:
    """Queries per prefill SDPA call: `CPU_PREFILL_TILE` on the CPU (see the module docstring);
    elsewhere the whole chunk, since a GPU's flash kernels skip masked-out blocks themselves and
    each extra call is a launch."""
    return CPU_PREFILL_TILE if device.type == "cpu" else max(longest_chunk, 1)


def causal_bias_band(tile: int, max_context: int, dtype: torch.dtype) -> torch.Tensor:
    """`PrefillBatch.causal_bias`: [tile, max_context + tile], 0 where c - i <= max_context, -inf
    elsewhere."""
    c = torch.arange(max_context + tile).view(1, -1)
    i = torch.arange(tile).view(-1, 1)
    return torch.zeros(tile, max_context + tile, dtype=dtype).masked_fill_(c - i > max_context, float("-inf"))


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
    """[kvH, S, ...] cache (rows, or an int8 cache's scales), [B, L] slots -> [B, kvH, L, ...]
    (a strided view of one gathered copy)."""
    b, length = slots.shape
    g = cache.index_select(1, slots.reshape(-1))  # [kvH, B*L, ...]
    return g.view(cache.shape[0], b, length, *cache.shape[2:]).transpose(0, 1)


def _gathered_rows(cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """One of K or V gathered for `slots` in `dtype`: int8 codes dequantized with their scales."""
    rows = _gather_context(cache, slots)
    return rows.to(dtype) if scale is None else dequantize_kv(rows, _gather_context(scale, slots), dtype)


def decode_attention_sdpa(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
    scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fallback (and the tests' reference): q [B, H, D] -> [B, H, D] over gathered contexts.
    k_scale / v_scale [kvH, slots]: the caches are int8 codes (models/kv_cache.py)."""
    kd = _gathered_rows(k_cache, k_scale, slots, q.dtype)
    vd = _gathered_rows(v_cache, v_scale, slots, q.dtype)
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    bf16_dot: bool = False,
) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D], K/V read through the block tables; needs our kernels.
    With k_scale / v_scale the caches are int8 codes, dequantized in registers. `bf16_dot`
    (`ResolvedPrecision.bf16_decode_attention`, a bfloat16 cache): q and P rounded to bf16 and
    multiplied by vdpbf16ps, else float32 arithmetic."""
    return torch.ops.inferlab.paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, block_size, scale,
                                                     k_scale, v_scale, bf16_dot)


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """[kvH, S, ...] cache (rows, or an int8 cache's scales), one request's blocks in order -> its
    positions 0 .. length - 1, as [1, kvH, length, ...]: one copy of whole blocks (block_size
    contiguous rows per index, where a slot table would index every token)."""
    kvh, slots = cache.shape[:2]
    rest = cache.shape[2:]
    g = cache.view(kvh, slots // block_size, block_size, *rest).index_select(1, blocks)
    return g.view(1, kvh, -1, *rest)[:, :, :length]


def gather_kv(cache: KVCache, blocks: torch.Tensor, block_size: int, length: int,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one request's positions 0 .. length - 1, [1, kvH, length, D] in `dtype` (int8
    codes dequantized): what a continuing prefill chunk or a prefix-cache hit attends over."""

    def one(rows: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        g = gather_blocks(rows, blocks, block_size, length)
        return g.to(dtype) if scale is None else dequantize_kv(g, gather_blocks(scale, blocks, block_size, length), dtype)

    return one(cache.k, cache.k_scale), one(cache.v, cache.v_scale)


def _run_view(x: torch.Tensor, run: FreshRun) -> torch.Tensor:
    """[T, heads, D] flat-batch rows of a run -> [count, heads, num_tokens, D] (a view)."""
    rows = x[run.row : run.row + run.count * run.num_tokens]
    return rows.unflatten(0, (run.count, run.num_tokens)).transpose(1, 2)


def attend_causal(
    q: torch.Tensor,  # [b, H, n, D]: queries at positions start .. start + n - 1
    k: torch.Tensor,  # [b, kvH, >= start + n, D]: keys at positions 0, 1, ...
    v: torch.Tensor,
    out: torch.Tensor,  # [b, H, n, D], written
    start: int,
    tile: int,
    causal_bias: torch.Tensor | None,
    scale: float,
) -> None:
    """Query at position p sees keys 0 .. p, in SDPA calls of `tile` queries each over only the
    keys they can see (~1/2 + tile/2n of the square for a fresh chunk; see `PrefillBatch` for the
    mask). A tile at position 0 is a square: plain `is_causal`, no mask."""
    n = q.shape[2]
    if start == 0 and n > TILED_FRESH_MAX:
        tile = n
    for j in range(0, n, tile):
        r = min(tile, n - j)
        o = start + j  # position of the tile's first query
        if o == 0:
            res = F.scaled_dot_product_attention(q[:, :, :r], k[:, :, :r], v[:, :, :r], is_causal=True, scale=scale,
                                                 enable_gqa=True)
        else:
            assert causal_bias is not None  # the runner builds it whenever a tile starts past 0
            m = causal_bias.shape[1] - causal_bias.shape[0]  # max_context
            res = F.scaled_dot_product_attention(q[:, :, j : j + r], k[:, :, : o + r], v[:, :, : o + r],
                                                 attn_mask=causal_bias[:r, m - o : m + r], scale=scale,
                                                 enable_gqa=True)
        out[:, :, j : j + r] = res


def prefill_attention(
    q: torch.Tensor,  # [T, H, D], the whole flat batch
    k: torch.Tensor,  # [T, kvH, D]: the new keys (also in the cache by now)
    v: torch.Tensor,
    kv: KVCache,
    p: PrefillBatch,
    out: torch.Tensor,  # [T, H, D]: the prefill rows are written
    scale: float,
    kernel: str = "torch",
) -> None:
    """Every prefill chunk of the step, one at a time (a run of fresh chunks of one length as one
    batch): no padding to the longest chunk, and fresh prompts read nothing from the cache.
    `kernel` (the model's precision decision, `ResolvedPrecision.prefill_attention`): "bfloat16"
    or "float32" for our flash attention with those products (`flash_attention`), "torch" for SDPA."""
    if kernel != "torch" and q.dtype == torch.float32:
        flash_attention(q, k, v, kv, p, out, scale, kernel)
        return
    for run in p.fresh:
        qr, kr, vr, outr = (_run_view(x, run) for x in (q, k, v, out))
        attend_causal(qr, kr, vr, outr, 0, p.tile, p.causal_bias, scale)
    if p.continuing:
        assert p.block_tables is not None
        for chunk, table in zip(p.continuing, p.block_tables):
            n, ctx = chunk.num_tokens, chunk.start + chunk.num_tokens
            blocks = table[: (ctx + p.block_size - 1) // p.block_size]
            kc, vc = gather_kv(kv, blocks, p.block_size, ctx, q.dtype)
            qc = q[chunk.row : chunk.row + n].transpose(0, 1).unsqueeze(0)
            oc = out[chunk.row : chunk.row + n].transpose(0, 1).unsqueeze(0)
            attend_causal(qc, kc, vc, oc, chunk.start, p.tile, p.causal_bias, scale)


# Our flash attention's operators by products (kernels/csrc/prefill_attention.cpp).
_FLASH_OPS = {"bfloat16": ("prefill_attention_bf16", "prefill_attention_paged_bf16"),
              "float32": ("prefill_attention_f32", "prefill_attention_paged_f32")}


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: KVCache,
    p: PrefillBatch,
    out: torch.Tensor,
    scale: float,
    products: str,
) -> None:
    """`prefill_attention` through kernels/csrc/prefill_attention.cpp with `products` "bfloat16"
    or "float32": one call per run of fresh chunks (the rows as they lie in the flat batch, no
    transposes or copies) and one per continuing chunk (its context read from the cache blocks in
    place, no gather; an int8 cache is gathered and dequantized first)."""
    fresh_op, paged_op = (getattr(torch.ops.inferlab, name) for name in _FLASH_OPS[products])
    for run in p.fresh:
        rows = slice(run.row, run.row + run.count * run.num_tokens)
        q4, k4, v4, o4 = (x[rows].unflatten(0, (run.count, run.num_tokens)) for x in (q, k, v, out))
        fresh_op(q4, k4, v4, o4, 0, scale)
    if p.continuing:
        assert p.block_tables is not None
        for chunk, table in zip(p.continuing, p.block_tables):
            ctx = chunk.start + chunk.num_tokens
            rows = slice(chunk.row, chunk.row + chunk.num_tokens)
            blocks = table[: (ctx + p.block_size - 1) // p.block_size]
            if not kv.quantized:
                paged_op(q[rows].unsqueeze(0), kv.k, kv.v, blocks, p.block_size, out[rows].unsqueeze(0),
                         chunk.start, scale)
            else:  # [1, kvH, ctx, D] float32 -> the kernel's [1, ctx, kvH, D] view
                kc, vc = gather_kv(kv, blocks, p.block_size, ctx, q.dtype)
                fresh_op(q[rows].unsqueeze(0), kc.transpose(1, 2), vc.transpose(1, 2), out[rows].unsqueeze(0),
                         chunk.start, scale)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, kvH, D]
    v: torch.Tensor,  # [T, kvH, D]
    kv_cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
    kv_written: bool = False,
    prefill: str = "torch",
    bf16_decode: bool = False,
) -> torch.Tensor:
    """Write k/v into the cache (unless `kv_written`: a fused op already did), attend, return
    [T, H * D]. `prefill`: which prefill attention runs (see prefill_attention); `bf16_decode`:
    the paged decode kernel multiplies in bf16 (see decode_attention_kernel)."""
    c = kv_cache
    if not kv_written:
        write_kv(c, meta.slot_mapping, k, v)

    t, h, d = q.shape
    nd = meta.num_decode_tokens
    decoded = None
    if meta.decode is not None:
        g = meta.decode
        if isinstance(g, PagedDecode):
            decoded = decode_attention_kernel(q[:nd], c.k, c.v, g.block_tables, g.context_lens, g.block_size, scale,
                                              c.k_scale, c.v_scale, bf16_decode)
        else:
            decoded = decode_attention_sdpa(q[:nd], c.k, c.v, g.slots, g.mask, scale, c.k_scale, c.v_scale)
        if nd == t:  # all decodes (most steps): no copy into a shared output
            return decoded.reshape(t, h * d)
    out = q.new_empty(t, h, d)
    if decoded is not None:
        out[:nd] = decoded
    if meta.prefill is not None:
        prefill_attention(q, k, v, c, meta.prefill, out, scale, prefill)
    return out.view(t, h * d)
