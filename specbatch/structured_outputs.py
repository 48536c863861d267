"""What a structured output must match, shaped like vLLM's ``StructuredOutputsParams``."""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass, field, fields
from typing import Any

from specbatch.errors import InvalidInputError

KINDS = ("json", "regex", "choice", "grammar", "json_object")
FIELD = "structured_outputs"


def _error(message: str) -> InvalidInputError:
    """An error about the structured output (its message starts with the field's name)."""
    return InvalidInputError(message, FIELD)


@dataclass
class StructuredOutputsParams:
    """Exactly one of: ``json``, a JSON schema (a dict, or its JSON text); ``regex``;
    ``choice``, one of these strings; ``grammar``, in EBNF as llama.cpp writes it
    (``root ::= ...``) or in Lark (a ``start`` rule); ``json_object=True``, any JSON object.
    ``disable_any_whitespace`` keeps JSON on one line without optional whitespace."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    _key: str = field(init=False, repr=False, compare=False, default="")

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            what = ", ".join(given) if given else "none"
            raise _error(f"{FIELD}: give exactly one of {', '.join(KINDS)}; got {what}")
        kind = given[0]
        if not isinstance(self.disable_any_whitespace, bool):
            raise _error(f"{FIELD}.disable_any_whitespace must be a boolean")
        if kind == "json":
            text = self._schema_text()
        elif kind == "choice":
            text = self._choices_text()
        elif kind == "json_object":
            if self.json_object is not True:
                raise _error(f"{FIELD}.json_object must be true or absent")
            text = ""
        else:
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise _error(f"{FIELD}.{kind} must be a non-empty string")
            text = value
        self._key = jsonlib.dumps([kind, self.disable_any_whitespace, text])

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> str:
        """The same for every request whose grammar is the same: the compiled grammar's key."""
        return self._key

    @property
    def schema(self) -> Any:
        """``json`` as a JSON value (parsed, when it was given as text)."""
        value = self.json
        return jsonlib.loads(value) if isinstance(value, str) else value

    def _schema_text(self) -> str:
        value = self.json
        if isinstance(value, str):
            try:
                value = jsonlib.loads(value)
            except ValueError as e:
                raise _error(f"{FIELD}.json: not valid JSON: {e}") from None
        if not isinstance(value, (dict, bool)):
            raise _error(
                f"{FIELD}.json must be a JSON schema (an object), got {type(value).__name__}"
            )
        try:  # the properties' order is the output's key order: kept as given
            return jsonlib.dumps(value, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise _error(f"{FIELD}.json: not a JSON value: {e}") from None

    def _choices_text(self) -> str:
        items = self.choice
        if (
            not isinstance(items, (list, tuple))
            or not items
            or not all(isinstance(c, str) for c in items)
        ):
            raise _error(f"{FIELD}.choice must be a non-empty list of strings")
        self.choice = list(items)
        return jsonlib.dumps(self.choice)

    @classmethod
    def of(cls, value: Any) -> StructuredOutputsParams:
        """``value`` itself, or built from a dict of its fields or its JSON text (a flag's;
        unknown keys refused)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = jsonlib.loads(value)
            except ValueError as e:
                raise _error(f"{FIELD}: not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise _error(
                f"{FIELD} must be an object with one of {', '.join(KINDS)}, "
                f"got {type(value).__name__}"
            )
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(value) - known)
        if unknown:
            raise _error(
                f"{FIELD}: unknown field {unknown[0]!r}; known: {', '.join(sorted(known))}"
            )
        return cls(**value)
