"""What the speculative round asks of a drafter (THEORY.md, step 1), and what it gets back.

Given the step's requests and the draft shape each may fill (a chain of ``k`` tokens, or a
tree: ``specbatch/draft_shape.py``), a drafter proposes draft nodes and, when they were sampled,
the distribution q at each node that grew children (``proposal.py``). The worker's round is the
same for every drafter; the verifier needs only the nodes, their parents, q (or "not sampled")
and p.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from specbatch.draft_shape import DraftShape
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler.output import NewRequestData, ScheduledRequest
from specbatch.worker.grammar_masks import StepGrammars
from specbatch.worker.penalties import Penalties
from specbatch.worker.proposal import Proposal

T = TypeVar("T")


@dataclass
class DraftRound:
    """One step, as a drafter sees it."""

    requests: list[ScheduledRequest]  # every request of the step, prompt chunks included
    sampling: list[ScheduledRequest]  # the requests that emit tokens this step (result order)
    shapes: list[DraftShape]  # the drafts each of ``sampling`` may propose (none allowed)
    params: list[SamplingParams]  # their sampling parameters
    uniforms: torch.Tensor  # [len(sampling), W]: each request's draws for drafting
    greedy: bool  # every request of ``sampling`` is greedy
    penalties: Penalties | None = None  # the histories of ``sampling``, if any is penalised
    grammars: StepGrammars | None = None  # the grammars of ``sampling``, if any has one
    passes: list[tuple[str, int, float]] = field(default_factory=list)  # the drafter's, timed
    mark: float = field(default_factory=time.perf_counter)  # the end of the last timed pass

    def timed(self, rows: int, run: Callable[[], T]) -> T:
        """``run()``, the drafter's pass over ``rows`` beam nodes of one depth, noted in
        ``passes`` with the seconds since the last pass ended: the work that prepared it (its
        inputs, sampling the tokens it reads) is its cost too, so a deeper draft is priced
        whole."""
        out = run()
        self.note("draft", rows)
        return out

    def note(self, kind: str, rows: int) -> None:
        """A pass (``"catch-up"``: the drafter's first, over what it has not seen, up to the
        roots' logits; ``"draft"``: a depth) that ended now, over ``rows`` rows."""
        self.note_split(kind, [rows])

    def note_round(
        self, start: float, catch_up_rows: int, catch_up_seconds: float, rows: list[int]
    ) -> None:
        """The catch-up pass over ``catch_up_rows`` rows and the depths' passes over
        ``rows[i]`` rows each, run as one call that started at ``start`` and ended now, its
        first ``catch_up_seconds`` the catch-up's."""
        self.passes.append(("catch-up", catch_up_rows, start - self.mark + catch_up_seconds))
        self.mark = start + catch_up_seconds
        self.note_split("draft", rows)

    def note_split(self, kind: str, rows: list[int]) -> None:
        """Passes of ``kind`` over ``rows[i]`` rows each, run as one call that ended now: each
        noted with an equal share of its seconds."""
        now = time.perf_counter()
        share = (now - self.mark) / max(len(rows), 1)
        self.passes.extend((kind, n, share) for n in rows)
        self.mark = now

    @property
    def tree(self) -> bool:
        """Whether some request drafts a tree (children per node > 1) this step."""
        return any(not s.is_chain for s in self.shapes)

    def empty_proposal(self, device: torch.device) -> Proposal:
        return Proposal.empty(len(self.sampling), device)


@dataclass
class TargetPass:
    """What the step's target pass computed that a drafter may read."""

    features: torch.Tensor  # [T, F]: every row of the pass (prompt chunks' and drafts' too)
    row_starts: list[int]  # the first row of each request of the step, in step order


@dataclass
class RoundOutcome:
    """What verification decided, as a drafter sees it after the round."""

    emitted: list[list[int]]  # the tokens each request of ``sampling`` emitted
    accepted: list[int]  # how many of its drafts were accepted
    kept_rows: list[list[int]]  # per step request: the target-pass rows of the positions kept
    target: TargetPass | None  # the features the drafter asked for (``feature_layers``)


class Drafter:
    """A drafter on one rank; every method is called on every rank with the same arguments.
    What the scheduler sends it each step for its own KV cache is its registry entry's
    ``draft_input`` (``specbatch/drafters.py``).

    ``feature_layers``: the target features it reads after each pass: None (none), () (the
    final hidden states), or the residual streams entering these target layers."""

    feature_layers: tuple[int, ...] | None = None

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes one KV block costs the drafter (0: it keeps no KV cache)."""
        return 0

    def init_kv_cache(self, num_blocks: int) -> None:
        pass

    def attention(self) -> tuple[torch.nn.Module, object, int | None] | None:
        """The model whose paged attention its passes run, that attention's backend, and the
        most cached keys a pass reads of a request (None: its whole context); None: it runs no
        attention."""
        return None

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of blocks ``src`` into blocks ``dst`` in the drafter's cache, if any."""

    def add_request(self, new: NewRequestData) -> None:
        pass

    def finish_request(self, request_id: str) -> None:
        pass

    def propose(self, step: DraftRound) -> Proposal:
        """Draft nodes for ``step.sampling``. Called every step (a drafter with a KV cache
        catches up on prompt chunks even when nothing is drafted)."""
        raise NotImplementedError

    def observe(self, step: DraftRound, outcome: RoundOutcome) -> None:
        """After verification."""
