"""How a model drafter (a draft model, an EAGLE head) grows each request's drafts from its root,
one batched pass per depth: a chain (one child per node) here, or a tree (EAGLE-2's dynamic
tree: ``draft_tree.py``).

A chain's pass of depth d reads each request's draft d at position ``base + d - 1`` and writes
its K/V at that key index (the scheduler reserves ``DraftShape.lookahead`` slots); its inputs
are built on the host, a row a request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specbatch.scheduler.output import ScheduledRequest
from specbatch.worker.draft_roots import DraftPass, Roots
from specbatch.worker.draft_tree import TreeGrower
from specbatch.worker.model_runner import ForwardInputs, build_inputs
from specbatch.worker.proposal import Proposal
from specbatch.worker.proposer import DraftRound
from specbatch.worker.sampler import SamplingTensors, logits_to_probs, sample


@dataclass
class CatchUp:
    """A drafter's pass over the tokens it has not seen (positions ``draft_start ..``)."""

    requests: list[ScheduledRequest]
    inputs: ForwardInputs
    last_row: dict[str, int]  # request id -> the row of its last token in the pass


def catch_up(step: DraftRound, block_size: int, device: torch.device) -> CatchUp | None:
    """One ragged pass over every request's tokens the drafter has not seen, or None."""
    catch = [r for r in step.requests if r.draft_token_ids]
    if not catch:
        return None
    ids: list[int] = []
    last: dict[str, int] = {}
    for r in catch:
        ids.extend(r.draft_token_ids)
        last[r.request_id] = len(ids) - 1
    inputs = build_inputs(
        torch.tensor(ids, dtype=torch.int64, device=device),
        [len(r.draft_token_ids) for r in catch],
        [r.draft_start for r in catch],
        [r.block_table for r in catch],
        block_size,
        device,
    )
    return CatchUp(catch, inputs, last)


def drafting(step: DraftRound) -> list[int]:
    """The indices of the sampling requests that draft this step."""
    return [i for i, s in enumerate(step.shapes) if s.nodes > 0]


def grow(
    step: DraftRound,
    roots: Roots,
    forward: DraftPass,
    block_size: int,
    sampled: bool,
) -> Proposal:
    """Draft nodes for ``step.sampling`` (requests outside ``roots.index`` get none), a pass
    per depth."""
    device = roots.logits.device
    if not roots.index:
        return step.empty_proposal(device)
    shapes = [step.shapes[i] for i in roots.index]
    topk = max(s.topk for s in shapes)
    assert all(s.topk == topk for s in shapes), "a step drafts one number of children per node"
    parents = None
    if topk == 1:
        tokens, probs, counts = _chain(step, roots, forward, block_size, [s.depth for s in shapes])
    else:
        g = TreeGrower(step, roots, forward, block_size, topk, sampled and not step.greedy)
        g.run(max(s.depth for s in shapes), [s.depth for s in shapes])
        nodes = torch.tensor([s.nodes for s in shapes], dtype=torch.int64, device=device)
        tokens, parents, count_t, probs = g.select(nodes)
        counts = count_t.tolist()
    return placed(step, roots.index, tokens, list(counts), probs, parents)


def placed(
    step: DraftRound,
    index: list[int],
    tokens: torch.Tensor,
    counts: list[int],
    probs: torch.Tensor | None,
    parents: torch.Tensor | None = None,
) -> Proposal:
    """The proposal for ``step.sampling`` whose requests ``index`` drafted ``tokens`` (their
    rows, in that order), the others nothing."""
    batch = len(step.sampling)
    if index == list(range(batch)):  # every request drafts: the rows are in place
        return Proposal(tokens, counts, probs, parents)
    device = tokens.device
    width = tokens.shape[1]
    out = Proposal.empty(batch, device, width)
    where = torch.tensor(index, dtype=torch.int64, device=device)
    out.tokens[where] = tokens
    out.counts = [0] * batch
    for i, n in zip(index, counts, strict=True):
        out.counts[i] = n
    if parents is not None:
        out.parents = torch.zeros(batch, width, dtype=torch.int64, device=device)
        out.parents[where] = parents
    if probs is not None:
        out.probs = torch.zeros(batch, width, probs.shape[2], device=device)
        out.probs[where] = probs
    return out


def _chain(
    step: DraftRound, roots: Roots, forward: DraftPass, block_size: int, depths: list[int]
) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """Chains: each request's draft d drawn from q (its argmax, greedy) at the one before.
    Returns tokens [A, D], for sampled steps q [A, D, V] (q of draft d + 1 at column d), and
    each request's drafts (its depth, or fewer where its grammar ended)."""
    device = roots.logits.device
    a, top = len(roots.index), max(depths)
    tokens = torch.zeros(a, top, dtype=torch.int64, device=device)
    probs = None if step.greedy else torch.zeros(a, top, roots.logits.shape[1], device=device)
    live = list(range(a))  # the requests still drafting, as rows of ``tokens``
    index = torch.tensor(roots.index, dtype=torch.int64, device=device)
    rows = torch.arange(a, device=device)
    logits, state = roots.logits, roots.state
    grammars = step.grammars
    drafted: list[list[int]] = [[] for _ in range(a)]  # host copies, for the grammars
    counts = list(depths)
    st = None if probs is None else SamplingTensors.from_params(
        [step.params[i] for i in roots.index], device)  # fmt: skip
    for d in range(1, top + 1):
        who = index[rows]
        if grammars is not None:
            owners = [roots.index[i] for i in live]
            logits = grammars.mask(logits, owners, [drafted[i] for i in live])
        if step.penalties is not None:
            before = torch.full_like(who, d - 1)
            logits = step.penalties.apply(logits, who, tokens[rows, : d - 1], before)
        if probs is None:
            x = logits.argmax(dim=-1)
        else:
            assert st is not None
            q = logits_to_probs(logits, st)
            x = sample(q, step.uniforms[who, d - 1])
            probs[rows, d - 1] = q
        tokens[rows, d - 1] = x
        if grammars is not None:  # a request whose grammar ended drafts no further
            for i, t in zip(live, x.tolist(), strict=True):
                drafted[i].append(t)
                if counts[i] > d and grammars.ends(roots.index[i], drafted[i]):
                    counts[i] = d
        keep = [k for k, i in enumerate(live) if counts[i] > d]
        if not keep:
            break
        if len(keep) < len(live):
            sel = torch.tensor(keep, dtype=torch.int64, device=device)
            x, rows = x[sel], rows[sel]
            state = None if state is None else state.index_select(0, sel)
            st = None if st is None else st.take(sel)
            live = [live[k] for k in keep]
        # each live chain's draft d, read at position base + d - 1 (built on the host: cheaper
        # than tensor ops for a chain's one row a request)
        starts = [roots.base[i] + d - 1 for i in live]
        blocks = [roots.blocks[i] for i in live]
        inputs = build_inputs(x, [1] * len(live), starts, blocks, block_size, device)
        state, logits = step.timed(len(live), lambda: forward(x, state, inputs))  # noqa: B023
    return tokens, probs, counts
