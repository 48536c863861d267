"""Block pool and block tables: allocation, growth, truncation, freeing, no leaks."""

import random

import pytest

from specbatch.kv_cache.block_pool import BlockPool
from specbatch.kv_cache.kv_cache_manager import KVCacheManager


def test_pool_allocate_release_and_double_free():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 1
    with pytest.raises(MemoryError):
        pool.allocate(2)
    pool.release(a[:1])
    assert pool.num_free == 2
    with pytest.raises(ValueError):
        pool.release(a[:1])


def test_pool_shared_block_freed_by_last_owner():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.share(b)
    pool.release([b])
    assert pool.num_free == 1
    pool.release([b])
    assert pool.num_free == 2


def test_allocate_is_all_or_nothing_and_grows():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate("a", 5)  # 2 blocks
    assert kv.num_slots("a") == 8 and kv.num_free_blocks == 2
    assert kv.allocate("a", 8)  # already covered
    assert kv.num_free_blocks == 2
    assert not kv.allocate("b", 13)  # needs 4 blocks, 2 free: nothing changes
    assert kv.num_free_blocks == 2 and not kv.has_table("b")
    assert kv.allocate("b", 8)
    assert kv.num_free_blocks == 0


def test_truncate_frees_only_whole_tail_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate("a", 16)  # 4 blocks
    table = list(kv.block_table("a"))
    kv.truncate("a", 9)  # positions 0..8 -> 3 blocks
    assert kv.block_table("a") == table[:3]
    kv.truncate("a", 8)
    assert kv.block_table("a") == table[:2]
    kv.truncate("a", 8)
    assert kv.num_free_blocks == 6
    kv.free("a")
    assert kv.num_free_blocks == 8


def test_random_workload_never_leaks():
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=32, block_size=4)
    sizes: dict[str, int] = {}
    for step in range(3000):
        rid = f"r{rng.randrange(12)}"
        op = rng.random()
        if op < 0.5:
            want = sizes.get(rid, 0) + rng.randrange(1, 9)
            if kv.allocate(rid, want):
                sizes[rid] = want
        elif op < 0.8 and rid in sizes:
            sizes[rid] = rng.randrange(0, sizes[rid] + 1)
            kv.truncate(rid, sizes[rid])
        elif rid in sizes:
            kv.free(rid)
            del sizes[rid]
        used = sum(len(kv.block_table(r)) for r in sizes)
        assert used == kv.num_used_blocks, step
        for r, n in sizes.items():
            assert kv.num_slots(r) >= n
            assert len(kv.block_table(r)) == -(-n // 4)  # whole blocks, none spare
        all_blocks = [b for r in sizes for b in kv.block_table(r)]
        assert len(all_blocks) == len(set(all_blocks))
    for r in list(sizes):
        kv.free(r)
    assert kv.num_free_blocks == 32
