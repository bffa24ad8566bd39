"""BlockPool and FreeBlockQueue: exact eviction orders, reference counts, integrity."""

from __future__ import annotations

import pytest

from inferlab.engine.block_pool import BlockPool, FreeBlockQueue, KVBlock


def free_ids(pool: BlockPool) -> list[int]:
    """Free blocks in the order new ones are taken."""
    return [b.block_id for b in pool.free_order()]


def test_new_pool_is_all_free_in_id_order():
    pool = BlockPool(5)
    assert free_ids(pool) == [0, 1, 2, 3, 4]
    assert pool.num_free_blocks == 5
    assert pool.usage == 0.0
    pool.check_integrity()


def test_get_new_blocks_pops_head_and_sets_ref_cnt():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert free_ids(pool) == [3, 4]
    assert pool.usage == pytest.approx(0.6)
    pool.check_integrity()


def test_get_new_blocks_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="only 1 free"):
        pool.get_new_blocks(2)
    assert free_ids(pool) == [2]
    pool.check_integrity()


def test_empty_blocks_are_taken_lowest_id_first_whatever_the_order_freed():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # 0 1 2
    b = pool.get_new_blocks(2)  # 3 4
    pool.free_blocks(reversed(b))  # the scheduler's order: tail blocks first
    assert free_ids(pool) == [3, 4, 5]
    pool.free_blocks(reversed(a))
    assert free_ids(pool) == [0, 1, 2, 3, 4, 5]
    # A new request's blocks are contiguous again (decode attention reads them in longer runs).
    assert [blk.block_id for blk in pool.get_new_blocks(4)] == [0, 1, 2, 3]
    pool.check_integrity()


def test_empty_blocks_go_before_any_cached_one_is_evicted():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)  # 0 1, cached
    b = pool.get_new_blocks(2)  # 2 3, never cached
    for i, blk in enumerate(a):
        pool.cache_full_block(blk, 100 + i)
    pool.free_blocks(reversed(a))  # the cached ones are freed first: least recently freed
    pool.free_blocks(reversed(b))
    assert free_ids(pool) == [2, 3, 1, 0]  # empty ones first, then the cached ones LRU
    assert [blk.block_id for blk in pool.get_new_blocks(2)] == [2, 3]
    assert pool.cached_blocks.keys() == {100, 101}  # nothing evicted while an empty block was free
    assert [blk.block_id for blk in pool.get_new_blocks(1)] == [1]  # then the tail block's prefix goes
    assert pool.cached_blocks.keys() == {100}
    pool.check_integrity()


def test_uncache_and_reset_put_free_cached_blocks_back_among_the_empty():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    for i, blk in enumerate(blocks):
        pool.cache_full_block(blk, 10 + i)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 2, 1, 0]  # all cached: LRU order
    pool.uncache(blocks[2])
    assert free_ids(pool) == [2, 3, 1, 0]
    pool.check_integrity()
    assert pool.reset_prefix_cache() == 3
    assert free_ids(pool) == [0, 1, 2, 3]
    pool.check_integrity()
    with pytest.raises(RuntimeError, match="only a cached block can be hit"):
        pool.touch([blocks[0]])
    assert pool.cache_full_block(blocks[0], 99) is False  # a free block is never cached


def test_eviction_order_is_lru_and_a_requests_tail_blocks_go_first():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # request A: prefix blocks 0 1 2
    b = pool.get_new_blocks(3)  # request B: prefix blocks 3 4 5
    for i, blk in enumerate(a):
        pool.cache_full_block(blk, 100 + i)
    for i, blk in enumerate(b):
        pool.cache_full_block(blk, 200 + i)
    pool.free_blocks(reversed(a))  # A finished first
    pool.free_blocks(reversed(b))
    assert pool.num_free_blocks == 6  # cached blocks with ref_cnt 0 count as free
    evicted = []
    for _ in range(6):
        before = set(pool.cached_blocks)
        pool.get_new_blocks(1)
        evicted.extend(before - set(pool.cached_blocks))
    # A before B (freed earlier), and within each, the last block first.
    assert evicted == [102, 101, 100, 202, 201, 200]
    assert pool.cached_blocks == {}
    assert pool.num_evictions == 6
    pool.check_integrity()


def test_cached_block_hit_is_reused_and_leaves_free_list_from_the_middle():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_block(blocks[1], 11)
    pool.free_blocks(blocks)  # free list: 0 1 2 3
    hit = pool.get_cached_block(11)
    assert hit is blocks[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert free_ids(pool) == [0, 2, 3]
    assert hit.block_hash == 11  # still cached while in use
    # Allocating everything else never evicts the touched block.
    assert [b.block_id for b in pool.get_new_blocks(3)] == [0, 2, 3]
    assert pool.get_cached_block(11) is hit
    pool.check_integrity()


def test_ref_counts_with_a_shared_prefix():
    pool = BlockPool(4)
    shared = pool.get_new_blocks(1)[0]
    pool.cache_full_block(shared, 7)
    pool.touch([pool.get_cached_block(7)])  # a second request hits the same prefix block
    assert shared.ref_cnt == 2
    pool.free_blocks([shared])  # first request finishes
    assert shared.ref_cnt == 1
    assert shared.block_id not in free_ids(pool)
    pool.free_blocks([shared])  # second request finishes
    assert shared.ref_cnt == 0
    assert free_ids(pool) == [1, 2, 3, 0]
    assert pool.get_cached_block(7) is shared  # still reusable until evicted
    pool.check_integrity()


def test_freeing_more_than_taken_raises():
    pool = BlockPool(2)
    blk = pool.get_new_blocks(1)[0]
    pool.free_blocks([blk])
    with pytest.raises(RuntimeError, match="freed more times"):
        pool.free_blocks([blk])


def test_get_new_blocks_evicts_the_hash_of_a_reused_block():
    pool = BlockPool(2)
    blk = pool.get_new_blocks(1)[0]
    pool.cache_full_block(blk, 42)
    pool.free_blocks([blk])
    pool.get_new_blocks(1)  # block 1 (head): 42 survives
    assert pool.get_cached_block(42) is blk
    reused = pool.get_new_blocks(1)[0]
    assert reused is blk
    assert reused.block_hash is None
    assert pool.get_cached_block(42) is None
    pool.check_integrity()


def test_duplicate_hash_leaves_second_block_uncached():
    pool = BlockPool(3)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_block(first, 5)
    pool.cache_full_block(second, 5)
    assert pool.get_cached_block(5) is first
    assert second.block_hash is None
    # Evicting the uncached duplicate must not drop the cached one.
    pool.free_blocks([second, first])
    pool.get_new_blocks(2)  # the empty ones: second (1), then 2
    assert pool.get_cached_block(5) is first
    pool.check_integrity()


def test_caching_disabled_caches_nothing():
    pool = BlockPool(2, enable_caching=False)
    blk = pool.get_new_blocks(1)[0]
    pool.cache_full_block(blk, 5)
    assert pool.get_cached_block(5) is None
    assert blk.block_hash is None


def test_reset_prefix_cache_forgets_all_hashes():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    for i, blk in enumerate(blocks):
        pool.cache_full_block(blk, i + 1)
    pool.free_blocks(blocks[:2])
    assert pool.reset_prefix_cache() == 3
    assert pool.cached_blocks == {}
    assert all(b.block_hash is None for b in pool.blocks)
    assert blocks[2].ref_cnt == 1  # in-use blocks stay in use
    pool.check_integrity()


def test_free_block_queue_removes_from_head_middle_and_tail():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert [b.block_id for b in q] == [1, 3]
    assert len(q) == 2
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    q.append(blocks[2])
    assert [b.block_id for b in q] == [1, 3, 2]
    assert q.popleft() is blocks[1]
    assert q.popleft() is blocks[3]
    assert q.popleft() is blocks[2]
    with pytest.raises(IndexError):
        q.popleft()


def test_free_block_queue_removal_touches_only_neighbours():
    # O(1): removing a block relinks its two neighbours and nothing else.
    blocks = [KVBlock(i) for i in range(1000)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[500])
    assert blocks[499].next_free is blocks[501]
    assert blocks[501].prev_free is blocks[499]
    assert len(q) == 999


def test_free_block_queue_rejects_double_append_and_foreign_remove():
    blk = KVBlock(0)
    q = FreeBlockQueue([blk])
    with pytest.raises(RuntimeError, match="already in the free list"):
        q.append(blk)
    with pytest.raises(RuntimeError, match="not in the free list"):
        q.remove(KVBlock(9))


def test_check_integrity_catches_broken_invariants():
    pool = BlockPool(3)
    pool.blocks[0].ref_cnt = 1  # in use, yet still in the free list
    with pytest.raises(AssertionError, match="free list != blocks with ref_cnt 0"):
        pool.check_integrity()

    pool = BlockPool(3)
    pool.blocks[1].block_hash = 9  # hash without a map entry
    with pytest.raises(AssertionError, match="the map does not name it"):
        pool.check_integrity()

    pool = BlockPool(3)
    pool.blocks[0].ref_cnt = -1
    with pytest.raises(AssertionError, match="ref_cnt -1"):
        pool.check_integrity()


def test_num_blocks_must_be_positive():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
