"""The checkpoints an engine runs, as its arguments name them, each read once: the target (the
built-in pair's when no model is named) and its drafter's (a draft model, which must share the
target's vocabulary, or an EAGLE head), checked for the tensor-parallel split they run in."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from specbatch.drafters import DRAFTERS, DrafterKind
from specbatch.errors import InvalidInputError
from specbatch.model.checkpoint import ModelConfig, check_tensor_parallel, read_checkpoint
from specbatch.model.eagle import read_eagle_head
from specbatch.speculative_config import SpeculativeConfig
from specbatch.tokenizer import load_tokenizer

BUILTIN_PAIR = Path(__file__).parents[1] / "assets" / "default_pair"


def default_model_path(which: str) -> str:
    """The built-in models shipped inside the package: 'target', 'draft' or 'eagle'."""
    path = BUILTIN_PAIR / which
    if not (path / "config.json").exists():
        raise InvalidInputError(
            "model: no model was given and the built-in model pair is not installed "
            f"(looked in {path}); pass --model DIR",
            "model",
        )
    return str(path)


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError(
            "device: 'cuda' was asked for but no CUDA device is available", "device"
        )
    return device


def read_target(
    model: str | None, tokenizer: str | None, dtype: str, device: str, kernels_required: bool
) -> ModelConfig:
    """The target's checkpoint: ``model``, or the built-in pair's target."""
    path = model or default_model_path("target")
    target = read_checkpoint(path, "model", tokenizer, dtype, device)
    return dataclasses.replace(target, kernels_required=kernels_required)


def read_drafter(
    spec: SpeculativeConfig, target: ModelConfig, builtin: bool, field: str
) -> tuple[DrafterKind, str | None, ModelConfig | None]:
    """The drafter ``spec`` asks for, its checkpoint's path and the checkpoint read (None: the
    drafter needs none, or none was given). With no model named the built-in target (``builtin``)
    drafts with its own EAGLE head, or its own draft model when that method is asked for; either
    EAGLE name picks the head. ``field`` is the argument that named the model."""
    method, path = spec.method, spec.model
    kind = DRAFTERS.get(method or "eagle")
    if path is None and kind.needs_model and spec.num_speculative_tokens != 0 and builtin:
        path = default_model_path("draft" if method == "draft_model" else "eagle")
        kind = kind if method == "draft_model" else DRAFTERS["eagle"]
    elif path is None and kind.needs_model and method is not None:
        raise InvalidInputError(
            f"{field}: the {method} method needs a model (only the built-in target has its own)",
            field,
        )
    if path is None:
        return kind, None, None
    if kind.reads_features:  # an EAGLE head, of the layout its method names, if named
        head = read_eagle_head(path, method if spec.model else None, target)
        return DRAFTERS["eagle"], path, head
    draft = read_checkpoint(path, field, None, target.dtype_name, target.device)
    check_same_vocabulary(target, draft)
    return kind, path, draft


def check_same_vocabulary(target: ModelConfig, draft: ModelConfig) -> None:
    """The draft must propose ids that mean the same tokens to the target."""
    if target.vocab_size != draft.vocab_size:
        raise InvalidInputError(
            f"draft_model: vocab_size {draft.vocab_size} differs from the target's "
            f"{target.vocab_size}; the draft must share the target's vocabulary",
            "draft_model",
        )
    if target.tokenizer_path and draft.tokenizer_path:
        a = load_tokenizer(target.tokenizer_path).get_vocab()
        b = load_tokenizer(draft.tokenizer_path).get_vocab()
        if a != b:
            differ = sorted(set(a.items()) ^ set(b.items()))[:3]
            raise InvalidInputError(
                "draft_model: its tokenizer maps tokens to ids differently from the target's "
                f"(e.g. {differ}); the draft must share the target's vocabulary",
                "draft_model",
            )


def check_split(target: ModelConfig, draft: ModelConfig | None, tp: int, draft_tp: int) -> None:
    """The target split in ``tp`` shards, the drafter in ``draft_tp`` (an EAGLE head: none)."""
    check_tensor_parallel(target.hf_config, tp, "model")
    if draft is not None and draft.layout is not None and draft_tp != 1:
        raise InvalidInputError(
            "draft_tensor_parallel_size: an EAGLE head runs replicated on every rank (1)",
            "draft_tensor_parallel_size",
        )
    if draft is not None and draft.layout is None:
        check_tensor_parallel(draft.hf_config, draft_tp, draft.field)
