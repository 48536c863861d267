"""What the offline bench's cells draft: a ``Draft`` is a ``DraftShape`` (plain decoding, a
chain of k tokens, or a tree) or ``"auto"`` (``num_speculative_tokens="auto"``), and the keys
of ``speculative_config`` that ask an engine for it.

A tree is spelt as ``DraftShape`` prints it, ``DxK/N``: depth D (drafter passes a round, at
most D + 1 tokens), K children per expanded node, N nodes verified by the target.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Literal

from specbatch.draft_shape import DraftShape
from specbatch.errors import InvalidInputError

Draft = DraftShape | Literal["auto"]
PLAIN = DraftShape()
TREE_SPELLING = "DEPTHxTOPK/NODES, for example 4x4/16"
_TREE = re.compile(r"(\d+)x(\d+)/(\d+)")


def most_nodes(depth: int, topk: int) -> int:
    """The candidates a tree grows: ``topk`` children of the root, then ``topk`` children of
    each of the ``topk`` nodes it expands at every further depth."""
    return topk + (depth - 1) * topk * topk


def tree_problem(shape: DraftShape) -> str | None:
    """What is wrong with a tree cell's shape (its spelling first, then the limit), or None."""
    name = f"{shape.depth}x{shape.topk}/{shape.nodes}"
    if shape.depth < 1:
        return f"{name}: the depth must be >= 1"
    if shape.topk < 2:
        return f"{name}: a tree has >= 2 children per node (chains are --draft-lengths)"
    most = most_nodes(shape.depth, shape.topk)
    if not shape.depth <= shape.nodes <= most:
        return (
            f"{name}: the nodes must be >= the depth ({shape.depth}) and <= the {most} "
            "candidates a tree of that depth and topk grows"
        )
    return None


def parse_tree(text: str) -> DraftShape:
    """``--trees``: ``DxK/N``, checked; the error's message starts with the text given."""
    m = _TREE.fullmatch(text.strip())
    if m is None:
        hint = re.fullmatch(r"(\d+)x(\d+)x(\d+)", text.strip())
        also = f" (write {hint[1]}x{hint[2]}/{hint[3]})" if hint else ""
        raise InvalidInputError(f"{text!r}: expected {TREE_SPELLING}{also}")
    shape = DraftShape(int(m[1]), int(m[2]), int(m[3]))
    problem = tree_problem(shape)
    if problem is not None:
        raise InvalidInputError(problem)
    return shape


def parse_draft_length(text: str) -> int | Literal["auto"]:
    """``--draft-lengths``: an integer k >= 0 (0: plain decoding) or ``auto``."""
    if text == "auto":
        return "auto"
    try:
        k = int(text)
    except ValueError:
        raise InvalidInputError(f"expected an integer or 'auto', got {text!r}") from None
    if k < 0:
        raise InvalidInputError(f"expected an integer >= 0 or 'auto', got {k}")
    return k


def order(draft: Draft) -> tuple[int, ...]:
    """Sort key: plain and chains by length, then trees, then auto."""
    if draft == "auto":
        return (2,)
    assert isinstance(draft, DraftShape)
    if draft.is_chain:
        return (0, draft.depth)
    return (1, draft.depth, draft.topk, draft.nodes)


def is_tree(draft: Draft) -> bool:
    return isinstance(draft, DraftShape) and not draft.is_chain


def auto_shape(fixed: Iterable[Draft], default_depth: int) -> DraftShape:
    """The largest drafts of the grid's auto cell: as deep as its deepest fixed cell
    (``default_depth`` when it has none), and, when it has trees, with their largest topk
    and node count, so that auto's ladder holds trees of that many children."""
    shapes = [d for d in fixed if isinstance(d, DraftShape) and d.nodes > 0]
    depth = max((d.depth for d in shapes), default=default_depth)
    trees = [d for d in shapes if not d.is_chain]
    if not trees:
        return DraftShape.chain(depth)
    return DraftShape(depth, max(t.topk for t in trees), max(t.nodes for t in trees))


def speculative_keys(draft: Draft, largest: DraftShape, tree_children: str) -> dict[str, Any]:
    """The ``speculative_config`` keys of a speculative cell: its draft length, or its tree,
    or auto up to ``largest``."""
    if draft == "auto":
        keys: dict[str, Any] = {"num_speculative_tokens": "auto", "max_draft_length": largest.depth}
        shape = largest
    else:
        assert isinstance(draft, DraftShape)
        keys = {"num_speculative_tokens": draft.depth}
        shape = draft
    if not shape.is_chain:
        keys |= {"topk": shape.topk, "num_draft_tokens": shape.nodes}
        keys["tree_children"] = tree_children
    return keys
