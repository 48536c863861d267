"""The drafters an engine can speculate with, and the facts the engine's parts need of each:
the registry that configuration, engine, scheduler and worker consult. Plain data, no torch.

A drafter is one class under ``specbatch/worker/`` (a ``Drafter``) plus one line here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DrafterKind:
    method: str  # speculative_config's "method"
    draft_input: str  # what the scheduler sends its KV cache each step: tokens, features, none
    needs_model: bool  # speculative_config's "model" is its checkpoint
    implementation: str  # "module:Class" of its ``Drafter``
    reads_features: bool = False  # it reads the target's features (an EAGLE head)
    samples: bool = True  # it draws its drafts from a distribution q (a lookup chooses them)

    def load(self) -> Any:
        module, name = self.implementation.split(":")
        return getattr(importlib.import_module(module), name)


_EAGLE = "specbatch.worker.eagle_proposer:EagleProposer"
DRAFTERS: dict[str, DrafterKind] = {
    k.method: k
    for k in (
        DrafterKind("draft_model", "tokens", True,
                    "specbatch.worker.draft_model_proposer:DraftModelProposer"),
        DrafterKind("eagle", "features", True, _EAGLE, reads_features=True),
        DrafterKind("eagle3", "features", True, _EAGLE, reads_features=True),
        DrafterKind("ngram", "none", False, "specbatch.worker.ngram_proposer:NgramProposer",
                    samples=False),
        DrafterKind("self_sparse", "none", False,
                    "specbatch.worker.self_sparse_proposer:SelfSparseProposer"),
        DrafterKind("suffix", "none", False, "specbatch.worker.suffix_proposer:SuffixProposer",
                    samples=False),
    )
}  # fmt: skip
