"""The OpenAI API's request bodies as pydantic models, and its error shape.

The sampling fields are ``SamplingParams``' own options (names, types, defaults, limits stated
in the schema); their values are checked once, where they become ``SamplingParams``, and an
error names the field as the client wrote it. Types are strict (``"5"`` is not an integer).
Unknown fields are accepted (the server logs each name once); fields this server does not
implement are accepted only at their neutral values.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    create_model,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from specbatch.chat import ROLES
from specbatch.entrypoints.openai_structured import (
    ResponseFormat,
    StructuredField,
    structured_field,
)
from specbatch.entrypoints.openai_tools import ToolDef, ToolPlan
from specbatch.errors import InvalidInputError
from specbatch.options import Option, options_of
from specbatch.sampling_params import SamplingParams
from specbatch.structured_outputs import FIELD

DEFAULT_MODEL_NAME = "specbatch-default"
_SURROGATE = re.compile("[\ud800-\udfff]")


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, kind: str, param: str | None = None, code: Any = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code = param, code


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


def error_body(e: ApiError) -> dict[str, Any]:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}


def _short(value: Any) -> str:
    try:
        return json.dumps(value)[:80]
    except (TypeError, ValueError, RecursionError):
        return type(value).__name__


def validation_error(errors: Sequence[Any]) -> ApiError:
    """A 400 from pydantic's first error, ``param`` the top-level field as the client wrote it."""
    err = errors[0]
    loc = list(err["loc"])
    if loc[:1] == ["body"]:
        loc = loc[1:]
    if err["type"] == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {err['ctx']['error']}")
    if not loc:
        return bad_request(
            "the request body must be a JSON object (content-type: application/json)"
        )
    path = str(loc[0]) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
    got = "" if err["type"] == "missing" else f", got {_short(err['input'])}"
    return bad_request(f"{path}: {err['msg']}{got}", str(loc[0]))


# ---- field types ------------------------------------------------------------------------------


def _unicode(value: str) -> str:
    """Refuse a lone surrogate (JSON's ``"\\ud800"``): no tokenizer can encode it."""
    if not value.isascii() and (m := _SURROGATE.search(value)):
        raise PydanticCustomError(
            "unicode",
            "must be valid Unicode text: lone surrogate U+{code} at character {at}",
            {"code": f"{ord(m.group()):04X}", "at": m.start()},
        )
    return value


Text = Annotated[str, AfterValidator(_unicode)]


def _one_of(expected: str) -> WrapValidator:
    """One error for a union (``must be EXPECTED``) instead of one per member; a text error
    inside a member is kept."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError as e:
            for err in e.errors():
                if err["type"] == "unicode":
                    raise PydanticCustomError("unicode", err["msg"]) from None
            raise PydanticCustomError(
                "type", "must be {expected}", {"expected": expected}
            ) from None

    return WrapValidator(validate)


def _wire(opt: Option) -> Any:
    """A sampling option's type as the request takes it: text checked, a string or a list of
    strings with one clear message."""
    one = Text if opt.type is str else opt.type
    if opt.many and opt.type is str:
        return Annotated[one | list[one], _one_of(opt.expected())]
    return list[one] if opt.many else one


_LIMITS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "lt": "exclusiveMaximum"}
_OPTIONS: dict[str, tuple[Option, Any]] = {n: (o, d) for n, o, d in options_of(SamplingParams)}


def _schema(name: str, default: Any = None) -> FieldInfo:
    """Sampling option ``name``'s help and limits, as the request schema states them."""
    opt = _OPTIONS[name][0]
    limits = {key: getattr(opt, bound) for bound, key in _LIMITS.items()}
    extra = {k: v for k, v in limits.items() if v is not None}
    return Field(default, description=opt.help, json_schema_extra=extra or None)  # type: ignore[arg-type]


def _sampling_fields() -> dict[str, Any]:
    return {n: (_wire(o) | None, _schema(n, d)) for n, (o, d) in _OPTIONS.items()}


_SAMPLING = _sampling_fields()
SAMPLING_FIELDS = tuple(_SAMPLING)


def _neutral(accepted: str, is_neutral: Callable[[Any], bool]) -> Any:
    """A field this server does not implement: only null or its neutral value passes."""

    def check(value: Any) -> Any:
        if value is not None and not is_neutral(value):
            raise PydanticCustomError(
                "unsupported",
                "not supported by this server; only {accepted} is accepted",
                {"accepted": accepted},
            )
        return value

    return Annotated[Any, AfterValidator(check)]


def _is_number(value: Any, target: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == target


LogitBias = _neutral("{} (off)", lambda v: v == {})
BestOf = _neutral("1", lambda v: _is_number(v, 1))
Suffix = _neutral('""', lambda v: v == "")
NoFunctions = _neutral("null (give tools instead)", lambda v: False)
FunctionCall = _neutral('"none" (give tool_choice instead)', lambda v: v == "none")


# ---- requests ---------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    include_usage: bool = False


class _Request(BaseModel):
    """What both endpoints take besides the sampling fields."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: LogitBias = None
    response_format: ResponseFormat | None = None

    def sampling_values(self) -> dict[str, Any]:
        """The sampling fields the client gave (null means the default)."""
        return {k: v for k in SAMPLING_FIELDS if (v := getattr(self, k)) is not None}


_Sampling = create_model("_Sampling", __base__=_Request, **_SAMPLING)

Prompt = Annotated[
    Text | list[int] | list[Text] | list[list[int]],
    _one_of("a string, a list of token ids, or a list holding one of those"),
]


class CompletionRequest(_Sampling):  # type: ignore[misc, valid-type]
    """``POST /v1/completions``: OpenAI's fields, vLLM's sampling extras."""

    prompt: Prompt
    echo: bool = False
    best_of: BestOf = None
    suffix: Suffix = None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]
    text: Text


class CalledFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str
    arguments: Text  # JSON text


class MessageToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(BaseModel):
    """A message; an assistant's content may be null when it has ``tool_calls``."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: (
        Annotated[
            Text | list[TextPart],
            _one_of('a string or a list of text parts ({"type": "text", "text": ...})'),
        ]
        | None
    ) = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_message(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise PydanticCustomError("missing", "a tool message needs its tool_call_id")
        return self


class ChatRequest(_Sampling):  # type: ignore[misc, valid-type]
    """``POST /v1/chat/completions``: ``logprobs`` is a flag and ``top_logprobs`` the number of
    alternatives; ``max_tokens`` or ``max_completion_tokens`` (default: up to the context)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = _schema("max_tokens")
    max_completion_tokens: int | None = _schema("max_tokens")
    logprobs: bool | None = False
    top_logprobs: int | None = _schema("logprobs")
    tools: list[ToolDef] | None = None
    tool_choice: Any = Field(
        None,
        description='"none", "auto", "required" or {"type": "function", "function": '
        '{"name": ...}} (default: "auto" with tools, else "none")',
    )
    parallel_tool_calls: bool | None = None
    functions: NoFunctions = None
    function_call: FunctionCall = None

    def tool_plan(self, parser: str) -> ToolPlan | None:
        """The request's tools (``parser``: the format of the model's own calls)."""
        try:
            return ToolPlan.of(self.tools, self.tool_choice, self.parallel_tool_calls, parser)
        except InvalidInputError as e:
            raise bad_request(str(e), e.field) from None


def requested_max_tokens(body: BaseModel, names: tuple[str, ...]) -> tuple[str, int] | None:
    """The JSON key and value of the client's own output limit (the last of ``names`` given)."""
    given = [(k, getattr(body, k)) for k in names if k in body.model_fields_set]
    given = [(k, v) for k, v in given if v is not None]
    return given[-1] if given else None


def check_context_room(
    prompt_tokens: int, requested: tuple[str, int] | None, max_model_len: int
) -> None:
    """A client's explicit output limit must fit in the context after its prompt (a 400, as
    OpenAI and vLLM answer); without one, generation stops at the context's end."""
    if requested is None:
        return
    name, value = requested
    room = max_model_len - prompt_tokens
    if value > room:
        raise bad_request(
            f"{name}: {value} is too large: this model's maximum context length is "
            f"{max_model_len} tokens and the prompt has {prompt_tokens}, so {name} can be at "
            f"most {room}",
            name,
        )


def sampling_params(
    values: dict[str, Any],
    wire: dict[str, str] | None = None,
    body: _Request | None = None,
    forced: StructuredField | None = None,
) -> tuple[SamplingParams, StructuredField | None]:
    """``SamplingParams`` of the request's values, with the body's structured output (its
    ``response_format`` or ``structured_outputs``) or else ``forced`` (a forced tool call's);
    an error names the field as the client wrote it (``wire``: the JSON key of a field that
    came under another name)."""
    structured = None
    if body is not None:
        try:
            structured = structured_field(body.response_format, values.get(FIELD))
        except InvalidInputError as e:
            raise bad_request(str(e), e.field) from None
    if forced is not None and structured is not None:
        raise bad_request(
            f"tool_choice: a forced tool call (required or a named function) cannot be "
            f"combined with {structured.param}",
            "tool_choice",
        )
    structured = structured or forced
    if structured is not None:
        values = {**values, FIELD: structured.params}
    try:
        return SamplingParams(**values), structured
    except InvalidInputError as e:
        key = (wire or {}).get(e.field or "", e.field)
        raise bad_request(e.named(key) if key else str(e), key) from None


def one_prompt(prompt: Any) -> str | list[int]:
    """The request's prompt: a string or token ids, alone or as a list of one."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request(
                f"prompt: one prompt per request is supported, got {len(prompt)}", "prompt"
            )
        return prompt[0]
    return prompt


def check_stop_token_ids(params: SamplingParams, vocab_size: int) -> None:
    for t in params.stop_token_ids or []:
        if t >= vocab_size:
            raise bad_request(
                f"stop_token_ids: token id {t} is outside the vocabulary [0, {vocab_size})",
                "stop_token_ids",
            )
