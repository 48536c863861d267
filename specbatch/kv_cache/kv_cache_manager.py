"""Block tables: which physical blocks hold each request's token slots.

One table per request, shared by the target and the draft model: block ``b`` is an index into both
models' cache tensors, and token position ``i`` of a request lives in slot
``table[i // block_size] * block_size + i % block_size``. Pure Python; no torch.
"""

from __future__ import annotations

from specbatch.kv_cache.block_pool import BlockPool


def blocks_for(num_slots: int, block_size: int) -> int:
    return -(-num_slots // block_size)


class KVCacheManager:
    """Grows, shrinks and frees the block tables of requests.

    Contract: a table always covers a prefix of positions ``0 .. n-1``. ``allocate`` grows it (all
    or nothing), ``truncate`` frees whole tail blocks that only hold slots at or past ``n`` (the
    slots of rejected drafts), ``free`` drops the whole table. Only the scheduler calls these.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

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
        keep = blocks_for(num_slots, self.block_size)
        if keep < len(table):
            self.pool.release(table[keep:])
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
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.release(table)

    def has_table(self, request_id: str) -> bool:
        return request_id in self._tables
