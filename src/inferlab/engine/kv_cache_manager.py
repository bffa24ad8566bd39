"""Per-request block tables on top of the `BlockPool`, prefix-cache lookups and chained block hashes.

Pure Python, no torch. A request's block table covers its tokens in order:

    tokens:      | 0 .. B-1 | B .. 2B-1 | 2B .. 3B-1 | 3B .. |
    block table: [  blk 7   ,   blk 2    ,   blk 9    , blk 4 ]
    hashes:      [   h0     ,  h1=H(h0,…), h2=H(h1,…) ]         (full blocks only)

Block i's hash covers tokens [0, (i+1)·B) through the chain, so equal hashes mean equal
prefixes, not merely equal blocks; the first block's hash also mixes in the request's
`cache_salt`, which the chain then carries to every later block (tenants never share).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from inferlab.engine.block_pool import BlockPool, KVBlock
from inferlab.engine.request import Request


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...], extra: tuple | None = None) -> int:
    """Chained hash of one full block: H(parent hash, the block's tokens, extra keys).

    SHA-256 rather than Python's `hash()`: `hash(str)` changes between processes (the planner
    and a router may compare hashes across processes), and a collision-resistant hash keeps one
    tenant from crafting a prompt whose blocks collide with another's cached K/V. Truncated to
    128 bits: still collision resistant in practice, and a cheaper dict key.
    """
    h = hashlib.sha256()
    h.update(b"root" if parent_hash is None else parent_hash.to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(repr(extra).encode("utf-8"))
    return int.from_bytes(h.digest()[:16], "little")


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups, in tokens (vLLM's prefix_cache_queries / prefix_cache_hits)."""

    requests: int = 0  # lookups made
    queries: int = 0  # tokens looked up (the request's num_tokens per lookup)
    hits: int = 0  # tokens found in the cache


class KVCacheManager:
    """Block tables per request, allocation with prefix-cache reuse, and freeing.

    Invariants:
    - `req_to_blocks[rid]` covers the request's computed + scheduled tokens, in order;
      `get_block_ids(rid)` is the same list object for the request's whole stay (the runner
      holds it by reference), kept equal to `[b.block_id for b in req_to_blocks[rid]]`;
    - the first `num_cached_blocks[rid]` blocks of a request are full and in the prefix cache
      (or were left uncached because another block holds the same hash);
    - `request.block_hashes` covers every full block of `request.all_token_ids`;
    - a block entered into the prefix cache by the step being scheduled is "unwritten" until
      `mark_written()` (its step ran): if its request is freed first (aborted, or requeued
      after the step failed), it leaves the cache, so no later prompt is served K/V that was
      never computed.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self._req_to_block_ids: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        # Blocks cached at schedule time whose step has not run yet, by request id.
        self._unwritten: dict[str, list[KVBlock]] = {}
        self.total_stats = PrefixCacheStats()  # cumulative

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def update_block_hashes(self, request: Request) -> None:
        """Extend `request.block_hashes` to every full block of its tokens; hashes only new blocks."""
        b = self.block_size
        hashes = request.block_hashes
        num_full = request.num_tokens // b
        for i in range(len(hashes), num_full):
            parent = hashes[i - 1] if i > 0 else None
            extra = (request.cache_salt,) if i == 0 and request.cache_salt is not None else None
            hashes.append(hash_block(parent, tuple(request.token_slice(i * b, (i + 1) * b)), extra))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of the request: (its blocks, its length in tokens).

        Never the whole sequence: a hit stops at num_tokens - 1 tokens (floored to whole
        blocks), so at least one token is computed and yields the logits to sample from.
        The blocks are not yet referenced: pass them to `allocate_slots` in the same step.
        """
        if not self.enable_caching or not request.use_prefix_cache:
            return [], 0
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.total_stats.requests += 1
        self.total_stats.queries += request.num_tokens
        self.total_stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVBlock] = ()
    ) -> list[KVBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

            |<- request.num_computed_tokens ->|<- new_computed_blocks ->|<- num_new_tokens ->|
            |  already in the block table     |  prefix hits (this step) |  to compute now     |
                                              total = computed + hits + new; blocks = ceil(total / B)

        Returns the newly allocated blocks (possibly []), or None when the pool cannot supply
        them; then nothing has changed. Blocks that become full (all their tokens known) enter
        the prefix cache now, at schedule time: a request scheduled later in the same step may
        hit them, so the runner must write a layer's K/V for the whole batch before attending.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        rid = request.request_id
        b = self.block_size
        req_blocks = self.req_to_blocks.get(rid, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * b
        total = num_computed + num_new_tokens
        num_required = -(-total // b)
        num_new_blocks = max(num_required - len(req_blocks) - len(new_computed_blocks), 0)
        # Touching a free (cached, evictable) hit takes it out of the free blocks: it cannot
        # also be counted as a block to allocate.
        num_free_hits = sum(1 for blk in new_computed_blocks if blk.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_free_hits:
            return None

        if rid not in self.req_to_blocks:
            self.req_to_blocks[rid] = req_blocks
            self._req_to_block_ids[rid] = []
            self._num_cached_blocks[rid] = 0
        block_ids = self._req_to_block_ids[rid]
        if new_computed_blocks:
            # Touch first: otherwise get_new_blocks could evict the very blocks we just hit.
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            block_ids.extend(blk.block_id for blk in new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        block_ids.extend(blk.block_id for blk in new_blocks)

        if self.enable_caching:
            # Only blocks of real tokens enter the cache: draft tokens past num_tokens may be
            # rejected, and their K/V must never be served to another prompt.
            self._cache_full_blocks(request, req_blocks, min(total, request.num_tokens))
        return new_blocks

    def num_free_slots(self, request: Request) -> int:
        """Tokens the request could add after its computed ones without anyone's blocks: the
        rest of its own blocks plus every free block (cached-but-free ones are evictable)."""
        held = len(self.req_to_blocks.get(request.request_id, ())) * self.block_size
        return max(held - request.num_computed_tokens, 0) + self.block_pool.num_free_blocks * self.block_size

    def trim(self, request: Request, num_tokens: int) -> None:
        """Keep only the blocks that hold the request's first `num_tokens` tokens and free the
        rest (speculative decoding's rollback of rejected drafts). Never frees a cached block:
        those hold real tokens only, all before `num_tokens`."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if not blocks:
            return
        keep = -(-num_tokens // self.block_size)
        if keep >= len(blocks):
            return
        if keep < self._num_cached_blocks.get(rid, 0):
            raise ValueError(f"trim of {rid!r} to {num_tokens} tokens would free a cached block")
        tail = blocks[keep:]
        del blocks[keep:]
        del self._req_to_block_ids[rid][keep:]  # in place: the runner holds this list
        self.block_pool.free_blocks(reversed(tail))

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVBlock], num_known_tokens: int) -> None:
        rid = request.request_id
        num_full = num_known_tokens // self.block_size
        start = self._num_cached_blocks[rid]
        if num_full <= start:
            return
        self.update_block_hashes(request)
        for i in range(start, num_full):
            if self.block_pool.cache_full_block(req_blocks[i], request.block_hashes[i]):
                self._unwritten.setdefault(rid, []).append(req_blocks[i])
        self._num_cached_blocks[rid] = num_full

    def mark_written(self) -> None:
        """The scheduled step ran: the K/V of every block cached for it is in place."""
        self._unwritten.clear()

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as ids: the same list object every call (appended in place)."""
        try:
            return self._req_to_block_ids[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} holds no blocks") from None

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first (evicted first), and forget it."""
        rid = request.request_id
        for block in self._unwritten.pop(rid, ()):  # freed before its step ran
            self.block_pool.uncache(block)
        blocks = self.req_to_blocks.pop(rid, None)
        self._req_to_block_ids.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> int:
        return self.block_pool.reset_prefix_cache()
