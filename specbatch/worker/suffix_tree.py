"""Suffix trees for suffix decoding (``method: suffix``): every substring of at most ``depth``
tokens of the sequences a tree holds, with how often it occurs, so that the longest suffixes of
a request's recent tokens are found and their most frequent continuations proposed. Plain
Python, no torch.

Representation. An explicit node is a substring that occurred at least twice, with its count
(occurrences, counted by where they start; a removal may leave it one). A substring that occurs
once is not stored token by token: its parent's child is a *tail*, a reference to that one
occurrence (sequence, position of its next token) read from the sequence itself, which may
still be growing, down to ``depth``. A tail is split into a node when a second occurrence
reaches it. So unique text costs one tail a token, and the nodes are the repeated substrings:
at most ``depth`` a token held.

Appending a token extends each suffix of the sequence shorter than ``depth`` by it; each such
suffix keeps its place (the deepest explicit node on its path known to it, which a split may
since have deepened), so an append costs O(``depth``). Removing a sequence walks its suffixes
and takes its occurrences out, deleting the nodes no occurrence is left in and its tails.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

_SHIFT = 40  # a tail packs (sequence, position) into one negative int


def _tail(seq_id: int, pos: int) -> int:
    return ~((seq_id << _SHIFT) | pos)


def _untail(ref: int) -> tuple[int, int]:
    v = ~ref
    return v >> _SHIFT, v & ((1 << _SHIFT) - 1)


class _Node:
    __slots__ = ("children", "count")

    def __init__(self, count: int) -> None:
        self.count = count
        self.children: dict[int, _Node | int] = {}  # token -> node, or a tail (an int)


# Where a path ends: at an explicit node (tail None), or inside a tail: the node the tail hangs
# from and (sequence, position of the occurrence's next token).
_Place = tuple[_Node, tuple[int, int] | None]


@dataclass
class Draft:
    """Proposed tokens as a tree: node ``j`` (1-based) is ``tokens[j - 1]``, its parent
    ``parents[j - 1]`` (0: the request's last token); a chain has parents 0, 1, 2, ...
    ``probs[j - 1]``: the empirical probability of the path to node ``j``, given the match."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match_len: int = 0

    @property
    def score(self) -> float:
        """The tokens the draft is expected to have accepted, by the counts it was read from."""
        return sum(self.probs)


class SuffixTree:
    """The substrings of at most ``depth`` tokens of the sequences held, each sequence under an
    integer id, with their counts."""

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth = depth
        self.root = _Node(0)
        self.seqs: dict[int, list[int]] = {}
        # per growing sequence, each suffix shorter than depth, shortest first: (the deepest
        # explicit node on its path known to it, that node's depth, where the suffix starts)
        self._open: dict[int, list[tuple[_Node, int, int]]] = {}
        self.num_nodes = 0  # explicit nodes, the root aside

    # ---- building --------------------------------------------------------------------------
    def extend(self, seq_id: int, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to sequence ``seq_id`` (a new one if unknown; not one closed)."""
        if seq_id in self.seqs and seq_id not in self._open:
            raise ValueError(f"sequence {seq_id} was closed: it cannot grow")
        seq = self.seqs.setdefault(seq_id, [])
        frontier = self._open.setdefault(seq_id, [])
        for t in tokens:
            frontier[:] = self._append(seq_id, seq, frontier, t)
            seq.append(t)

    def _append(
        self, sid: int, seq: list[int], frontier: list[tuple[_Node, int, int]], t: int
    ) -> list[tuple[_Node, int, int]]:
        """Each suffix extended by ``t`` (appended to ``seq`` after): the new frontier. The
        shortest first, so that a suffix whose tail a shorter one split this very append finds
        the split node."""
        end, depth, grown = len(seq), self.depth, []
        for node, nd, start in [(self.root, 0, end), *frontier]:
            length = end - start
            while nd < length:  # catch up through nodes split since it was placed
                child = node.children.get(seq[start + nd])
                if child.__class__ is not _Node:
                    break
                node, nd = child, nd + 1  # type: ignore[assignment]
            if nd < length:  # inside its own tail, which grows with the sequence
                if length + 1 < depth:
                    grown.append((node, nd, start))
                continue
            child = node.children.get(t)
            if child is None:  # a new substring: its occurrence is a tail
                node.children[t] = _tail(sid, end)
                place = (node, nd, start)
            elif child.__class__ is _Node:
                child.count += 1  # type: ignore[union-attr]
                place = (child, nd + 1, start)  # type: ignore[assignment]
            else:  # the second occurrence of what a tail held: a node
                osid, opos = _untail(child)  # type: ignore[arg-type]
                split = _Node(2)
                self.num_nodes += 1
                node.children[t] = split
                other = self.seqs[osid]
                if nd + 2 <= depth and opos + 1 < len(other):
                    split.children[other[opos + 1]] = _tail(osid, opos + 1)
                place = (split, nd + 1, start)
            if length + 1 < depth:
                grown.append(place)
        return grown

    def close(self, seq_id: int) -> None:
        """Sequence ``seq_id`` will not grow: forget its suffixes' places."""
        self._open.pop(seq_id, None)

    def remove(self, seq_id: int) -> None:
        """Take every occurrence of sequence ``seq_id`` out: nodes left without one are
        deleted, and so are its tails."""
        seq = self.seqs.pop(seq_id, None)
        self._open.pop(seq_id, None)
        if seq is None:
            return
        n = len(seq)
        for p in range(n):
            node = self.root
            for d in range(min(self.depth, n - p)):
                tok = seq[p + d]
                child = node.children[tok]
                if child.__class__ is not _Node:  # its own tail: the one occurrence left
                    del node.children[tok]
                    break
                child.count -= 1  # type: ignore[union-attr]
                if child.count == 0:  # type: ignore[union-attr]
                    del node.children[tok]
                    self.num_nodes -= _subtree_nodes(child)  # type: ignore[arg-type]
                    break
                node = child  # type: ignore[assignment]

    # ---- reading ---------------------------------------------------------------------------
    def find(self, pattern: Sequence[int]) -> _Place | None:
        """Where the path ``pattern`` ends (None: it does not occur)."""
        node, i, n = self.root, 0, len(pattern)
        while i < n:
            child = node.children.get(pattern[i])
            if child is None:
                return None
            if child.__class__ is _Node:
                node, i = child, i + 1  # type: ignore[assignment]
                continue
            sid, pos = _untail(child)  # type: ignore[arg-type]
            rest = n - i
            if self.seqs[sid][pos : pos + rest] != list(pattern[i:]):
                return None
            return node, (sid, pos + rest)
        return node, None

    def count(self, pattern: Sequence[int]) -> int:
        """Occurrences of ``pattern`` (1 to ``depth`` tokens)."""
        place = self.find(pattern) if 0 < len(pattern) <= self.depth else None
        if place is None:
            return 0
        return 1 if place[1] is not None else place[0].count

    def suffix_places(self, seq_id: int) -> list[tuple[int, _Place]]:
        """For growing sequence ``seq_id``: (m, the place of its last m tokens) for m = 1, 2,
        ... while they occur elsewhere too (up to ``depth - 1``), from its suffixes' places,
        brought up to date."""
        seq, out = self.seqs[seq_id], []
        frontier = self._open.get(seq_id, [])
        end = len(seq)
        for i, (node, nd, start) in enumerate(frontier):
            length = end - start
            while nd < length:
                child = node.children.get(seq[start + nd])
                if child.__class__ is not _Node:
                    break
                node, nd = child, nd + 1  # type: ignore[assignment]
            frontier[i] = (node, nd, start)
            if nd < length or node.count < 2:  # only here: no longer suffix occurs elsewhere
                break
            out.append((length, (node, None)))
        return out

    def _children(self, place: _Place) -> list[tuple[int, int, _Place]]:
        """The continuations of a place: (token, occurrences, the place after it), the most
        frequent first (ties: the one seen first)."""
        node, tail = place
        if tail is not None:
            sid, pos = tail
            seq = self.seqs[sid]
            return [(seq[pos], 1, (node, (sid, pos + 1)))] if pos < len(seq) else []
        out: list[tuple[int, int, _Place]] = []
        for tok, child in node.children.items():
            if child.__class__ is _Node:
                out.append((tok, child.count, (child, None)))  # type: ignore[union-attr]
            else:
                sid, pos = _untail(child)  # type: ignore[arg-type]
                out.append((tok, 1, (node, (sid, pos + 1))))
        out.sort(key=lambda c: -c[1])
        return out

    def grow(
        self, place: _Place, start_depth: int, nodes: int, depth: int, topk: int, min_prob: float
    ) -> Draft:
        """The draft from ``place`` (at string depth ``start_depth``): best first by the
        empirical probability of its path (a child's occurrences over those of its parent's
        continuations, times its parent's), each node's ``topk`` most frequent continuations,
        none whose probability is below ``min_prob``; at most ``nodes`` nodes, ``depth`` deep,
        and not past the tree's own depth. With ``topk == 1`` a chain."""
        room = min(depth, self.depth - start_depth)
        if nodes <= 0 or room <= 0:
            return Draft()
        if topk == 1:
            return self._chain(place, min(nodes, room), min_prob)
        draft = Draft()
        ticket = itertools.count()  # ties in probability: the earlier pushed first
        heap: list[tuple[float, int, int, int, int, _Place]] = []

        def expand(at: _Place, prob: float, parent: int, level: int) -> None:
            children = self._children(at)
            total = sum(c for _, c, _ in children)
            for tok, c, nxt in children[:topk]:
                p = prob * c / total
                if p < min_prob:
                    break  # the rest are no more frequent
                heapq.heappush(heap, (-p, next(ticket), parent, level, tok, nxt))

        expand(place, 1.0, 0, 1)
        while heap and len(draft.tokens) < nodes:
            neg, _, parent, level, tok, nxt = heapq.heappop(heap)
            draft.tokens.append(tok)
            draft.parents.append(parent)
            draft.probs.append(-neg)
            if level < room:
                expand(nxt, -neg, len(draft.tokens), level + 1)
        return draft

    def _chain(self, place: _Place, n: int, min_prob: float) -> Draft:
        """``grow`` with one child a node: the most frequent continuation, ``n`` at most."""
        draft, prob = Draft(), 1.0
        node, tail = place
        tokens, probs = draft.tokens, draft.probs
        while len(tokens) < n:
            if tail is not None:  # one occurrence: the rest of it, as far as it goes
                sid, pos = tail
                more = self.seqs[sid][pos : pos + n - len(tokens)]
                tokens += more
                probs += [prob] * len(more)
                break
            best, most, total = None, 0, 0
            for tok, child in node.children.items():
                c = child.count if child.__class__ is _Node else 1  # type: ignore[union-attr]
                total += c
                if c > most:
                    best, most = tok, c
            if best is None or prob * most / total < min_prob:
                break
            prob *= most / total
            tokens.append(best)
            probs.append(prob)
            child = node.children[best]
            if child.__class__ is _Node:
                node = child  # type: ignore[assignment]
            else:
                sid, pos = _untail(child)  # type: ignore[arg-type]
                tail = (sid, pos + 1)
        draft.parents = list(range(len(tokens)))
        return draft

    def best_draft(
        self,
        places: list[tuple[int, _Place]],
        nodes: int,
        spec_factor: float,
        min_prob: float,
        depth: int,
        topk: int = 1,
    ) -> Draft:
        """The draft of highest score grown from the places of a context's suffixes ((m,
        place), m ascending), each with at most ``min(nodes, m * spec_factor)`` nodes; ties:
        the longer match. A draft's score is at most its nodes and its levels, so a match whose
        bound cannot beat the best so far is not grown."""
        best, score = Draft(), 0.0
        for m, place in reversed(places):
            cap = min(nodes, int(m * spec_factor + 1e-6))
            if cap <= score:
                break  # shorter matches have no larger cap
            if min(depth, self.depth - m) <= score:
                continue
            draft = self.grow(place, m, cap, depth, topk, min_prob)
            if draft.score > score:
                draft.match_len = m
                best, score = draft, draft.score
        return best

    def speculate(
        self,
        context: Sequence[int],
        nodes: int,
        spec_factor: float,
        min_prob: float,
        depth: int | None = None,
        topk: int = 1,
    ) -> Draft:
        """``best_draft`` over every suffix of ``context`` that occurs, each found from the
        root. ``depth``: the draft's own (default: ``nodes``, a chain's)."""
        places = []
        for m in range(1, min(len(context), self.depth) + 1):
            place = self.find(context[len(context) - m :])
            if place is None:
                break  # no longer suffix occurs either
            places.append((m, place))
        return self.best_draft(
            places, nodes, spec_factor, min_prob, nodes if depth is None else depth, topk
        )

    # ---- checking --------------------------------------------------------------------------
    def check(self) -> None:
        """Raise AssertionError unless the tree is exactly the substrings of the sequences it
        holds (every count recounted from them, every tail on a sequence held, no node or tail
        for what no sequence holds). For tests: it reads every substring."""
        want: Counter[tuple[int, ...]] = Counter()
        for seq in self.seqs.values():
            for p in range(len(seq)):
                for m in range(1, min(self.depth, len(seq) - p) + 1):
                    want[tuple(seq[p : p + m])] += 1
        seen: Counter[tuple[int, ...]] = Counter()
        nodes = 0
        stack: list[tuple[_Node, tuple[int, ...]]] = [(self.root, ())]
        while stack:
            node, path = stack.pop()
            for tok, child in node.children.items():
                here = (*path, tok)
                assert here not in seen, f"{here} is in the tree twice"
                if child.__class__ is _Node:
                    nodes += 1
                    seen[here] = child.count  # type: ignore[union-attr]
                    assert child.count >= 1, f"node {here} has count {child.count}"  # type: ignore[union-attr]
                    stack.append((child, here))  # type: ignore[arg-type]
                    continue
                sid, pos = _untail(child)  # type: ignore[arg-type]
                assert sid in self.seqs, f"tail {here} on sequence {sid}, which is gone"
                seq = self.seqs[sid]
                assert seq[pos] == tok, f"tail {here} reads {seq[pos]} at {sid}:{pos}"
                q = pos
                while q < len(seq) and len(here) <= self.depth:
                    assert here not in seen, f"{here} is in the tree twice"
                    seen[here] = 1
                    q += 1
                    if q < len(seq):
                        here = (*here, seq[q])
        assert nodes == self.num_nodes, f"{nodes} nodes, num_nodes says {self.num_nodes}"
        assert seen == want, f"differs from the sequences at {sorted(set(seen) ^ set(want))[:5]}"


def _subtree_nodes(node: _Node) -> int:
    n, stack = 0, [node]
    while stack:
        x = stack.pop()
        n += 1
        stack.extend(c for c in x.children.values() if c.__class__ is _Node)  # type: ignore[misc]
    return n


class SuffixCache:
    """What suffix decoding remembers: per live request a tree of its prompt and output; one
    global tree of the outputs of at most ``max_cached`` requests, live ones included, the
    least recently extended evicted first (0: no global tree). A request's draft is the better
    scored of the two trees' (ties: its own tree's)."""

    def __init__(self, depth: int, max_cached: int) -> None:
        self.depth = depth
        self.max_cached = max_cached
        self.global_tree = SuffixTree(depth)
        self.local: dict[str, SuffixTree] = {}
        self.cached: OrderedDict[str, int] = OrderedDict()  # request -> its sequence id, LRU first
        self._ids = itertools.count()

    def start(self, request_id: str, prompt: Sequence[int]) -> None:
        if request_id in self.cached:  # an id seen before: its old output goes
            self.evict(request_id)
        tree = SuffixTree(self.depth)
        tree.extend(0, prompt)
        self.local[request_id] = tree
        if self.max_cached > 0:
            while len(self.cached) >= self.max_cached:
                self.evict(next(iter(self.cached)))
            self.cached[request_id] = next(self._ids)

    def extend(self, request_id: str, tokens: Sequence[int]) -> None:
        """Output tokens of a live request."""
        self.local[request_id].extend(0, tokens)
        sid = self.cached.get(request_id)
        if sid is not None:
            self.global_tree.extend(sid, tokens)
            self.cached.move_to_end(request_id)

    def stop(self, request_id: str) -> None:
        """The request finished: its own tree goes, its output stays cached."""
        self.local.pop(request_id, None)
        sid = self.cached.get(request_id)
        if sid is not None:
            self.global_tree.close(sid)

    def evict(self, request_id: str) -> None:
        sid = self.cached.pop(request_id)
        self.global_tree.remove(sid)

    def speculate(
        self,
        request_id: str,
        context: Sequence[int],
        nodes: int,
        spec_factor: float,
        min_prob: float,
        depth: int | None = None,
        topk: int = 1,
    ) -> Draft:
        """The request's draft after ``context``, its last tokens (prompt and output): the
        better scored of its own tree's and the global tree's (ties: its own). Its suffixes are
        placed from where its own sequence ends in each tree; in the global tree, which holds
        its output only, those reaching into its prompt are found from the root."""
        depth = nodes if depth is None else depth
        args = (nodes, spec_factor, min_prob, depth, topk)
        own = self.local[request_id].best_draft(self.local[request_id].suffix_places(0), *args)
        if not self.cached:
            return own
        tree, sid = self.global_tree, self.cached.get(request_id)
        places, out = [], 0
        if sid in tree.seqs:
            places, out = tree.suffix_places(sid), len(tree.seqs[sid])
        if len(places) == min(out, self.depth - 1):  # every suffix of its output occurs elsewhere
            for m in range(out + 1, min(len(context), self.depth) + 1):
                place = tree.find(context[len(context) - m :])
                if place is None:
                    break
                places.append((m, place))
        other = tree.best_draft(places, *args)
        return own if own.score >= other.score else other
