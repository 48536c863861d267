"""``speculative_config``, as vLLM spells it: which drafter proposes tokens, and how many.

    {"method": "draft_model", "model": DIR, "num_speculative_tokens": 3}
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "eagle", "model": HEAD_DIR, "num_speculative_tokens": 3}   (or "eagle3")

``num_speculative_tokens`` may be ``"auto"`` (chosen per request and step, up to
``max_draft_length``). ``method`` may be left out when ``model`` is given; ``model`` may be
left out for the built-in target, whose own draft model and EAGLE head ship with it. The
engine's older flags (``draft_model``, ``num_speculative_tokens``,
``draft_tensor_parallel_size``) are shorthands for the same fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from specbatch.errors import InvalidInputError

METHODS = ("draft_model", "ngram", "eagle", "eagle3")
KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "draft_tensor_parallel_size",
    "max_draft_length",
    "topk",
    "num_draft_tokens",
    "tree_children",
)
TREE_CHILDREN = ("sampled", "top")
DEFAULT_PROMPT_LOOKUP_MAX = 4
DEFAULT_PROMPT_LOOKUP_MIN = 2


@dataclass(frozen=True)
class SpeculativeArgs:
    method: str
    model: str | None = None
    num_speculative_tokens: int | str | None = None
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN
    draft_tensor_parallel_size: int | None = None
    max_draft_length: int | None = None
    topk: int = 1
    num_draft_tokens: int | None = None
    tree_children: str = "sampled"


def _int(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidInputError(
            f"speculative_config.{key} must be an integer >= {minimum}, got {value!r}"
        )
    return value


def parse_speculative_config(value: dict[str, Any] | str) -> SpeculativeArgs:
    """Check a ``speculative_config`` (a dict, or its JSON text from the command line)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidInputError(f"speculative_config: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise InvalidInputError(
            f"speculative_config must be a JSON object (a dict), got {type(value).__name__}"
        )
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise InvalidInputError(
            f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; known: "
            + ", ".join(KEYS)
        )
    model = value.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidInputError(f"speculative_config.model must be a path, got {model!r}")
    method = value.get("method", "draft_model" if model is not None else None)
    if method not in METHODS:
        raise InvalidInputError(
            f"speculative_config.method must be one of {', '.join(METHODS)}, got {method!r}"
        )
    if method == "ngram" and model is not None:
        raise InvalidInputError("speculative_config.model: the ngram method takes no model")
    k = value.get("num_speculative_tokens")
    if k is not None and k != "auto":
        _int("num_speculative_tokens", k, 0)
    lookup_max = _int(
        "prompt_lookup_max", value.get("prompt_lookup_max", DEFAULT_PROMPT_LOOKUP_MAX), 1
    )
    lookup_min = _int(
        "prompt_lookup_min",
        value.get("prompt_lookup_min", min(DEFAULT_PROMPT_LOOKUP_MIN, lookup_max)),
        1,
    )
    if lookup_min > lookup_max:
        raise InvalidInputError(
            f"speculative_config.prompt_lookup_min ({lookup_min}) must be at most "
            f"prompt_lookup_max ({lookup_max})"
        )
    draft_tp = value.get("draft_tensor_parallel_size")
    if draft_tp is not None:
        _int("draft_tensor_parallel_size", draft_tp, 1)
    max_draft = value.get("max_draft_length")
    if max_draft is not None:
        _int("max_draft_length", max_draft, 1)
    topk = _int("topk", value.get("topk", 1), 1)
    nodes = value.get("num_draft_tokens")
    if nodes is not None:
        _int("num_draft_tokens", nodes, 1)
        if nodes > 63:
            raise InvalidInputError(
                f"speculative_config.num_draft_tokens must be at most 63, got {nodes}"
            )
    children = value.get("tree_children", "sampled")
    if children not in TREE_CHILDREN:
        raise InvalidInputError(
            f"speculative_config.tree_children must be one of {', '.join(TREE_CHILDREN)}, "
            f"got {children!r}"
        )
    return SpeculativeArgs(
        method, model, k, lookup_max, lookup_min, draft_tp, max_draft, topk, nodes, children
    )
