"""The pool of physical KV blocks: owners per block, and the blocks findable by their contents.

A block is in one of three states: free (no owner, nothing findable in it), idle (no owner, but
published under a key: a prefix-cache entry kept until the pool needs the block), or in use (one
owner or more, published or not). ``allocate`` takes free blocks first, then evicts idle ones,
least recently released first.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable


class BlockPool:
    """Hands out block ids ``0 .. num_blocks-1`` and takes them back.

    Reference counts make a block shareable; a block returns to the pool when its last owner
    releases it: to the free list, or, when published, to the idle blocks still findable by
    ``lookup``. Releasing a block nobody owns is a bug and raises.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._idle: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self._ref_counts = [0] * num_blocks
        self._key_of: list[bytes | None] = [None] * num_blocks
        self._after: list[int | None] = [None] * num_blocks  # see ``publish``
        self._drafted = [False] * num_blocks  # see ``publish``
        self._cache: dict[bytes, dict[int | None, int]] = {}  # key -> token after -> block
        self._num_cached = 0
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks no request owns: free, or idle in the prefix cache (evictable)."""
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Published blocks, owned or idle."""
        return self._num_cached

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks (all or none), evicting idle ones once no free one is left; raises
        if fewer than ``n`` have no owner."""
        if n > self.num_free:
            raise MemoryError(f"asked for {n} KV blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._idle.popitem(last=False)
                self._unpublish(b)
                self.num_evictions += 1
            self._ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def share(self, block: int) -> None:
        """Add an owner to a block in use, or take an idle one out of the evictable set."""
        if self._ref_counts[block] == 0:
            if block not in self._idle:
                raise ValueError(f"block {block} is free and cannot be shared")
            del self._idle[block]
        self._ref_counts[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one owner of each block, in order; a block left with none becomes free, or idle
        (most recently released last) when published."""
        for b in blocks:
            if self._ref_counts[b] == 0:
                raise ValueError(f"block {b} released twice")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                if self._key_of[b] is not None:
                    self._idle[b] = None
                else:
                    self._free.append(b)

    # ---- the prefix cache --------------------------------------------------------------------
    def publish(
        self, block: int, key: bytes, after: int | None = None, drafted: bool = True
    ) -> bool:
        """Make an owned block findable under ``key`` (its contents' identity) and ``after``:
        the token after the block's last position, for a drafter whose cache there depends on
        it (None: no such drafter). ``drafted``: whether the drafter's cache holds the block too
        (else only the target's does; ``mark_drafted`` says when it does). False when another
        block is published under both, or this block already is."""
        if self._ref_counts[block] == 0:
            raise ValueError(f"block {block} is not owned and cannot be published")
        entries = self._cache.setdefault(key, {})
        if after in entries or self._key_of[block] is not None:
            return False
        entries[after] = block
        self._key_of[block] = key
        self._after[block] = after
        self._drafted[block] = drafted
        self._num_cached += 1
        return True

    def mark_drafted(self, block: int) -> None:
        """The drafter's cache now holds a published block too."""
        self._drafted[block] = True

    def is_drafted(self, block: int) -> bool:
        """Whether the drafter's cache holds a published block."""
        return self._drafted[block]

    def lookup(self, key: bytes, after: int | None = None) -> tuple[int, bool] | None:
        """A block published under ``key``, and whether it was published with ``after``
        (else it is one published with another token after it); None if there is none."""
        entries = self._cache.get(key)
        if not entries:
            return None
        if after in entries:
            return entries[after], True
        return next(iter(entries.values())), False

    def key_of(self, block: int) -> bytes | None:
        return self._key_of[block]

    def token_after(self, block: int) -> int | None:
        return self._after[block]

    def reset_cache(self) -> int:
        """Forget every key: idle blocks become free, owned ones stay with their owners but can
        no longer be found. Returns how many blocks were published."""
        n = self._num_cached
        for entries in self._cache.values():
            for b in entries.values():
                self._key_of[b] = self._after[b] = None
        self._cache.clear()
        self._num_cached = 0
        self._free.extend(self._idle)
        self._idle.clear()
        return n

    def _unpublish(self, block: int) -> None:
        key = self._key_of[block]
        if key is not None:
            entries = self._cache[key]
            del entries[self._after[block]]
            if not entries:
                del self._cache[key]
            self._key_of[block] = self._after[block] = None
            self._num_cached -= 1
