"""The grammar library (xgrammar): a structured output's grammar parsed and checked, the
tokenizer's vocabulary as the matcher reads it, and a compiled grammar that travels to the
workers (in the engine's process as it is; to a Ray rank as xgrammar's JSON)."""

from __future__ import annotations

import json
import re
from typing import Any

from specbatch.errors import InvalidInputError
from specbatch.structured_outputs import FIELD, StructuredOutputsParams

INSTALL_HINT = "pip install 'specbatch[structured]'"
_LOCATION = re.compile(r"^\[[\d:.]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " prefix


def xgrammar() -> Any:
    """The xgrammar module, imported on first use (it costs about a second)."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise InvalidInputError(
            f"{FIELD}: structured outputs need the xgrammar package ({INSTALL_HINT})", FIELD
        ) from None
    return xgr


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int]) -> Any:
    """The vocabulary as xgrammar's matcher reads it; the grammar's end is one of
    ``stop_token_ids`` (the model's EOS)."""
    xgr = xgrammar()
    if tokenizer is None:
        raise InvalidInputError(f"{FIELD}: structured outputs need the model's tokenizer", FIELD)
    if not stop_token_ids:
        raise InvalidInputError(
            f"{FIELD}: the model has no EOS token, so a structured output could not end", FIELD
        )
    return xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
    )


def worker_tokenizer_info(config: Any) -> Any:
    """The engine's tokenizer info, rebuilt from its configuration (on a Ray rank)."""
    from specbatch.tokenizer import eos_token_ids, load_tokenizer

    target = config.target
    tokenizer = load_tokenizer(target.tokenizer_path) if target.tokenizer_path else None
    stops = eos_token_ids(target.hf_config, tokenizer, target.path)
    return tokenizer_info(tokenizer, target.vocab_size, stops)


def _message(e: Exception) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _LOCATION.sub("", first)


def parse(spec: StructuredOutputsParams, info: Any) -> Any:
    """``spec``'s grammar (an ``xgrammar.Grammar``); ``InvalidInputError`` naming the field
    when the schema, regex or grammar is invalid."""
    xgr = xgrammar()
    kind = spec.kind
    whitespace = not spec.disable_any_whitespace
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(json.dumps(spec.schema), any_whitespace=whitespace)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            assert spec.choice is not None
            alternatives = " | ".join(_literal(c) for c in spec.choice)
            return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
        assert spec.grammar is not None
        if "::=" in spec.grammar:  # EBNF (llama.cpp's GBNF); Lark otherwise, as vLLM tells them
            return xgr.Grammar.from_ebnf(spec.grammar)
        return xgr.Grammar.from_lark(spec.grammar, tokenizer_info=info)
    except (RuntimeError, ValueError, TypeError) as e:
        what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar"}.get(kind, kind)
        raise InvalidInputError(f"{FIELD}.{kind}: invalid {what}: {_message(e)}", FIELD) from None


def _literal(text: str) -> str:
    """``text`` as an EBNF string literal (JSON's escapes, which xgrammar reads)."""
    return json.dumps(text, ensure_ascii=False)


class CompiledGrammarRef:
    """A compiled grammar and the key of the structured output it came from. Pickled (for a
    Ray rank), it carries xgrammar's JSON of the grammar; the rank rebuilds it with its own
    tokenizer info (``resolve``)."""

    def __init__(self, key: str, compiled: Any) -> None:
        self.key = key
        self.compiled = compiled
        self._json: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        text = self._json if self.compiled is None else self.compiled.serialize_json()
        return {"key": self.key, "json": text}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.key, self._json, self.compiled = state["key"], state["json"], None

    def resolve(self, info: Any) -> Any:
        """The ``xgrammar.CompiledGrammar`` (rebuilt from its JSON after a pickle)."""
        if self.compiled is None:
            self.compiled = xgrammar().CompiledGrammar.deserialize_json(self._json, info)
        return self.compiled
