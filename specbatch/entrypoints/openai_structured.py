"""OpenAI's ``response_format`` and vLLM's ``structured_outputs`` request fields, read as the
engine's ``StructuredOutputsParams``; an error names the field as the client wrote it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specbatch.errors import InvalidInputError
from specbatch.structured_outputs import FIELD, StructuredOutputsParams


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)
    name: str
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}, "strict": true}}``."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


@dataclass
class StructuredField:
    params: StructuredOutputsParams
    param: str  # the request's field
    spelt: str  # how the client spelt the grammar's part of it

    def message(self, error: str) -> str:
        """An engine error about the grammar, with the field as the client wrote it."""
        own = f"{FIELD}.{self.params.kind}"
        return self.spelt + error[len(own) :] if error.startswith(own) else error


def structured_field(
    response_format: ResponseFormat | None, structured_outputs: dict[str, Any] | None
) -> StructuredField | None:
    """The request's structured output, from either field; raises ``InvalidInputError``
    (its message starting with the field's name) when it is malformed or both are given."""
    fmt = response_format
    if fmt is not None and fmt.type == "text":
        fmt = None
    if fmt is not None and structured_outputs is not None:
        raise InvalidInputError(
            "response_format: give response_format or structured_outputs, not both",
            "response_format",
        )
    if structured_outputs is not None:
        spec = StructuredOutputsParams.of(structured_outputs)
        return StructuredField(spec, FIELD, f"{FIELD}.{spec.kind}")
    if fmt is None:
        return None
    if fmt.type == "json_object":
        return StructuredField(StructuredOutputsParams(json_object=True), "response_format",
                               "response_format")  # fmt: skip
    if fmt.json_schema is None:
        raise InvalidInputError(
            'response_format.json_schema: required when type is "json_schema"', "response_format"
        )
    if fmt.json_schema.json_schema is None:
        raise InvalidInputError(
            "response_format.json_schema.schema: required (a JSON schema)", "response_format"
        )
    spelt = "response_format.json_schema.schema"
    try:
        spec = StructuredOutputsParams(json=fmt.json_schema.json_schema)
    except InvalidInputError as e:
        message = spelt + str(e)[len(f"{FIELD}.json") :]
        raise InvalidInputError(message, "response_format") from None
    return StructuredField(spec, "response_format", spelt)
