"""Tokenizer loading (through transformers)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from specbatch.errors import InvalidInputError


@lru_cache(maxsize=8)
def load_tokenizer(path: str) -> Any:
    from specbatch.model.gguf_checkpoint import is_gguf_tokenizer, load_gguf_tokenizer

    if is_gguf_tokenizer(path):  # a GGUF file: the tokenizer its metadata describe
        return load_gguf_tokenizer(path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises many kinds; the user needs the path and cause
        raise InvalidInputError(
            f"tokenizer: cannot load a tokenizer from '{path}': {e}", "tokenizer"
        ) from None


def max_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token can stand for: the longest token string of the
    vocabulary, added tokens included (a byte-level token's string has one character per byte,
    a SentencePiece one a character per character, so neither undercounts). Assumes, as every
    LLM tokenizer does, that normalisation never deletes characters."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """``text``'s token ids, without transformers' warning about the model's maximum length
    (the engine checks lengths itself, against max_model_len, with a clearer message)."""
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens, verbose=False))


def eos_token_ids(hf_config: Any, tokenizer: Any | None, model_path: str) -> frozenset[int]:
    """EOS ids from generation_config.json, the model config and the tokenizer, together."""
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int) and not isinstance(value, bool):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                add(v)

    try:
        from transformers import GenerationConfig

        add(GenerationConfig.from_pretrained(model_path).eos_token_id)
    except Exception:  # no generation_config.json: fine
        pass
    add(getattr(hf_config, "eos_token_id", None))
    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    return frozenset(ids)
