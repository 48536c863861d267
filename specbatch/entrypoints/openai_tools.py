"""OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` on the chat endpoint: the
tools checked, the grammar that forces a call (``required`` or a named function), and the
conversation as the chat template takes it.

A forced call is written as ``FORCED`` reads it: ``{"name": ..., "arguments": {...}}`` for a
named function, a JSON array of those for ``required`` (one at most unless parallel calls are
allowed), on one line, the arguments matching the tool's ``parameters`` schema. ``auto`` lets
the model write calls in its own format (the server's ``--tool-call-parser``); ``none`` leaves
the tools out of the prompt. A template without a tools section gets the tools described in
the system message, in the format the reply will be read in, and earlier calls written into
the assistant's text in the parser's format.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from specbatch.chat import Message
from specbatch.entrypoints.tool_parsers import FORCED, PARSERS, Parsed, ToolFormat, ToolParser
from specbatch.errors import InvalidInputError
from specbatch.structured_outputs import StructuredOutputsParams

CHOICES = ("none", "auto", "required")
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["function"]
    function: FunctionDef


def _error(message: str, field: str) -> InvalidInputError:
    return InvalidInputError(message, field)


def _tool(i: int, tool: ToolDef, seen: dict[str, int]) -> dict[str, Any]:
    """The tool as chat templates take it, checked."""
    f, where = tool.function, f"tools[{i}].function"
    if not _NAME.fullmatch(f.name):
        raise _error(
            f"{where}.name must be 1 to 64 letters, digits, underscores, dots or dashes, "
            f"got {f.name[:80]!r}",
            "tools",
        )
    if f.name in seen:
        raise _error(f"{where}.name: {f.name!r} is the name of tools[{seen[f.name]}] too", "tools")
    seen[f.name] = i
    params = f.parameters if f.parameters is not None else {"type": "object", "properties": {}}
    if params.get("type", "object") != "object":
        raise _error(
            f"{where}.parameters must be a JSON schema of type object, got type "
            f"{json.dumps(params['type'])[:80]}",
            "tools",
        )
    try:
        json.dumps(params, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise _error(f"{where}.parameters: not a JSON value: {e}", "tools") from None
    out: dict[str, Any] = {"name": f.name}
    if f.description is not None:
        out["description"] = f.description
    out["parameters"] = params
    return {"type": "function", "function": out}


def _choice(value: Any, names: list[str]) -> tuple[str, str | None]:
    """``tool_choice`` as ("none" | "auto" | "required" | "named", the named function)."""
    if value is None:
        return ("auto" if names else "none"), None
    if isinstance(value, str) and value in CHOICES:
        if value != "none" and not names:
            raise _error(f"tool_choice: {value!r} needs tools", "tool_choice")
        return value, None
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not (isinstance(value, dict) and value.get("type") == "function" and isinstance(name, str)):
        raise _error(
            'tool_choice must be "none", "auto", "required" or {"type": "function", '
            '"function": {"name": ...}}, got ' + json.dumps(value)[:80],
            "tool_choice",
        )
    if name not in names:
        among = ", ".join(names) if names else "no tools were given"
        raise _error(
            f"tool_choice.function.name: {name[:80]!r} is not among the tools ({among})",
            "tool_choice",
        )
    return "named", name


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]]  # {"type": "function", "function": {name, description, ...}}
    choice: str  # "none", "auto", "required" or "named"
    name: str | None  # the named function
    parallel: bool
    parser: ToolFormat  # the format of the model's own calls (auto)

    @classmethod
    def of(
        cls, tools: list[ToolDef] | None, tool_choice: Any, parallel: bool | None, parser: str
    ) -> ToolPlan | None:
        """The request's tools; None without tools (or with ``none`` and none given)."""
        seen: dict[str, int] = {}
        checked = [_tool(i, t, seen) for i, t in enumerate(tools or [])]
        choice, name = _choice(tool_choice, list(seen))
        if not checked:
            return None
        return cls(checked, choice, name, parallel is not False, PARSERS[parser])

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    @property
    def reader(self) -> ToolParser | None:
        """How the output is read: None when no call is expected."""
        if self.choice == "none":
            return None
        return FORCED if self.forced else self.parser

    def read(self, text: str, final: bool = True) -> Parsed:
        """The output's content and calls (the first call only, without parallel calls)."""
        assert self.reader is not None
        parsed = self.reader.parse(text, final)
        if self.parallel or len(parsed.calls) < 2:
            return parsed
        return Parsed(parsed.content, parsed.calls[:1])

    def _schema_of_call(self, tool: dict[str, Any]) -> dict[str, Any]:
        f = tool["function"]
        return {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }

    def schema(self) -> dict[str, Any]:
        """The forced output's JSON schema."""
        if self.choice == "named":
            tool = next(t for t in self.tools if t["function"]["name"] == self.name)
            return self._schema_of_call(tool)
        calls = [self._schema_of_call(t) for t in self.tools]
        items = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return {"type": "array", "items": items, "minItems": 1,
                **({} if self.parallel else {"maxItems": 1})}  # fmt: skip

    def structured(self) -> StructuredOutputsParams | None:
        """The grammar of a forced call; None when the model chooses."""
        if not self.forced:
            return None
        return StructuredOutputsParams(json=self.schema(), disable_any_whitespace=True)

    def describe(self) -> str:
        """The tools and the format of a call, for a system message."""
        if not self.forced:
            return self.parser.describe(self.tools)
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in self.tools)
        if self.choice == "named":
            how = (
                f"Call the function {self.name}: respond with only a JSON object "
                f'{{"name": "{self.name}", "arguments": <args-json-object>}}.'
            )
        else:
            how = (
                f"Call {'one or more' if self.parallel else 'one'} of them: respond with only "
                'a JSON array of calls, each {"name": <function-name>, "arguments": '
                "<args-json-object>}."
            )
        return f"You can call these functions, described in JSON Schema:\n{listed}\n\n{how}"


def template_messages(
    messages: list[Message], plan: ToolPlan | None, parser: ToolFormat, takes_tools: bool
) -> tuple[list[Message], list[dict[str, Any]] | None]:
    """The conversation and the ``tools`` argument for the chat template. A template with a
    tools section gets both as transformers passes them; for one without, the tools are
    described in the (first) system message and earlier calls are written into the
    assistant's text in ``parser``'s format."""
    tools = plan.tools if plan is not None and plan.choice != "none" else None
    if takes_tools:
        return messages, tools
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            text = parser.render([c["function"] for c in calls])
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = f"{m['content']}\n{text}" if m.get("content") else text
        out.append(m)
    if tools is not None:
        assert plan is not None
        description = plan.describe()
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{description}"}
        else:
            out.insert(0, {"role": "system", "content": description})
    return out, None
