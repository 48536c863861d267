"""Draft trees as tensors: node 0 is a request's root (its last known token), nodes 1..n its
drafts, each with a parent of lower index. Batched over requests, [B, N] per quantity; a row
with fewer nodes is padded (never read). Derived without a loop over nodes: ancestors by
pointer doubling, and since a parent always has a lower index, a node's path is its
ancestors in index order."""

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
        nodes = torch.arange(n + 1, device=device)
        valid = nodes[None, :] <= counts[:, None]  # [B, N+1], the root included
        root = torch.zeros(batch, 1, dtype=torch.int64, device=device)
        up = torch.where(valid, torch.cat([root, parents], dim=1), 0)  # the root is its own parent
        # is_anc[b, j, i]: node i is node j or one of its ancestors (doubling: log2(N) steps)
        is_anc = torch.zeros(batch, n + 1, n + 1, dtype=torch.bool, device=device)
        is_anc.scatter_(2, nodes.expand(batch, -1)[:, :, None], True)
        is_anc |= torch.zeros_like(is_anc).scatter_(2, up[:, :, None], True)
        reach = up
        for _ in range(max(1, (n + 1).bit_length())):
            is_anc |= is_anc.gather(1, reach[:, :, None].expand(-1, -1, n + 1))
            reach = reach.gather(1, reach)
        is_anc &= valid[:, :, None]
        depth = is_anc.sum(dim=2) - 1
        depth = torch.where(valid, depth, 0)
        weights = torch.where(nodes < 63, 1 << nodes.clamp(max=62), 0)
        bits = (is_anc.long() * weights).sum(dim=2)
        if n >= 63:  # bit 63 is the sign of an int64
            bits = torch.where(is_anc[:, :, 63], bits | _bit(63, device), bits)
        # the path: ancestors but the root, in index order
        on_path = is_anc.clone()
        on_path[:, :, 0] = False
        max_depth = max(1, int(depth.max()))
        col = torch.where(on_path, on_path.cumsum(dim=2) - 1, max_depth)
        path = torch.full((batch, n + 1, max_depth + 1), -1, dtype=torch.int64, device=device)
        path.scatter_(2, col, nodes.expand(batch, n + 1, -1).contiguous())
        path = path[:, :, :max_depth]
        # children in index (drawing) order: node j's k-th child is its k-th node with parent j
        child = (up[:, None, :] == nodes[None, :, None]) & valid[:, None, :]  # [B, parent, node]
        child[:, :, 0] = False
        width = max(1, int(child.sum(dim=2).max()))
        slot = torch.where(child, child.cumsum(dim=2) - 1, width)
        children = torch.full((batch, n + 1, width + 1), -1, dtype=torch.int64, device=device)
        children.scatter_(2, slot, nodes.expand(batch, n + 1, -1).contiguous())
        return Topology(depth, bits, children[:, :, :width], path)


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
