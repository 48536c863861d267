"""The layout of one round's target pass: where every request's new tokens and draft nodes sit,
which rows are verified, and what comes before each verified row.

Request after request, the pass holds its unprocessed tokens (a prompt, a chunk, or the last
token: the root) and, for a drafting request, its nodes 1..n right after the root. Node j is
written at key index ``root + j`` and sits at position ``root + depth(j)``; in a chain both are
``root + j``. The verified rows of request b are its root's and its nodes', in node order; the
rows a penalty or a logprob reads are picked from them with index tensors built here, once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from specbatch.model.layers.attention import AttentionMetadata
from specbatch.scheduler.output import ScheduledRequest
from specbatch.worker.model_runner import ForwardInputs
from specbatch.worker.proposer import Proposal
from specbatch.worker.tree_topology import Topology, chain_parents, path_tokens


@dataclass
class RoundLayout:
    inputs: ForwardInputs
    row_starts: list[int]  # the first pass row of each request of the step
    verified_rows: torch.Tensor  # int64 [Rv]: pass rows of every sampling request's root and nodes
    first_verified: list[int]  # per sampling request, its root's index in ``verified_rows``
    row_request: torch.Tensor  # int64 [Rv]: the sampling index of each verified row
    path_tokens: torch.Tensor  # int64 [Rv, D]: the drafts before each verified row
    path_len: torch.Tensor  # int64 [Rv]: how many
    topology: Topology  # the drafts as trees (a chain too)

    @property
    def num_verified(self) -> int:
        return int(self.verified_rows.shape[0])

    def node_rows(self, b: int, nodes: list[int]) -> list[int]:
        """Indices in ``verified_rows`` of sampling request b's ``nodes``."""
        first = self.first_verified[b]
        return [first + j for j in nodes]

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
        targets = [len(r.target_token_ids) for r in requests]
        q_lens = [t + n for t, n in zip(targets, nodes, strict=True)]
        starts = [r.target_start for r in requests]
        row_starts = list(itertools.accumulate(q_lens, initial=0))
        total = row_starts[-1]
        batch = len(requests)

        count_t = torch.tensor(counts, dtype=torch.int64, device=device)
        width = proposal.tokens.shape[1]
        parents = proposal.parents
        if parents is None:
            parents = chain_parents(len(sampling), width, device)
        topo = Topology.of(parents, count_t)

        q_len_t = torch.tensor(q_lens, dtype=torch.int64, device=device)
        qsl = torch.tensor(row_starts, dtype=torch.int64, device=device)
        start_t = torch.tensor(starts, dtype=torch.int64, device=device)
        seq = torch.repeat_interleave(
            torch.arange(batch, device=device), q_len_t, output_size=total
        )
        offset = torch.arange(total, device=device) - qsl[seq]
        keys = start_t[seq] + offset
        ids = torch.tensor(
            list(itertools.chain.from_iterable(r.target_token_ids for r in requests)),
            dtype=torch.int64,
        ).to(device)
        target_t = torch.tensor(targets, dtype=torch.int64, device=device)
        is_node = offset >= target_t[seq]
        input_ids = torch.zeros(total, dtype=torch.int64, device=device)
        input_ids[~is_node] = ids
        positions = keys

        # sampling requests: their verified rows (root, then nodes) and the nodes' rows
        sample_seq = [i for i, r in enumerate(requests) if r.sample]
        s_index = torch.tensor(sample_seq, dtype=torch.int64, device=device)
        root_row = qsl[s_index] + target_t[s_index] - 1  # [S]
        node_range = torch.arange(width + 1, device=device)
        valid = node_range[None, :] <= count_t[:, None]  # [S, N+1], root included
        verified_rows = (root_row[:, None] + node_range[None, :])[valid]
        first_verified = list(itertools.accumulate([n + 1 for n in counts], initial=0))[:-1]
        row_request = torch.arange(len(sampling), device=device)[:, None].expand_as(valid)[valid]
        if width and any(counts):
            node_valid = valid[:, 1:]
            node_rows = (root_row[:, None] + node_range[None, 1:])[node_valid]
            input_ids[node_rows] = proposal.tokens[node_valid]
            if proposal.parents is not None:
                depth = topo.depth[:, 1:][node_valid]
                positions = positions.clone()
                positions[node_rows] = keys[root_row.repeat_interleave(count_t)] + depth
        paths = path_tokens(proposal.tokens, topo.path)  # [S, N+1, D]
        path_of_row = paths[valid] if paths.shape[2] else paths.new_zeros(int(valid.sum()), 0)
        path_len = topo.depth[valid]

        tables = [r.block_table for r in requests]
        w = max(map(len, tables), default=1) or 1
        table = torch.tensor([t + [0] * (w - len(t)) for t in tables], dtype=torch.int64)
        table = table.to(device)
        slots = table[seq, keys // block_size] * block_size + keys % block_size
        seq_lens = [s + q for s, q in zip(starts, q_lens, strict=True)]
        meta = AttentionMetadata(
            query_start_loc=qsl,
            seq_lens=start_t + q_len_t,
            block_tables=table,
            slot_mapping=slots,
            query_lens_cpu=q_lens,
            seq_lens_cpu=seq_lens,
        )
        if proposal.parents is not None and any(counts):
            # the drafting requests' trees (each has one target token: its root); every other
            # sequence, a prompt chunk in particular, stays causal
            drafting = count_t > 0
            tree_starts = torch.full((batch,), -1, dtype=torch.int64, device=device)
            where = s_index[drafting]
            tree_starts[where] = start_t[where] + target_t[where] - 1
            masks = torch.zeros(total, dtype=torch.int64, device=device)
            masks[verified_rows] = topo.ancestors[valid]
            meta.tree_starts, meta.tree_masks = tree_starts, masks
        return RoundLayout(
            inputs=ForwardInputs(input_ids, positions, meta),
            row_starts=row_starts[:-1],
            verified_rows=verified_rows,
            first_verified=first_verified,
            row_request=row_request,
            path_tokens=path_of_row,
            path_len=path_len,
            topology=topo,
        )
