"""Block tables: which physical blocks hold each request's token slots, and the prefix cache.

One table per request, shared by the target and the drafter: block ``b`` is an index into both
models' cache tensors, and token position ``i`` of a request lives in slot
``table[i // block_size] * block_size + i % block_size``. Pure Python; no torch.

Prefix caching: the scheduler publishes a request's leading full blocks once every slot in them
holds the K/V of verified tokens in every model's cache (``publish``); a new request starts its
table with the longest run of published blocks of its tokens (``cached_run``, ``take_cached``).
A table's published blocks are never written again: ``truncate`` refuses to cut into them, and a
request that must rewrite a slot of a block it took gets a copy first (``copy_on_write``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specbatch.kv_cache.block_keys import extend_keys
from specbatch.kv_cache.block_pool import BlockPool


def blocks_for(num_slots: int, block_size: int) -> int:
    return -(-num_slots // block_size)


class KVCacheManager:
    """Grows, shrinks and frees the block tables of requests.

    Contract: a table always covers a prefix of positions ``0 .. n-1``. ``allocate`` grows it (all
    or nothing), ``truncate`` frees whole tail blocks that only hold slots at or past ``n`` (the
    slots of rejected drafts), ``free`` drops the whole table. Only the scheduler calls these.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        salt: bytes = b"",
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.caching = enable_prefix_caching
        self.salt = salt  # the root of every key chain (block_keys.py)
        self._tables: dict[str, list[int]] = {}
        self._published: dict[str, int] = {}  # leading table blocks that are in the cache
        self._drafted: dict[str, int] = {}  # leading table blocks the drafter's cache holds
        self._keys: dict[str, list[bytes]] = {}  # the keys of each request's full blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_slots(self, request_id: str) -> int:
        """Token slots the request's table covers now."""
        return len(self._tables.get(request_id, ())) * self.block_size

    def blocks_needed(self, request_id: str, num_slots: int) -> int:
        """Extra blocks ``allocate(request_id, num_slots)`` would take."""
        have = len(self._tables.get(request_id, ()))
        return max(0, blocks_for(num_slots, self.block_size) - have)

    def max_slots_within_free(self, request_id: str) -> int:
        """The most slots this request's table could cover using every free block."""
        return (len(self._tables.get(request_id, ())) + self.pool.num_free) * self.block_size

    def allocate(self, request_id: str, num_slots: int) -> bool:
        """Make the table cover ``num_slots`` slots; False (and no change) if blocks run short."""
        need = self.blocks_needed(request_id, num_slots)
        if need > self.pool.num_free:
            return False
        table = self._tables.setdefault(request_id, [])
        if need:
            table.extend(self.pool.allocate(need))
        return True

    def truncate(self, request_id: str, num_slots: int) -> None:
        """Keep only the blocks needed for slots ``0 .. num_slots-1``; free the rest."""
        table = self._tables.get(request_id)
        if table is None:
            return
        if num_slots < self._published.get(request_id, 0) * self.block_size:
            raise RuntimeError(
                f"request {request_id!r}: rolling back to {num_slots} slots would cut into its "
                "published blocks"
            )
        keep = blocks_for(num_slots, self.block_size)
        if keep < len(table):
            self.pool.release(reversed(table[keep:]))
            del table[keep:]

    def fork(self, request_id: str, source_id: str, num_blocks: int) -> None:
        """Give a request without a table the first ``num_blocks`` blocks of ``source_id``'s,
        shared (one more owner each): they must hold only slots neither will write again."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already has a block table")
        shared = self._tables[source_id][:num_blocks]
        for b in shared:
            self.pool.share(b)
        self._tables[request_id] = list(shared)

    def free(self, request_id: str) -> None:
        """Drop the request's table; its published blocks stay cached until evicted (the last
        blocks first, so that a prefix outlives its extensions)."""
        table = self._tables.pop(request_id, None)
        self._published.pop(request_id, None)
        self._drafted.pop(request_id, None)
        if table:
            self.pool.release(reversed(table))

    def has_table(self, request_id: str) -> bool:
        return request_id in self._tables

    # ---- prefix caching ----------------------------------------------------------------------
    def block_keys(
        self, request_id: str, token_slice: Callable[[int, int], Sequence[int]], num_blocks: int
    ) -> list[bytes]:
        """The keys of the request's first ``num_blocks`` full blocks (kept until ``forget``:
        a request's tokens only ever grow)."""
        keys = self._keys.setdefault(request_id, [])
        extend_keys(keys, self.salt, token_slice, num_blocks, self.block_size)
        return keys[:num_blocks]

    def forget(self, request_id: str) -> None:
        """Drop what is kept about a finished request."""
        self._keys.pop(request_id, None)

    def cached_run(
        self, keys: Sequence[bytes], token_after: Callable[[int], int | None] | None = None
    ) -> tuple[list[int], bool]:
        """The published blocks of the longest leading run of ``keys``. With ``token_after``
        (block index -> the sequence's token after that block, None when unknown), each block
        is looked for with that token after it, and the run ends at the first one found only
        with another; the flag says whether the run's last block matched there (always True
        without ``token_after``)."""
        blocks: list[int] = []
        for i, key in enumerate(keys):
            found = self.pool.lookup(key, None if token_after is None else token_after(i))
            if found is None:
                break
            blocks.append(found[0])
            if not found[1]:
                return blocks, False
        return blocks, True

    def take_cached(self, request_id: str, blocks: Sequence[int]) -> None:
        """Start a request's table with published blocks, shared (one more owner each)."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already has a block table")
        for b in blocks:
            self.pool.share(b)
        self._tables[request_id] = list(blocks)
        self._published[request_id] = len(blocks)
        self._drafted[request_id] = self.num_drafted(blocks)

    def copy_on_write(self, request_id: str, index: int) -> tuple[int, int] | None:
        """Put a block of the request's own in place of ``table[index]``, for slots it will
        rewrite; returns (the block it replaced, the new one), whose contents the worker must
        copy before the step runs; None (nothing changed) when no block is free. The blocks
        after ``index`` must not be published."""
        table = self._tables[request_id]
        if self.pool.num_free < 1:
            return None
        (copy,) = self.pool.allocate(1)
        source, table[index] = table[index], copy
        self.pool.release([source])
        self._published[request_id] = min(self._published.get(request_id, 0), index)
        self._drafted[request_id] = min(self._drafted.get(request_id, 0), index)
        return source, copy

    def num_published(self, request_id: str) -> int:
        return self._published.get(request_id, 0)

    def num_drafted_blocks(self, request_id: str) -> int:
        """The request's leading blocks its drafter's cache holds, as last published."""
        return self._drafted.get(request_id, 0)

    def publish(
        self,
        request_id: str,
        keys: Sequence[bytes],
        after: Callable[[int], int] | None = None,
        drafted: int | None = None,
    ) -> None:
        """Publish the request's first ``len(keys)`` blocks under ``keys``: every slot in them
        holds the K/V of a verified token in the target's cache, and in the drafter's for the
        first ``drafted`` blocks (None: all). ``after(i)``: the token after block i, for a
        drafter whose cache at a block's last slot depends on it (EAGLE). A block whose key
        (and token after) another block already has stays unpublished."""
        table = self._tables[request_id]
        start = self._published.get(request_id, 0)
        drafted = len(keys) if drafted is None else drafted
        for i in range(start, len(keys)):
            self.pool.publish(table[i], keys[i], None if after is None else after(i), i < drafted)
        self._published[request_id] = max(start, len(keys))
        for i in range(self._drafted.get(request_id, 0), min(drafted, len(table))):
            if self.pool.key_of(table[i]) is not None:
                self.pool.mark_drafted(table[i])
        self._drafted[request_id] = max(self._drafted.get(request_id, 0), drafted)

    def num_drafted(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks``, from the first, the drafter's cache holds."""
        n = 0
        while n < len(blocks) and self.pool.is_drafted(blocks[n]):
            n += 1
        return n

    def reset_prefix_cache(self) -> int:
        """Forget every published block (owners keep theirs); returns how many there were."""
        return self.pool.reset_cache()

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached
