"""A prompt's chained block hashes, computed exactly as the engine's prefix cache computes them.

Same function (`engine.kv_cache_manager.hash_block`, SHA-256 over the parent hash and the
block's token ids), same block size (read from each replica's /server_info) and the same salt
rule (the salt mixed into the first block only): equal hashes here mean the replica's cache can
hold those blocks. The salt is the one the replica's engine gets, `Tenant.request_salt`: the
tenant's (when the router has the replicas' --api-keys file), then the request's `cache_salt`;
so two tenants never share a block, in the replicas' caches or in the router's index.
"""

from __future__ import annotations

from collections.abc import Sequence

from inferlab.engine.kv_cache_manager import hash_block


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """The hash of every full block of `token_ids` (the engine caches full blocks only)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out: list[int] = []
    parent: int | None = None
    for i in range(len(token_ids) // block_size):
        extra = (cache_salt,) if i == 0 and cache_salt is not None else None
        parent = hash_block(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]), extra)
        out.append(parent)
    return out


def max_hit_blocks(num_tokens: int, block_size: int) -> int:
    """The most blocks a lookup can hit: the engine always computes the last prompt token
    (it yields the logits to sample from), so a hit stops at num_tokens - 1 tokens."""
    return max(num_tokens - 1, 0) // block_size
