"""Shared pytest fixtures.

Model checkpoints: ``make_checkpoint(arch="llama", **kwargs)`` writes a tiny random Hugging Face
checkpoint (see ``specbatch.testing.checkpoints.make_random_checkpoint`` for the arguments) once
per session and argument set, and returns its directory. Treat the directory as read-only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from specbatch.testing.checkpoints import make_random_checkpoint

# The tests run tiny models: one intra-op thread is as fast as two on them, and it keeps the
# suite from oversubscribing the cores when Ray workers or parallel jobs share the machine.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    cache: dict[str, Path] = {}

    def make(arch: str = "llama", **kwargs: Any) -> Path:
        key = f"{arch}:{sorted(kwargs.items())!r}"
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ckpt_{arch}")
            cache[key] = make_random_checkpoint(out, arch, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    """The default tiny Llama (vocab 256, 2 layers, GQA 4/2 heads) with a small tokenizer."""
    return make_checkpoint("llama", with_tokenizer=True)
