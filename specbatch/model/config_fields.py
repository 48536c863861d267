"""The fields of a checkpoint's ``config.json`` that the model reads, checked as written.

transformers fills a missing field with its class default (``LlamaConfig`` has
``hidden_size=4096``), so a config that lacks one would load as another model and fail later
with a misleading weight-shape error. These checks read the raw JSON instead, and name the
field and what it must be.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specbatch.errors import InvalidInputError

# Required: the model cannot be built without them.
REQUIRED_INTS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
)
# Optional (absent or null: a default or a value derived from the others).
OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window")
OPTIONAL_POSITIVE_NUMBERS = (
    "rms_norm_eps",
    "rope_theta",
    "query_pre_attn_scalar",  # Gemma's
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "rope_local_base_freq",
)
OPTIONAL_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias")


def read_config_json(path: Path) -> dict[str, Any]:
    """``config.json`` as a dict, or an ``InvalidInputError`` naming the file and the problem."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise InvalidInputError(f"'{path}' is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise InvalidInputError(
            f"'{path}' is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})"
        ) from None
    except OSError as e:
        raise InvalidInputError(f"cannot read '{path}': {e.strerror or e}") from None
    if not isinstance(raw, dict):
        raise InvalidInputError(f"'{path}' must hold a JSON object")
    return raw


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _shown(v: Any) -> str:
    return json.dumps(v)[:60]


def check_config_fields(raw: dict[str, Any], path: Path) -> None:
    """Every field the model reads is present when required and of the right type and range."""
    name = f"'{path}':"
    for field in REQUIRED_INTS:
        if raw.get(field) is None:
            raise InvalidInputError(f"'{path}' has no '{field}' (required: an integer >= 1)")
    for field in (*REQUIRED_INTS, *OPTIONAL_INTS):
        v = raw.get(field)
        least = 0 if field == "sliding_window" else 1  # Qwen2-MoE writes 0 for no window
        if v is not None and not (_is_int(v) and v >= least):
            raise InvalidInputError(
                f"{name} '{field}' must be an integer >= {least}, got {_shown(v)}"
            )
    for field in OPTIONAL_POSITIVE_NUMBERS:
        v = raw.get(field)
        if v is not None and not (
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
        ):
            raise InvalidInputError(f"{name} '{field}' must be a positive number, got {_shown(v)}")
    for field in OPTIONAL_BOOLS:
        v = raw.get(field)
        if v is not None and not isinstance(v, bool):
            raise InvalidInputError(f"{name} '{field}' must be true or false, got {_shown(v)}")
    heads, kv_heads = raw["num_attention_heads"], raw.get("num_key_value_heads") or None
    if kv_heads is not None and heads % kv_heads:
        raise InvalidInputError(
            f"{name} num_attention_heads={heads} is not a multiple of "
            f"num_key_value_heads={kv_heads}"
        )
    if raw.get("head_dim") is None and raw["hidden_size"] % heads:
        raise InvalidInputError(
            f"{name} hidden_size={raw['hidden_size']} is not a multiple of "
            f"num_attention_heads={heads} (and no head_dim is given)"
        )
