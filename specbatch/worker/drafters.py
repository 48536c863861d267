"""The drafter an engine's configuration asks for, built from the registry."""

from __future__ import annotations

import torch

from specbatch.config import EngineConfig
from specbatch.distributed.parallel_state import TensorParallelGroup
from specbatch.drafters import DRAFTERS
from specbatch.worker.model_runner import ModelRunner
from specbatch.worker.proposer import Drafter


def make_drafter(
    config: EngineConfig, device: torch.device, draft_tp: TensorParallelGroup, target: ModelRunner
) -> Drafter | None:
    """None when the engine does not speculate."""
    if not config.speculative_config.speculative:
        return None
    cls = DRAFTERS[config.speculative_config.method].load()
    return cls(config, device, draft_tp, target)
