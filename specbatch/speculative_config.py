"""``speculative_config``, as vLLM spells it: which drafter proposes tokens, and how many.

    {"method": "draft_model", "model": DIR, "num_speculative_tokens": 3}
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "eagle", "model": HEAD_DIR, "num_speculative_tokens": 3}   (or "eagle3")
    {"method": "eagle", "num_speculative_tokens": 4, "topk": 2, "num_draft_tokens": 8}   (trees)
    {"method": "self_sparse", "num_speculative_tokens": 3, "window": 256, "sinks": 16}
    {"method": "suffix", "max_draft_length": 16, "suffix_decoding_max_tree_depth": 24}

``method`` may be left out when ``model`` is given, ``model`` for the built-in target (its own
draft model and EAGLE head ship with it). The engine's ``SHORTHANDS`` set the same fields:
``normalise`` turns either into one frozen ``SpeculativeConfig``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specbatch.draft_shape import DraftShape
from specbatch.drafters import DRAFTERS
from specbatch.errors import invalid
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
    sinks: int = option(16, "self_sparse: the first keys every draft pass sees (attention "
        "sinks; whole KV blocks)", ge=0, flag=False)
    window: int = option(256, "self_sparse: the last keys every draft pass sees (widened to "
        "whole KV blocks)", ge=1, flag=False)
    suffix_decoding_max_tree_depth: int = option(24, "suffix: the longest substring its trees "
        "hold (a match and its draft together)", ge=1, le=256, flag=False)
    suffix_decoding_max_spec_factor: float = option(1.0, "suffix: draft tokens per token "
        "matched, at most", ge=0, flag=False)
    suffix_decoding_min_token_prob: float = option(0.1, "suffix: the least empirical "
        "probability of a draft token's path", ge=0, le=1, flag=False)
    suffix_decoding_max_cached_requests: int = option(10000, "suffix: earlier requests whose "
        "outputs its global tree keeps (0: none)", ge=0, flag=False)
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
_SAME_NAMED = ("num_speculative_tokens", "draft_tensor_parallel_size", "max_draft_length")
SHORTHANDS = {"draft_model": "model"} | {name: name for name in _SAME_NAMED}
_DEFAULTS = {name: default for name, _, default in options_of(SpeculativeConfig)}
_METHOD = declared(SpeculativeConfig, "method")
# the keys one method alone reads
_READERS = {"sinks": "self_sparse", "window": "self_sparse"} | {
    k: "suffix" for k in _DEFAULTS if k.startswith("suffix_")}  # fmt: skip


def shorthand(name: str, help: str | None = None) -> Any:
    """``EngineArgs``' field for shorthand ``name``: the same option, declared once here."""
    return same_as(SpeculativeConfig, SHORTHANDS[name], help=help)


def normalise(value: Mapping[str, Any] | str | None, **shorthands: Any) -> SpeculativeConfig:
    """One ``SpeculativeConfig`` from ``speculative_config`` (a dict, or its JSON text), its
    errors naming ``speculative_config.KEY``, or else from the shorthands (already checked as
    ``EngineArgs``' fields, and unable to break the checks between keys)."""
    given = {k: v for k, v in shorthands.items() if v != _DEFAULTS[SHORTHANDS[k]]}
    if value is None:
        keys = {SHORTHANDS[k]: v for k, v in given.items()}
        return SpeculativeConfig(**keys, method="draft_model" if "model" in keys else None)
    if given:
        raise invalid("speculative_config", f" and {', '.join(given)} were both given: use one "
                      "(the flags are shorthands for speculative_config's fields)")  # fmt: skip
    keys = _as_dict(value)
    check_options(SpeculativeConfig, keys, "speculative_config.")
    if "model" in keys:  # a model implies its method; else the method must be named
        keys.setdefault("method", "draft_model")
    check_value("speculative_config.method", keys.get("method"), _METHOD)
    method = keys["method"]
    if not DRAFTERS[method].needs_model and keys.get("model") is not None:
        raise invalid("speculative_config.model", f": the {method} method takes no model")
    for key, reader in _READERS.items():
        if keys.get(key, _DEFAULTS[key]) != _DEFAULTS[key] and method != reader:
            raise invalid(f"speculative_config.{key}", f": only {reader} reads it, not {method}")
    most = keys.get("prompt_lookup_max", _DEFAULTS["prompt_lookup_max"])
    least = keys.setdefault("prompt_lookup_min", min(_DEFAULTS["prompt_lookup_min"], most))
    if least > most:
        raise invalid("speculative_config.prompt_lookup_min",
                      f" ({least}) must be at most prompt_lookup_max ({most})")  # fmt: skip
    return SpeculativeConfig(**keys)


def _as_dict(value: Mapping[str, Any] | str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise invalid("speculative_config", f": not valid JSON ({e})") from None
    if not isinstance(value, Mapping):
        kind = type(value).__name__
        raise invalid("speculative_config", f" must be a JSON object (a dict), got {kind}")
    if unknown := ", ".join(map(repr, sorted(set(value) - set(_DEFAULTS)))):
        known = ", ".join(_DEFAULTS)
        raise invalid("speculative_config", f": unknown key(s) {unknown}; known: {known}")
    return dict(value)
