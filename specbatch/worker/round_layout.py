"""The layout of one round's target pass: where every request's new tokens and draft nodes sit,
which rows are verified, and what comes before each verified row.

Request after request, the pass holds its unprocessed tokens (a prompt, a chunk, or the last
token: the root) and, for a drafting request, its nodes 1..n right after the root. Node j is
written at key index ``root + j`` and sits at position ``root + depth(j)``; in a chain both are
``root + j``. The verified rows of request b are its root's and its nodes', in node order; the
rows a penalty or a logprob reads are picked from them with index tensors built here, once.
The host-side indices are computed with numpy (a small batch's round would otherwise pay
more for launching tensor ops than for the ops); a draft's topology is derived only when
something reads it: a tree's masks and positions, the penalties' paths, tree verification.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from specbatch.model.layers.attention import AttentionMetadata
from specbatch.scheduler.output import ScheduledRequest
from specbatch.worker.model_runner import ForwardInputs
from specbatch.worker.proposal import Proposal
from specbatch.worker.tree_topology import Topology, chain_parents, path_tokens


@dataclass
class RoundLayout:
    inputs: ForwardInputs
    row_starts: list[int]  # the first pass row of each request of the step
    verified_rows: torch.Tensor  # int64 [Rv]: pass rows of every sampling request's root and nodes
    first_verified: list[int]  # per sampling request, its root's index in ``verified_rows``
    row_request: torch.Tensor  # int64 [Rv]: the sampling index of each verified row
    proposal: Proposal

    @property
    def num_verified(self) -> int:
        return int(self.verified_rows.shape[0])

    def node_rows(self, b: int, nodes: list[int]) -> list[int]:
        """Indices in ``verified_rows`` of sampling request b's ``nodes``."""
        first = self.first_verified[b]
        return [first + j for j in nodes]

    @cached_property
    def topology(self) -> Topology:
        """The drafts as trees (a chain too)."""
        p = self.proposal
        counts = torch.tensor(p.counts, dtype=torch.int64, device=p.tokens.device)
        parents = p.parents
        if parents is None:
            parents = chain_parents(len(p.counts), p.tokens.shape[1], p.tokens.device)
        return Topology.of(parents, counts)

    @cached_property
    def paths(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per verified row, the drafts before it (int64 [Rv, D], 0 padding) and how many."""
        topo = self.topology
        valid = topo.depth.new_tensor(
            [[j <= n for j in range(topo.depth.shape[1])] for n in self.proposal.counts],
            dtype=torch.bool,
        )
        paths = path_tokens(self.proposal.tokens, topo.path)  # [S, N+1, D]
        if paths.shape[2]:
            return paths[valid], topo.depth[valid]
        return paths.new_zeros(int(valid.sum()), 0), topo.depth[valid]

    @staticmethod
    def build(
        requests: list[ScheduledRequest],
        sampling: list[ScheduledRequest],
        proposal: Proposal,
        block_size: int,
        device: torch.device,
    ) -> RoundLayout:
        counts = proposal.counts
        num_of = {r.request_id: n for r, n in zip(sampling, counts, strict=True)}
        nodes = [num_of.get(r.request_id, 0) if r.sample else 0 for r in requests]
        targets = np.array([len(r.target_token_ids) for r in requests], dtype=np.int64)
        q_lens = targets + np.array(nodes, dtype=np.int64)
        starts = np.array([r.target_start for r in requests], dtype=np.int64)
        row_starts = np.zeros(len(requests) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=row_starts[1:])
        total = int(row_starts[-1])

        seq = np.repeat(np.arange(len(requests)), q_lens)
        offset = np.arange(total) - row_starts[seq]
        keys = starts[seq] + offset  # each row's key index; its position, but in a tree
        is_node = offset >= targets[seq]
        input_ids = np.zeros(total, dtype=np.int64)
        input_ids[~is_node] = list(itertools.chain.from_iterable(
            r.target_token_ids for r in requests))  # fmt: skip
        on_host = proposal.tokens.device.type == "cpu"  # else placed on the device below

        # sampling requests: their verified rows (root, then nodes) and the nodes' rows
        sample_seq = np.array([i for i, r in enumerate(requests) if r.sample], dtype=np.int64)
        per = np.array(counts, dtype=np.int64) + 1
        root_row = row_starts[sample_seq] + targets[sample_seq] - 1  # [S]
        first = np.zeros(len(sampling), dtype=np.int64)
        np.cumsum(per[:-1], out=first[1:])
        row_request = np.repeat(np.arange(len(sampling)), per)
        node = np.arange(int(per.sum())) - first[row_request]  # 0: the root
        verified_rows = root_row[row_request] + node

        tables = [r.block_table for r in requests]
        w = max(map(len, tables), default=1) or 1
        table = np.zeros((len(requests), w), dtype=np.int64)
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
        slots = table[seq, keys // block_size] * block_size + keys % block_size
        drafts = node > 0
        width = proposal.tokens.shape[1]
        flat = row_request[drafts] * width + node[drafts] - 1  # each node's draft token
        if on_host and flat.size:
            input_ids[verified_rows[drafts]] = proposal.tokens.numpy().reshape(-1)[flat]
        seq_lens = starts + q_lens

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device)

        meta = AttentionMetadata(
            query_start_loc=dev(row_starts),
            seq_lens=dev(seq_lens),
            block_tables=dev(table),
            slot_mapping=dev(slots),
            query_lens_cpu=q_lens.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        ids_t, keys_t = dev(input_ids), dev(keys)
        layout = RoundLayout(
            inputs=ForwardInputs(ids_t, keys_t, meta),
            row_starts=row_starts[:-1].tolist(),
            verified_rows=dev(verified_rows),
            first_verified=first.tolist(),
            row_request=dev(row_request),
            proposal=proposal,
        )
        if any(counts) and (not on_host or proposal.parents is not None):
            node_rows = dev(verified_rows[drafts])
            if not on_host:
                ids_t[node_rows] = proposal.tokens.reshape(-1)[dev(flat)]
            if proposal.parents is not None:
                # a tree: a node sits at its root's position plus its depth, sees the keys
                # before its root and its ancestors; every other sequence, a prompt chunk in
                # particular, stays causal
                topo = layout.topology
                valid = torch.zeros(topo.depth.shape, dtype=torch.bool, device=device)
                valid[dev(row_request), dev(node)] = True
                depth = topo.depth[valid]
                pos = keys_t.clone()
                pos[node_rows] = keys_t[dev(root_row[row_request[drafts]])] + depth[dev(drafts)]
                layout.inputs.positions = pos
                tree_starts = np.full(len(requests), -1, dtype=np.int64)
                where = sample_seq[np.array(counts) > 0]
                tree_starts[where] = starts[where] + targets[where] - 1
                masks = torch.zeros(total, dtype=torch.int64, device=device)
                masks[layout.verified_rows] = topo.ancestors[valid]
                meta.tree_starts, meta.tree_masks = dev(tree_starts), masks
        return layout
