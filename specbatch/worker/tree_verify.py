"""Exact acceptance over a draft tree: each round emits the tokens of one root-to-node path and
one more, distributed as sampling the target's p token by token.

Two rules, chosen per request by how its children were drawn:
- **walk** (children chosen deterministically: top-k, argmaxes, a lookup): at the current node
  draw y from p; if y is one of its children, descend and emit y; else emit y and stop. A node
  without children is a leaf: its draw is the bonus token. Each emitted token is a draw from p
  at its prefix, so the law is exact; acceptance at a node is p's mass on its children.
- **recursive rejection sampling** (children drawn from q without replacement, in drawing
  order; Jeon et al., 2024): candidate i is accepted with probability min(1, P_i(x) / Q_i(x));
  on a rejection, P_{i+1} = norm(max(0, P_i - Q_i)) and Q_{i+1} is Q_i without x_i, renormalised;
  when every candidate is rejected, the token is drawn from the last P. With one child this is
  THEORY.md's rule (acceptance 1 - TV(p, q)).

Batched over requests, one pass per tree depth; no host sync inside.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specbatch.worker.sampler import sample
from specbatch.worker.tree_topology import Topology


@dataclass
class TreeVerdict:
    token_ids: torch.Tensor  # int64 [B, D+1]: the accepted path's tokens, then one more
    num_accepted: torch.Tensor  # int64 [B]
    path: torch.Tensor  # int64 [B, D]: the accepted nodes in order (padding 0)
    rejected: torch.Tensor  # bool [B]: the round ended at a node that had children


def walk_draws(depth: int) -> int:
    """Uniforms one request's walk needs: one per level."""
    return depth + 1


def rrs_draws(depth: int, topk: int) -> int:
    """Uniforms one request's recursive rejection sampling needs: per level, one per candidate
    and one for the token drawn when every candidate is rejected."""
    return (depth + 1) * (topk + 1)


def verify_tree(
    tokens: torch.Tensor,
    topo: Topology,
    p: torch.Tensor,
    first_row: torch.Tensor,
    u: torch.Tensor,
    q: torch.Tensor | None = None,
    rrs: torch.Tensor | None = None,
    topk: int = 1,
) -> TreeVerdict:
    """Verify B trees.

    Args:
        tokens: int64 [B, N], node j's token at column j - 1.
        topo: the trees' ``Topology``.
        p: the target's distribution at every verified row, float [R, V] (rows sum to 1; a
            greedy row is one-hot); or, when every request is greedy, its argmax int64 [R].
        first_row: int64 [B], request b's root row in ``p`` (node j at ``first_row[b] + j``).
        u: [B, W] uniforms: ``walk_draws`` or ``rrs_draws`` of them per request.
        q: [B, N, V], q at each node that grew sampled children (needed when ``rrs``).
        rrs: bool [B], requests verified by recursive rejection sampling (the others walk).
        topk: the most children a node has (it sets the layout of ``rrs_draws``).
    """
    batch = tokens.shape[0]
    device = tokens.device
    levels = topo.path.shape[2] + 1
    width = topo.children.shape[2]
    root = torch.zeros(batch, 1, dtype=tokens.dtype, device=tokens.device)
    node_token = torch.cat([root, tokens], dim=1)  # [B, N+1]
    cur = torch.zeros(batch, dtype=torch.int64, device=device)
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    out = torch.zeros(batch, levels, dtype=torch.int64, device=device)
    path = torch.zeros(batch, max(levels - 1, 1), dtype=torch.int64, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    rejected = torch.zeros(batch, dtype=torch.bool, device=device)
    use_rrs = rrs if rrs is not None and q is not None and bool(rrs.any()) else None
    for level in range(levels):
        kids = topo.children.gather(1, cur.view(batch, 1, 1).expand(batch, 1, width))[:, 0]
        has = kids >= 0
        kid_tokens = torch.where(has, node_token.gather(1, kids.clamp(min=0)), -1)
        row = first_row + cur
        if p.dim() == 1:  # every request greedy: argmaxes
            y = p[row]
            chosen, hit = _match(y, kids, kid_tokens)
        else:
            probs = p.index_select(0, row)
            y = sample(probs, u[:, level])
            chosen, hit = _match(y, kids, kid_tokens)
            if use_rrs is not None:
                assert q is not None
                at = cur.clamp(max=q.shape[1] - 1)  # a node past q's last column is a leaf
                q_node = q.gather(1, at.view(batch, 1, 1).expand(batch, 1, q.shape[2]))[:, 0]
                r_chosen, r_hit, r_y = _rrs_level(probs, q_node, kids, kid_tokens, u, level, topk)
                chosen = torch.where(use_rrs, r_chosen, chosen)
                hit = torch.where(use_rrs, r_hit, hit)
                y = torch.where(use_rrs, r_y, y)
        hit = hit & alive
        emitted = torch.where(hit, node_token.gather(1, chosen[:, None])[:, 0], y)
        out[:, level] = torch.where(alive, emitted, 0)
        if level < levels - 1:
            path[:, level] = torch.where(hit, chosen, 0)
        rejected |= alive & ~hit & has[:, 0]
        num_accepted += hit
        cur = torch.where(hit, chosen, cur)
        alive = hit
    return TreeVerdict(out, num_accepted, path, rejected)


def _match(
    y: torch.Tensor, kids: torch.Tensor, kid_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The child whose token is ``y``, and whether there is one."""
    match = kid_tokens == y[:, None]
    hit = match.any(dim=1)
    chosen = kids.gather(1, match.to(torch.int64).argmax(dim=1, keepdim=True))[:, 0]
    return torch.where(hit, chosen, 0), hit


def _rrs_level(
    p: torch.Tensor,
    q: torch.Tensor,
    kids: torch.Tensor,
    kid_tokens: torch.Tensor,
    u: torch.Tensor,
    level: int,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One node's recursive rejection sampling: (the accepted child, whether one was, and the
    token drawn from the last residual when none was)."""
    batch, width = kids.shape
    base = level * (topk + 1)
    p, q = p.float(), q.float()
    done = torch.zeros(batch, dtype=torch.bool, device=p.device)
    chosen = torch.zeros(batch, dtype=torch.int64, device=p.device)
    for k in range(width):
        exists = (kids[:, k] >= 0) & ~done
        x = kid_tokens[:, k].clamp(min=0)[:, None]
        px, qx = p.gather(1, x)[:, 0], q.gather(1, x)[:, 0]
        accept = exists & (u[:, base + k] * qx < px)
        chosen = torch.where(accept, kids[:, k], chosen)
        done |= accept
        rejected = (exists & ~accept)[:, None]
        residual = torch.clamp(p - q, min=0.0)
        mass = residual.sum(dim=1, keepdim=True)
        # p == q (numerically) leaves no residual: a rejection had probability ~0; keep p
        p = torch.where(rejected & (mass > 0), residual / mass.clamp(min=1e-30), p)
        without = q.scatter(1, x, 0.0)
        left = without.sum(dim=1, keepdim=True)
        q = torch.where(rejected & (left > 0), without / left.clamp(min=1e-30), q)
    y = sample(p, u[:, base + topk])
    return chosen, done, y
