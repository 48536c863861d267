"""The offline bench's grid: batch sizes x drafts (draft lengths, trees, auto), the workload
each cell runs, and their checks. ``offline.py`` runs it; ``engines.py`` builds its engines."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from specbatch.bench.drafts import Draft, auto_shape, order, tree_problem
from specbatch.bench.workload import WORKLOADS
from specbatch.draft_shape import DraftShape
from specbatch.errors import InvalidInputError
from specbatch.options import check_options, option, same_as
from specbatch.sampling_params import SamplingParams
from specbatch.speculative_config import SpeculativeConfig

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_DRAFT_LENGTHS = (0, 1, 2, 4, 8)
DEFAULT_INPUT_LEN = 64
DEFAULT_OUTPUT_LEN = 64
DEFAULT_OUTPUT_LEN_SPREAD = 0.5
INTERLEAVE = ("steps", "cells")


def default_num_requests(batch_size: int) -> int:
    """Requests measured per cell: four batches' worth, so that the engine runs full for most
    of the cell, and few enough that the default grid finishes in minutes on a CPU. A cell
    ends in a drain (nothing left to admit, the batch thinning as its last requests finish)
    that lasts about as long whatever the cell's size: with two batches' worth it was a
    large part of a small batch's cell, and a cell measured how the last requests
    finished as much as the batch size's throughput."""
    return max(4 * batch_size, 16)


@dataclass
class BenchConfig:
    model: str | None = None  # None: the built-in pair
    draft_model: str | None = None
    batch_sizes: list[int] = field(default_factory=lambda: list(DEFAULT_BATCH_SIZES))
    # chains of k drafts (0: plain decoding), or "auto"
    draft_lengths: list[int | Literal["auto"]] = field(
        default_factory=lambda: list(DEFAULT_DRAFT_LENGTHS)
    )
    trees: list[DraftShape] = field(default_factory=list)  # draft trees, cells beside them
    # fmt: off
    tree_children: str = same_as(SpeculativeConfig, "tree_children", flag=True)
    input_len: int = option(DEFAULT_INPUT_LEN, "prompt tokens per request", ge=1, metavar="N")
    shared_prefix_len: int = option(0, "every prompt starts with the same N tokens (a window "
        "of the held-out text), then its own --input-len tokens: the workload the prefix cache "
        "serves", ge=0, metavar="N")
    output_len: int = option(DEFAULT_OUTPUT_LEN, "output tokens per request, on average", ge=2,
        metavar="N")
    output_len_spread: float = option(DEFAULT_OUTPUT_LEN_SPREAD, "each prompt's output length "
        "uniform in --output-len x [1 - S, 1 + S], the same for every cell; 0: all exactly "
        "--output-len", ge=0, lt=1, metavar="S")
    num_requests: int | None = option(None, "requests measured per cell (default: max(4 B, "
        "16))", type=int, ge=1, metavar="N")
    prompts: str | None = option(None, "prompts file (.txt or .jsonl), each cut or repeated to "
        "--input-len tokens (default: the built-in pair's held-out stdlib text; random ids "
        "without a tokenizer)", type=Path, metavar="FILE")
    temperature: float = same_as(SamplingParams, "temperature", 0.0, help="sampling "
        "temperature, 0 = greedy")
    repeats: int = option(1, "run every cell N times, the cells of a batch size in interleaved "
        "rounds, and report each cell over all its runs: tokens/s as the output tokens over "
        "the time, both summed", ge=1, metavar="N")
    interleave: str = option("steps", "steps: a round's cells side by side, in turns of one "
        "engine step, each timed on its own clock (cell_run.py); cells: one after another, "
        "each alone on the machine (with --data-parallel-size above 1 always cells: replicas "
        "step on their own)", choices=INTERLEAVE)
    mixed: float | None = option(None, "the mixed workload (bench/workload.py): easy requests "
        "(repetitive code, greedy) in turn with hard ones (the prompts sampled at temperature "
        "T); --temperature is then unused", type=float, metavar="T")
    workload: str = option("heldout", "heldout: windows of the built-in pair's held-out stdlib "
        "files; grounded: each a held-out function followed by its first lines again, so "
        "outputs copy spans of the prompt (what n-gram drafting is for; give --input-len 256 "
        "or so); agentic: a coding agent's sessions, each turn re-quoting the file as last "
        "written and test output (bench/agentic_workload.py; give --input-len 1536 or so)",
        choices=WORKLOADS)
    # fmt: on
    seed: int = 0
    # the drafter as speculative_config (its num_speculative_tokens comes from the grid);
    # None: ``draft_model``, or the built-in target's own drafter (its EAGLE head)
    speculative_config: dict[str, Any] | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # more EngineArgs fields

    def check(self) -> None:
        def bad(name: str, why: str) -> InvalidInputError:
            return InvalidInputError(f"{name} {why}", name)

        check_options(BenchConfig, self)
        if self.mixed is not None:  # checked as the temperature it becomes
            try:
                SamplingParams(temperature=self.mixed)
            except InvalidInputError as e:
                raise InvalidInputError(f"mixed: {e}", "mixed") from None
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise bad("batch_sizes", "must be integers >= 1")
        if not self.draft_lengths and not self.trees:
            raise bad("draft_lengths", "and trees are both empty: give at least one cell")
        for k in self.draft_lengths:
            if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
                raise bad("draft_lengths", f"must be integers >= 0 (or auto), got {k!r}")
        for tree in self.trees:
            problem = tree_problem(tree) if isinstance(tree, DraftShape) else None
            if not isinstance(tree, DraftShape) or problem is not None:
                raise bad("trees", problem or f"must be DraftShapes, got {tree!r}")
        drafter = self.draft_model is not None or self.speculative_config is not None
        if self.lookahead > 0 and self.model is not None and not drafter:
            raise bad(
                "draft_lengths",
                "above 0, auto and trees need a drafter (--draft-model or --speculative-config)",
            )

    @property
    def drafts(self) -> list[Draft]:
        """The grid's cells at each batch size, in order: plain and chains, trees, auto."""
        cells: set[Draft] = {k if k == "auto" else DraftShape.chain(k) for k in self.draft_lengths}
        return sorted(cells | set(self.trees), key=order)

    @property
    def auto_shape(self) -> DraftShape:
        """The auto cell's largest drafts (``drafts.auto_shape``)."""
        return auto_shape(self.drafts, SpeculativeConfig.max_draft_length)

    @property
    def lookahead(self) -> int:
        """Slots past a request's last token that any cell's drafts may take."""
        shapes = [d for d in self.drafts if isinstance(d, DraftShape)]
        if "auto" in self.drafts:
            shapes.append(self.auto_shape)
        return max(s.lookahead for s in shapes)

    @property
    def max_output_len(self) -> int:
        return math.ceil(self.output_len * (1 + self.output_len_spread))

    def requests_for(self, batch_size: int) -> int:
        return self.num_requests or default_num_requests(batch_size)
