"""The pool of physical KV blocks: which are free, and how many owners each one has."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out block ids ``0 .. num_blocks-1`` and takes them back.

    Reference counts make a block shareable (prefix caching); a block returns to the free list
    when its last owner releases it. Releasing a free block is a bug and raises.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (all or none); raises if fewer are free."""
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def share(self, block: int) -> None:
        """Add an owner to a block that is already in use."""
        if self._ref_counts[block] == 0:
            raise ValueError(f"block {block} is free and cannot be shared")
        self._ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one owner of each block; blocks left with none become free (most recent last)."""
        for b in blocks:
            if self._ref_counts[b] == 0:
                raise ValueError(f"block {b} released twice")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)
