"""The prefix cache's data structures (no torch): keys, publication, LRU eviction, sharing,
copy on write, and no block ever lost."""

import random

import pytest

from specbatch.kv_cache.block_keys import block_key, salt_of
from specbatch.kv_cache.block_pool import BlockPool
from specbatch.kv_cache.kv_cache_manager import KVCacheManager


def tokens_of(seq):
    return lambda a, b: seq[a:b]


def test_keys_chain_their_parents_and_the_salt():
    kv = KVCacheManager(8, 4, enable_prefix_caching=True, salt=salt_of("model-a"))
    a = kv.block_keys("a", tokens_of([1, 2, 3, 4, 5, 6, 7, 8]), 2)
    b = kv.block_keys("b", tokens_of([1, 2, 3, 4, 5, 6, 7, 8, 9]), 2)
    c = kv.block_keys("c", tokens_of([0, 2, 3, 4, 5, 6, 7, 8]), 2)
    assert a == b and len(a) == 2
    assert a[0] != c[0] and a[1] != c[1]  # block 1's tokens agree, its parent does not
    other = KVCacheManager(8, 4, enable_prefix_caching=True, salt=salt_of("model-b"))
    assert other.block_keys("a", tokens_of([1, 2, 3, 4]), 1)[0] != a[0]
    assert block_key(b"", [1, 2]) != block_key(b"", [2, 1])


def test_idle_blocks_stay_findable_until_the_pool_needs_them():
    pool = BlockPool(3)
    x, y = pool.allocate(2)
    assert pool.publish(x, b"kx") and pool.publish(y, b"ky")
    assert not pool.publish(y, b"kz")  # already published
    pool.release([y, x])  # y first: it is evicted first
    assert pool.num_free == 3 and pool.num_used == 0 and pool.num_cached == 2
    (z,) = pool.allocate(1)  # the never-published block goes first
    assert z not in (x, y) and pool.lookup(b"kx") == (x, True) and pool.lookup(b"ky") == (y, True)
    (w,) = pool.allocate(1)  # then the least recently released idle block
    assert w == y and pool.lookup(b"ky") is None and pool.lookup(b"kx") == (x, True)
    pool.share(x)  # a hit takes x out of the idle set
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.release([x, z, w])
    assert pool.num_free == 3 and pool.num_evictions == 1


def test_a_key_names_one_block_per_token_after_it_and_reset_forgets_every_key():
    pool = BlockPool(5)
    a, b, c = pool.allocate(3)
    assert pool.publish(a, b"k") and not pool.publish(b, b"k")  # b is a duplicate
    with pytest.raises(ValueError):
        pool.share(3)  # a free block
    pool.release([c])
    d, e = pool.allocate(2)
    assert pool.publish(d, b"e", after=7) and pool.publish(e, b"e", after=8)
    assert pool.lookup(b"e", 8) == (e, True) and pool.lookup(b"e", 9) in ((d, False), (e, False))
    assert pool.num_cached == 3
    pool.release([a, d, e])
    assert pool.reset_cache() == 3 and pool.lookup(b"k") is None and pool.num_cached == 0
    assert pool.num_free == 4  # a, d and e went back to the free list
    pool.release([b])
    assert pool.num_free == 5


def test_cached_run_and_the_token_after_each_block():
    kv = KVCacheManager(8, 2, enable_prefix_caching=True)
    seq = [5, 6, 7, 8, 9, 10]
    assert kv.allocate("a", 6)
    keys = kv.block_keys("a", tokens_of(seq), 3)
    kv.publish("a", keys[:2])
    blocks, exact = kv.cached_run(keys)
    assert blocks == kv.block_table("a")[:2] and exact
    kv.free("a")
    kv.reset_prefix_cache()
    assert kv.allocate("b", 6)
    kv.publish("b", keys[:2], after=[7, 9].__getitem__)

    def nxt(i: int) -> int | None:
        return seq[(i + 1) * 2] if (i + 1) * 2 < len(seq) else None

    blocks, exact = kv.cached_run(keys, nxt)
    assert blocks == kv.block_table("b")[:2] and exact
    # a sequence with another token after block 1: the run ends there, not exact
    blocks, exact = kv.cached_run(keys, lambda i: 99 if i == 1 else nxt(i))
    assert len(blocks) == 2 and not exact
    blocks, exact = kv.cached_run(keys, lambda i: 99)
    assert len(blocks) == 1 and not exact
    # a block of its own for that other token: published beside the first, found after
    assert kv.allocate("c", 4)
    kv.publish("c", keys[:2], after=[7, 99].__getitem__)
    blocks, exact = kv.cached_run(keys, lambda i: 99 if i == 1 else nxt(i))
    assert blocks == [kv.block_table("b")[0], kv.block_table("c")[1]] and exact


def test_take_copy_on_write_and_the_rollback_guard():
    kv = KVCacheManager(6, 2, enable_prefix_caching=True)
    seq = [1, 2, 3, 4, 5]
    assert kv.allocate("a", 5)
    keys = kv.block_keys("a", tokens_of(seq), 2)
    kv.publish("a", keys)
    with pytest.raises(RuntimeError, match="published"):
        kv.truncate("a", 3)  # into block 1, published
    kv.truncate("a", 4)  # block 2 (slot 4) was not published
    shared = kv.block_table("a")[:2]
    kv.take_cached("b", shared)
    assert [kv.pool.ref_count(b) for b in shared] == [2, 2]
    src, dst = kv.copy_on_write("b", 1)
    assert src == shared[1] and kv.block_table("b") == [shared[0], dst]
    assert kv.pool.ref_count(src) == 1 and kv.num_published("b") == 1
    kv.truncate("b", 3)  # its copy is its own
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 6 and kv.num_cached_blocks == 2


def test_copy_on_write_without_a_free_block_changes_nothing():
    kv = KVCacheManager(2, 2, enable_prefix_caching=True)
    assert kv.allocate("a", 4)
    kv.publish("a", kv.block_keys("a", tokens_of([1, 2, 3, 4]), 2))
    kv.take_cached("b", kv.block_table("a"))
    before = list(kv.block_table("b"))
    assert kv.copy_on_write("b", 1) is None and kv.block_table("b") == before


def test_freeing_caches_a_table_tail_first():
    kv = KVCacheManager(4, 1, enable_prefix_caching=True)
    assert kv.allocate("a", 4)
    table = list(kv.block_table("a"))
    kv.publish("a", kv.block_keys("a", tokens_of([1, 2, 3, 4]), 4))
    kv.free("a")
    assert kv.pool.allocate(1) == [table[3]]  # the last block is evicted first


def test_random_workload_with_the_cache_never_loses_a_block():
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=24, block_size=2, enable_prefix_caching=True)
    seqs = {f"r{i}": [rng.randrange(3) for _ in range(16)] for i in range(10)}
    sizes: dict[str, int] = {}
    for step in range(4000):
        rid = rng.choice(list(seqs))
        seq = seqs[rid]
        op = rng.random()
        if rid not in sizes and op < 0.4:
            keys = kv.block_keys(rid, tokens_of(seq), 8)
            blocks, _ = kv.cached_run(keys[: rng.randrange(9)])
            kv.take_cached(rid, blocks)
            want = 2 * len(blocks) + rng.randrange(1, 5)
            if kv.allocate(rid, want):
                sizes[rid] = want
            else:
                kv.free(rid)
        elif rid in sizes and op < 0.7:
            full = min(sizes[rid], 16) // 2
            kv.publish(rid, kv.block_keys(rid, tokens_of(seq), full))
            sizes[rid] = min(16, sizes[rid] + rng.randrange(0, 3))
            if not kv.allocate(rid, sizes[rid]):
                kv.free(rid)
                del sizes[rid]
        elif rid in sizes:
            kv.free(rid)
            del sizes[rid]
        owned = [b for r in sizes for b in kv.block_table(r)]
        assert len(set(owned)) == kv.num_used_blocks, step
        assert sum(kv.pool.ref_count(b) for b in set(owned)) == len(owned)
        for r in sizes:  # every published block of a table holds that table's tokens
            table, keys = kv.block_table(r), kv.block_keys(r, tokens_of(seqs[r]), 8)
            for i in range(kv.num_published(r)):
                assert kv.pool.key_of(table[i]) in (keys[i], None)
    for r in list(sizes):
        kv.free(r)
    assert kv.num_free_blocks == 24 and kv.num_cached_blocks > 0
