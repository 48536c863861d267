"""``speculative_config``, as vLLM spells it: which drafter proposes tokens, and how many.

    {"method": "draft_model", "model": DIR, "num_speculative_tokens": 3}
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "eagle", "model": HEAD_DIR, "num_speculative_tokens": 3}   (or "eagle3")
    {"method": "eagle", "num_speculative_tokens": 4, "topk": 2, "num_draft_tokens": 8}   (trees)

``num_speculative_tokens`` may be ``"auto"`` (chosen per request and step, up to
``max_draft_length``). ``method`` may be left out when ``model`` is given; ``model`` may be
left out for the built-in target, whose own draft model and EAGLE head ship with it. The
engine's arguments ``draft_model``, ``num_speculative_tokens``, ``draft_tensor_parallel_size``
and ``max_draft_length`` are shorthands for the same fields: ``normalise`` turns either into one
frozen ``SpeculativeConfig``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specbatch.draft_shape import DraftShape
from specbatch.drafters import DRAFTERS
from specbatch.errors import InvalidInputError
from specbatch.options import check_options, check_value, declared, option, options_of, same_as

DEFAULT_NUM_SPECULATIVE_TOKENS = 3  # with batch_invariant, when no draft length is given
MAX_TREE_NODES = 63
TREE_CHILDREN = ("sampled", "top")  # drawn from q, or the top topk


@dataclass(frozen=True)
class SpeculativeConfig:
    # fmt: off
    method: str | None = option(None, "the drafter (default: draft_model with a model)",
        type=str, choices=tuple(DRAFTERS))
    model: str | None = option(None, "the drafter's checkpoint: a draft model (directory or GGUF "
        "file) or an EAGLE head", type=Path, metavar="DIR")
    num_speculative_tokens: int | str | None = option(None, "draft tokens proposed per round, or "
        "auto: chosen per request and step for throughput, up to --max-draft-length; 0 turns "
        f"speculation off (default: auto with a drafter, {DEFAULT_NUM_SPECULATIVE_TOKENS} with "
        "--batch-invariant, else 0)", type=int, ge=0, also=("auto",), metavar="K|auto")
    max_draft_length: int = option(4, "the largest draft length auto may choose", ge=1,
        shown="an integer >= 1")
    prompt_lookup_max: int = option(4, "ngram: the longest suffix looked up", ge=1,
        shown="an integer >= 1", flag=False)
    prompt_lookup_min: int = option(2, "ngram: the shortest suffix looked up", ge=1, flag=False)
    draft_tensor_parallel_size: int = option(1, "draft shards: 1 (replicated) or the target's "
        "tensor-parallel size", ge=1)
    topk: int = option(1, "a tree's children per expanded node (1: chains)", ge=1, flag=False)
    num_draft_tokens: int | None = option(None, "a tree's nodes (default: the most up to "
        f"{MAX_TREE_NODES})", type=int, ge=1, le=MAX_TREE_NODES, flag=False)
    tree_children: str = option(TREE_CHILDREN[0], "a tree's children: sampled (drawn from q "
        "without replacement, verified by recursive rejection sampling) or top (the topk most "
        "likely, verified by the walk)", choices=TREE_CHILDREN, flag=False)
    # fmt: on

    @property
    def auto(self) -> bool:
        return self.num_speculative_tokens == "auto"

    @property
    def depth(self) -> int:
        """The draft length: ``auto``'s maximum, or the fixed one (0: none)."""
        k = self.max_draft_length if self.auto else self.num_speculative_tokens
        return k if self.method is not None and isinstance(k, int) else 0

    @property
    def speculative(self) -> bool:
        return self.depth > 0

    @property
    def shape(self) -> DraftShape:
        """What each decoding request drafts, unless ``auto`` chooses."""
        k = self.depth
        if self.topk == 1 or k == 0:
            return DraftShape.chain(k)
        return DraftShape(k, self.topk, self.num_draft_tokens or min(MAX_TREE_NODES, self.topk * k))


# The engine's shorthand arguments, and the fields they stand for.
SHORTHANDS = {
    "draft_model": "model",
    "num_speculative_tokens": "num_speculative_tokens",
    "draft_tensor_parallel_size": "draft_tensor_parallel_size",
    "max_draft_length": "max_draft_length",
}
_SHORTHAND_OF = {field: name for name, field in SHORTHANDS.items()}
_DEFAULTS = {name: default for name, _, default in options_of(SpeculativeConfig)}
_METHOD = declared(SpeculativeConfig, "method")


def shorthand(name: str, help: str | None = None) -> Any:
    """``EngineArgs``' field for shorthand ``name``: the same option, declared once here."""
    return same_as(SpeculativeConfig, SHORTHANDS[name], help=help)


def normalise(value: Mapping[str, Any] | str | None, **shorthands: Any) -> SpeculativeConfig:
    """One ``SpeculativeConfig`` from ``speculative_config`` (a dict, or its JSON text) or from
    the shorthands (already checked as ``EngineArgs``' fields); errors name the field as given:
    ``speculative_config.topk`` or ``num_speculative_tokens``."""
    given = {k: v for k, v in shorthands.items() if v != _DEFAULTS[SHORTHANDS[k]]}
    if value is None:
        keys = {SHORTHANDS[k]: v for k, v in given.items()}
        keys.setdefault("method", "draft_model" if "model" in keys else None)
        return _related(keys, lambda key: _SHORTHAND_OF.get(key, key))
    if given:
        raise InvalidInputError(
            f"speculative_config and {', '.join(given)} were both given: use one (the flags are "
            "shorthands for speculative_config's fields)",
            "speculative_config",
        )
    keys = _as_dict(value)
    check_options(SpeculativeConfig, keys, "speculative_config.")
    if "model" in keys:  # a model implies its method; else the method must be named
        keys.setdefault("method", "draft_model")
    check_value("speculative_config.method", keys.get("method"), _METHOD)
    return _related(keys, lambda key: f"speculative_config.{key}")


def _as_dict(value: Mapping[str, Any] | str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidInputError(
                f"speculative_config: not valid JSON ({e})", "speculative_config"
            ) from None
    if not isinstance(value, Mapping):
        raise InvalidInputError(
            f"speculative_config must be a JSON object (a dict), got {type(value).__name__}",
            "speculative_config",
        )
    unknown = sorted(set(value) - set(_DEFAULTS))
    if unknown:
        raise InvalidInputError(
            f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; known: "
            + ", ".join(_DEFAULTS),
            "speculative_config",
        )
    return dict(value)


def _related(keys: dict[str, Any], name: Any) -> SpeculativeConfig:
    """The checks between fields; ``name(key)`` is how the user spelled a field."""
    if keys.get("method") == "ngram" and keys.get("model") is not None:
        raise InvalidInputError(f"{name('model')}: the ngram method takes no model", name("model"))
    lookup_max = keys.get("prompt_lookup_max", _DEFAULTS["prompt_lookup_max"])
    keys.setdefault("prompt_lookup_min", min(_DEFAULTS["prompt_lookup_min"], lookup_max))
    if keys["prompt_lookup_min"] > lookup_max:
        raise InvalidInputError(
            f"{name('prompt_lookup_min')} ({keys['prompt_lookup_min']}) must be at most "
            f"prompt_lookup_max ({lookup_max})",
            name("prompt_lookup_min"),
        )
    return SpeculativeConfig(**keys)
