"""Block tables, the free pool and prefix caching (eagle2/blocks.py), with exact tables."""

from __future__ import annotations

import pytest

from eagle2.blocks import BlockManager, BlockPool, block_hash


def test_allocate_grow_free_exact_tables():
    m = BlockManager(num_blocks=8, block_size=4)
    assert m.allocate("a", list(range(6)), 9) == 0  # 6 prompt tokens + a 3-node tree
    assert m.table("a") == [0, 1, 2]
    assert m.allocate("b", [9, 9], 2) == 0
    assert m.table("b") == [3]
    assert m.ensure("b", 5) and m.table("b") == [3, 4]
    assert m.ensure("b", 8) and m.table("b") == [3, 4]  # already covered
    assert m.num_free == 3
    assert not m.ensure("a", 4 * 7)  # 4 more blocks, 3 free: nothing taken
    assert m.table("a") == [0, 1, 2] and m.num_free == 3
    assert m.allocate("c", list(range(20)), 20) is None  # 5 blocks, 3 free
    assert "c" not in m.tables
    m.free("b")
    # unhashed blocks are reused first, the last one freed taken first
    assert m.allocate("c", [1], 12) == 0
    assert m.table("c") == [3, 4, 5]


def test_prefix_hit_shares_blocks_and_leaves_the_last_token():
    m = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(1, 11))  # 10 tokens: blocks [1..4], [5..8], then 2 tokens
    assert m.allocate("a", prompt, 12) == 0
    m.commit("a", prompt + [50])  # 11 committed: two full blocks hashed
    assert m.table("a") == [0, 1, 2]
    assert m.allocate("b", prompt[:8] + [77], 10) == 8  # both full blocks shared
    assert m.table("b") == [0, 1, 3]
    assert m.pool.ref_counts[:4] == [2, 2, 1, 1]
    assert m.allocate("c", prompt[:8], 8) == 4  # the last token is computed: one block
    assert m.table("c") == [0, 4]
    assert m.stats.query_tokens == 10 + 9 + 8 and m.stats.hit_tokens == 12
    assert m.stats.hit_rate == pytest.approx(12 / 27)


def test_freed_prefix_stays_cached_until_evicted_lru():
    m = BlockManager(num_blocks=4, block_size=2)
    m.allocate("a", [1, 2, 3, 4, 5], 5)  # blocks 0, 1, 2
    m.commit("a", [1, 2, 3, 4, 5])
    m.free("a")
    # free LRU: unhashed block 2 at the front, then 3; hashed blocks 1 and 0 at the end
    # (a prefix's tail is evicted before its head)
    assert list(m.pool.free) == [2, 3, 1, 0]
    assert m.allocate("b", [1, 2, 3, 4, 9], 5) == 4
    assert m.table("b") == [0, 1, 2]
    m.free("b")
    assert m.allocate("c", [7] * 7, 7) == 0  # takes every block: the cache is evicted
    assert sorted(m.table("c")) == [0, 1, 2, 3] and m.pool.cached == {}
    m.free("c")
    assert m.allocate("d", [1, 2, 3, 4, 5], 5) == 0  # nothing cached any more


def test_chained_hash_depends_on_the_whole_prefix():
    m = BlockManager(num_blocks=6, block_size=2)
    m.allocate("a", [1, 2, 3, 4, 0], 5)
    m.commit("a", [1, 2, 3, 4, 0])
    # same second block after a different first block: no hit
    assert m.allocate("b", [9, 9, 3, 4, 0], 5) == 0
    assert block_hash(b"", [1, 2]) != block_hash(b"", [2, 1])
    assert block_hash(block_hash(b"", [1, 2]), [3, 4]) != block_hash(b"", [3, 4])


def test_prefix_caching_off_and_can_allocate_counts_free_hits():
    off = BlockManager(num_blocks=4, block_size=2, prefix_caching=False)
    off.allocate("a", [1, 2, 3], 3)
    off.commit("a", [1, 2, 3])
    off.free("a")
    assert off.allocate("b", [1, 2, 3], 3) == 0 and off.pool.cached == {}
    m = BlockManager(num_blocks=3, block_size=2)
    m.allocate("a", [1, 2, 3, 4, 5], 5)
    m.commit("a", [1, 2, 3, 4, 5])
    m.free("a")
    # 3 blocks free, 2 of them the cached prefix: a hit needs 1 more, so 6 entries fit, 8 not
    assert m.can_allocate([1, 2, 3, 4, 5], 6)
    assert not m.can_allocate([1, 2, 3, 4, 5], 8)


def test_pool_rejects_bad_sizes_and_double_release():
    with pytest.raises(ValueError):
        BlockPool(0)
    with pytest.raises(ValueError):
        BlockManager(4, 0)
    pool = BlockPool(2)
    ids = pool.take(1)
    pool.release(ids)
    with pytest.raises(AssertionError):
        pool.release(ids)
