"""Draft trees as tensors: node 0 is a request's root (its last known token), nodes 1..n its
drafts, each with a parent of lower index. Batched over requests, [B, N] per quantity; a row
with fewer nodes is padded (parent 0, never read)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Topology:
    """Derived once per round from the parents."""

    depth: torch.Tensor  # int64 [B, N+1]: node j's depth (root 0)
    ancestors: torch.Tensor  # int64 [B, N+1]: bit i set when node i is node j or an ancestor
    children: torch.Tensor  # int64 [B, N+1, C]: node j's children in drawing order, -1 padding
    path: torch.Tensor  # int64 [B, N+1, D]: the nodes from depth 1 down to node j, -1 padding

    @staticmethod
    def of(parents: torch.Tensor, counts: torch.Tensor) -> Topology:
        """``parents`` int64 [B, N] (node j + 1's parent at column j), ``counts`` int64 [B]."""
        batch, n = parents.shape
        device = parents.device
        if n == 0 or batch == 0:  # no drafts: every root is a leaf
            ones = torch.ones(batch, n + 1, dtype=torch.int64, device=device)
            empty = torch.full((batch, n + 1, 1), -1, dtype=torch.int64, device=device)
            return Topology(ones - 1, ones, empty, empty.clone())
        valid = torch.arange(1, n + 1, device=device)[None, :] <= counts[:, None]
        parent = torch.where(valid, parents, 0)
        depth = torch.zeros(batch, n + 1, dtype=torch.int64, device=device)
        bits = torch.ones(batch, n + 1, dtype=torch.int64, device=device)
        for j in range(1, n + 1):  # a parent always has a lower index: one pass in order
            p = parent[:, j - 1]
            depth[:, j] = torch.where(valid[:, j - 1], depth.gather(1, p[:, None])[:, 0] + 1, 0)
            inherited = bits.gather(1, p[:, None])[:, 0]
            bits[:, j] = torch.where(valid[:, j - 1], inherited | _bit(j, device), 0)
        # sibling order: the number of earlier valid nodes with the same parent
        same = (parent[:, :, None] == parent[:, None, :]) & valid[:, None, :] & valid[:, :, None]
        earlier = torch.ones(n, n, dtype=torch.bool, device=device).tril(-1)
        rank = (same & earlier[None]).sum(dim=2)  # [B, N]
        width = max(1, int(rank.max()) + 1) if n else 1
        children = torch.full((batch, n + 1, width), -1, dtype=torch.int64, device=device)
        node = torch.arange(1, n + 1, device=device).expand(batch, n)
        where = parent * width + rank
        flat = children.view(batch, -1)
        flat.scatter_(1, torch.where(valid, where, flat.shape[1] - 1), torch.where(valid, node, -1))
        max_depth = max(1, int(depth.max())) if n else 1
        path = torch.full((batch, n + 1, max_depth), -1, dtype=torch.int64, device=device)
        nodes = torch.arange(n + 1, device=device).expand(batch, n + 1)
        at = nodes.clone()
        full_parent = torch.cat([torch.zeros_like(parent[:, :1]), parent], dim=1)
        for _ in range(max_depth):  # walk up from every node, filling its path from the end
            d = depth.gather(1, at)
            put = (d > 0) & (at > 0)
            col = (d - 1).clamp(min=0)
            cur = path.gather(2, col[:, :, None])[:, :, 0]
            path.scatter_(2, col[:, :, None], torch.where(put, at, cur)[:, :, None])
            at = torch.where(put, full_parent.gather(1, at), at)
        return Topology(depth, bits, children, path)


def _bit(j: int, device: torch.device) -> torch.Tensor:
    """Bit j of a signed 64-bit mask (bit 63 is the sign)."""
    value = (1 << j) - (1 << 64) if j == 63 else 1 << j
    return torch.tensor(value, dtype=torch.int64, device=device)


def path_tokens(tokens: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """The draft tokens on each node's path [B, N+1, D] (0 where the path is shorter), from
    ``tokens`` [B, N] (node j at column j - 1) and ``Topology.path``."""
    root = torch.zeros(tokens.shape[0], 1, dtype=tokens.dtype, device=tokens.device)
    flat = torch.cat([root, tokens], dim=1)  # node index -> token
    batch, nodes, depth = path.shape
    picked = flat.gather(1, path.clamp(min=0).reshape(batch, nodes * depth))
    picked = picked.view(batch, nodes, depth)
    return torch.where(path >= 0, picked, 0)


def chain_parents(batch: int, n: int, device: torch.device) -> torch.Tensor:
    """The parents of chains of n nodes: node j's parent is j - 1."""
    return torch.arange(n, device=device).expand(batch, n).contiguous()
