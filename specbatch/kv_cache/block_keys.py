"""Keys naming a full block's contents: a chain of SHA-256 digests.

Block ``i`` of a sequence holds the K/V of tokens ``i*B .. (i+1)*B - 1``, which depend on every
token before them. Its key is the digest of its parent's key (block ``i - 1``'s; the engine's
salt for block 0) and its own token ids, so equal keys mean equal token prefixes (up to SHA-256
collisions). The salt stands for everything else the contents depend on: which models, their
dtypes, the kernels' summation orders (batch-invariant mode, tensor parallelism, the attention
backend), the block size.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence


def salt_of(*parts: object) -> bytes:
    """The root key for an engine whose block contents depend on ``parts`` (their reprs)."""
    return hashlib.sha256(repr(parts).encode()).digest()


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.sha256(parent)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def extend_keys(
    keys: list[bytes],
    salt: bytes,
    token_slice: Callable[[int, int], Sequence[int]],
    num_blocks: int,
    block_size: int,
) -> None:
    """Grow ``keys`` (a sequence's first blocks' keys) to ``num_blocks`` keys; ``token_slice(a,
    b)`` gives the sequence's tokens ``a .. b-1``."""
    for i in range(len(keys), num_blocks):
        parent = keys[-1] if keys else salt
        keys.append(block_key(parent, token_slice(i * block_size, (i + 1) * block_size)))
