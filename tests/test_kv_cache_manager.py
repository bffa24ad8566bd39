"""KVCacheManager: chained hashes, prefix hits in tokens, the num_tokens-1 cap, allocation."""

from __future__ import annotations

import pytest
from engine_factories import make_request

from inferlab.engine.kv_cache_manager import KVCacheManager, hash_block

B = 4


def free_ids(kv: KVCacheManager) -> list[int]:
    """Free blocks in the order new ones are taken."""
    return [b.block_id for b in kv.block_pool.free_order()]


def allocate_prompt(kv: KVCacheManager, request) -> None:
    """Allocate and 'compute' the whole prompt, as a step would."""
    assert kv.allocate_slots(request, request.num_tokens) is not None
    request.num_computed_tokens = request.num_tokens
    kv.mark_written()


def test_hash_block_is_chained_and_deterministic():
    h0 = hash_block(None, (1, 2, 3, 4))
    assert h0 == hash_block(None, (1, 2, 3, 4))
    assert h0 != hash_block(None, (1, 2, 3, 5))
    assert hash_block(h0, (5, 6, 7, 8)) != hash_block(None, (5, 6, 7, 8))
    assert hash_block(None, (1, 2, 3, 4), ("a",)) != h0


def test_block_hashes_cover_full_blocks_and_grow_incrementally():
    kv = KVCacheManager(8, B)
    req = make_request(num_prompt_tokens=10)
    kv.update_block_hashes(req)
    assert len(req.block_hashes) == 2
    first_two = list(req.block_hashes)
    assert req.block_hashes[1] == hash_block(req.block_hashes[0], tuple(req.prompt_token_ids[4:8]))
    req.output_token_ids.extend([7, 8])  # 12 tokens: a third full block
    kv.update_block_hashes(req)
    assert len(req.block_hashes) == 3
    assert req.block_hashes[:2] == first_two
    assert req.block_hashes[2] == hash_block(first_two[1], (req.prompt_token_ids[8], req.prompt_token_ids[9], 7, 8))


def test_cache_salt_changes_every_block_hash_through_the_chain():
    kv = KVCacheManager(8, B)
    plain = make_request("a", num_prompt_tokens=12)
    salted = make_request("b", num_prompt_tokens=12, cache_salt="tenant-1")
    salted_again = make_request("c", num_prompt_tokens=12, cache_salt="tenant-1")
    other = make_request("d", num_prompt_tokens=12, cache_salt="tenant-2")
    for r in (plain, salted, salted_again, other):
        kv.update_block_hashes(r)
    assert all(x != y for x, y in zip(plain.block_hashes, salted.block_hashes, strict=True))
    assert all(x != y for x, y in zip(salted.block_hashes, other.block_hashes, strict=True))
    assert salted.block_hashes == salted_again.block_hashes
    # Only the first block mixes the salt in; later blocks differ through the chain.
    assert salted.block_hashes[1] == hash_block(salted.block_hashes[0], tuple(salted.prompt_token_ids[4:8]))


def test_salted_request_does_not_hit_another_tenants_prefix():
    kv = KVCacheManager(16, B)
    allocate_prompt(kv, make_request("a", num_prompt_tokens=12, cache_salt="t1"))
    assert kv.get_computed_blocks(make_request("b", num_prompt_tokens=12, cache_salt="t2")) == ([], 0)
    blocks, n = kv.get_computed_blocks(make_request("c", num_prompt_tokens=12, cache_salt="t1"))
    assert n == 8


def test_prefix_hit_counts_are_in_tokens():
    kv = KVCacheManager(16, B)
    first = make_request("a", num_prompt_tokens=10)
    assert kv.get_computed_blocks(first) == ([], 0)
    allocate_prompt(kv, first)
    # Shares the first 8 tokens (2 full blocks), then differs.
    second = make_request("b", first.prompt_token_ids[:8] + [1, 2, 3, 4, 5])
    blocks, num_computed = kv.get_computed_blocks(second)
    assert num_computed == 8
    assert [b.block_id for b in blocks] == kv.get_block_ids("a")[:2]
    assert (kv.total_stats.requests, kv.total_stats.queries, kv.total_stats.hits) == (2, 10 + 13, 8)


def test_hit_is_capped_at_num_tokens_minus_one_whole_blocks():
    kv = KVCacheManager(16, B)
    allocate_prompt(kv, make_request("a", num_prompt_tokens=12))  # 3 full cached blocks
    prompt = make_request("a", num_prompt_tokens=12).prompt_token_ids
    # Identical 8 tokens: a full hit would leave nothing to compute; cap 7 tokens → 1 block.
    assert kv.get_computed_blocks(make_request("b", prompt[:8]))[1] == 4
    # 9 tokens: cap 8 → 2 blocks.
    assert kv.get_computed_blocks(make_request("c", prompt[:9]))[1] == 8
    # The identical 12-token prompt: cap 11 → 2 blocks; the last block is recomputed.
    assert kv.get_computed_blocks(make_request("d", prompt))[1] == 8


def test_no_hits_when_caching_disabled_or_request_opts_out():
    kv = KVCacheManager(16, B, enable_caching=False)
    allocate_prompt(kv, make_request("a", num_prompt_tokens=12))
    assert kv.block_pool.cached_blocks == {}
    assert kv.get_computed_blocks(make_request("b", num_prompt_tokens=12)) == ([], 0)

    kv = KVCacheManager(16, B)
    allocate_prompt(kv, make_request("a", num_prompt_tokens=12))
    assert kv.get_computed_blocks(make_request("b", num_prompt_tokens=12, use_prefix_cache=False)) == ([], 0)
    assert kv.total_stats.queries == 0


def test_allocate_slots_builds_the_block_table_and_caches_full_blocks():
    kv = KVCacheManager(8, B)
    req = make_request(num_prompt_tokens=6)
    new = kv.allocate_slots(req, 6)
    assert [b.block_id for b in new] == [0, 1]
    ids = kv.get_block_ids(req.request_id)
    assert ids == [0, 1]
    # Only block 0 is full (tokens 0..3); block 1 holds 2 of 4.
    assert new[0].block_hash == req.block_hashes[0]
    assert new[1].block_hash is None
    req.num_computed_tokens = 6
    req.output_token_ids.append(9)  # 7 tokens
    assert kv.allocate_slots(req, 1) == []  # position 6 fits block 1
    req.num_computed_tokens = 7
    req.output_token_ids.append(9)  # 8 tokens
    assert kv.allocate_slots(req, 1) == []  # position 7 fills block 1
    assert new[1].block_hash == req.block_hashes[1]
    req.num_computed_tokens = 8
    req.output_token_ids.append(9)
    assert [b.block_id for b in kv.allocate_slots(req, 1)] == [2]
    assert kv.get_block_ids(req.request_id) is ids  # the runner's reference stays valid
    assert ids == [0, 1, 2]


def test_allocation_failure_returns_none_and_changes_nothing():
    kv = KVCacheManager(4, B)
    allocate_prompt(kv, make_request("a", num_prompt_tokens=12))  # 3 of 4 blocks
    before = (free_ids(kv), kv.usage, dict(kv.block_pool.cached_blocks))
    assert kv.allocate_slots(make_request("b", num_prompt_tokens=8), 8) is None
    assert (free_ids(kv), kv.usage, dict(kv.block_pool.cached_blocks)) == before
    assert "b" not in kv.req_to_blocks
    with pytest.raises(KeyError):
        kv.get_block_ids("b")
    kv.block_pool.check_integrity()


def test_free_cached_hits_are_not_counted_as_allocatable():
    kv = KVCacheManager(4, B)
    first = make_request("a", num_prompt_tokens=8)
    allocate_prompt(kv, first)  # blocks 0, 1 cached
    kv.free(first)
    assert free_ids(kv) == [2, 3, 1, 0]  # the empty ones, then the cached ones: tail block first
    assert kv.num_free_blocks == 4

    # 8 shared + 9 new tokens = 5 blocks; 2 are hits, but touching them leaves 2 free, not 4.
    big = make_request("b", first.prompt_token_ids + list(range(50, 59)))
    hits, n = kv.get_computed_blocks(big)
    assert n == 8
    assert kv.allocate_slots(big, big.num_tokens - n, hits) is None
    assert free_ids(kv) == [2, 3, 1, 0]

    # 8 shared + 4 new = 3 blocks: 2 hits + 1 new, which must not evict the hits.
    small = make_request("c", first.prompt_token_ids + [50, 51, 52, 53])
    hits, n = kv.get_computed_blocks(small)
    new = kv.allocate_slots(small, small.num_tokens - n, hits)
    assert [b.block_id for b in new] == [2]
    assert kv.get_block_ids("c") == [0, 1, 2]
    assert [b.ref_cnt for b in kv.block_pool.blocks] == [1, 1, 1, 0]
    assert free_ids(kv) == [3]
    kv.block_pool.check_integrity()


def test_shared_prefix_blocks_are_reference_counted():
    kv = KVCacheManager(8, B)
    a = make_request("a", num_prompt_tokens=9)
    allocate_prompt(kv, a)
    b = make_request("b", a.prompt_token_ids[:8] + [77])
    hits, n = kv.get_computed_blocks(b)
    kv.allocate_slots(b, b.num_tokens - n, hits)
    assert [blk.ref_cnt for blk in kv.req_to_blocks["a"]] == [2, 2, 1]
    kv.free(a)
    assert [blk.ref_cnt for blk in kv.req_to_blocks["b"]] == [1, 1, 1]
    assert kv.usage == pytest.approx(3 / 8)
    kv.free(b)
    assert kv.usage == 0.0
    kv.block_pool.check_integrity()


def test_free_releases_in_reverse_order():
    kv = KVCacheManager(4, B)
    req = make_request(num_prompt_tokens=12)
    allocate_prompt(kv, req)
    kv.free(req)
    assert free_ids(kv) == [3, 2, 1, 0]
    assert "r0" not in kv.req_to_blocks
    kv.free(req)  # freeing twice is a no-op
    kv.block_pool.check_integrity()
