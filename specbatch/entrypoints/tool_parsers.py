"""The formats a model writes tool calls in: read from its output (whole, or as far as a stream
has come), written back into a history, and described in a system message for a chat template
that has no tools section of its own.

``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks among text (the
Qwen2.5 and Qwen3 templates). ``llama3_json``: the output is ``{"name": ..., "parameters":
{...}}`` objects separated by ``;`` (Llama 3). ``FORCED``: the JSON a forced call's grammar
writes, one ``{"name": ..., "arguments": {...}}`` object or an array of them.

A call's ``arguments`` is the arguments object's JSON text as the model wrote it, so a stream's
fragments add up to exactly the whole reply's. Parsing a stream (``final=False``) gives only what
later text cannot change, as long as the calls parse in the end: text that may be the start of
markup is held back, and a call is given once its name is known and its arguments object has
begun. A block that does not parse is text: it comes back as content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_WS = " \t\r\n"
_ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text (in a stream, its beginning)


@dataclass(frozen=True)
class Parsed:
    content: str  # the text outside the calls
    calls: list[ToolCall]


# ---- JSON as far as it goes -------------------------------------------------------------------


def _ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """After the string starting at ``text[i] == '"'``; None when the text ends inside it."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """After the JSON value starting at ``text[i]`` (its nesting and strings followed, the rest
    left to ``json.loads``); None when the text ends inside it."""
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}]" + _WS:
        j += 1
    return j if j < len(text) else None


@dataclass
class _Scan:
    """An object ``{"name": ..., "arguments": ...}`` read as far as the text goes."""

    start: int
    name: str | None = None
    args_start: int | None = None  # where the arguments value begins
    args_end: int | None = None
    name_first: bool = False  # the name came before the arguments
    end: int | None = None  # after the closing brace
    bad: bool = False  # not an object of string keys


def _scan(text: str, i: int) -> _Scan:
    s, n, j = _Scan(i), len(text), i + 1
    while True:
        j = _ws(text, j)
        if j >= n:
            return s
        if text[j] == "}":
            s.end = j + 1
            return s
        if text[j] == ",":
            j += 1
            continue
        key_end = _string_end(text, j) if text[j] == '"' else None
        if text[j] != '"' or key_end is None:
            s.bad = text[j] != '"'
            return s
        key = _loads(text[j:key_end])
        j = _ws(text, key_end)
        if j >= n:
            return s
        if text[j] != ":":
            s.bad = True
            return s
        j = _ws(text, j + 1)
        if j >= n:
            return s
        if key in _ARGUMENT_KEYS and s.args_start is None:
            s.args_start, s.name_first = j, s.name is not None
        end = _value_end(text, j)
        if end is None:
            return s
        if key == "name" and s.name is None and isinstance(name := _loads(text[j:end]), str):
            s.name = name
        if j == s.args_start:
            s.args_end = end
        j = end


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _partial(text: str, s: _Scan) -> ToolCall | None:
    """The call so far, once its name is known and its arguments object has begun."""
    if s.bad or not s.name or not s.name_first or s.args_start is None:
        return None
    if text[s.args_start] != "{":
        return None
    return ToolCall(s.name, text[s.args_start : s.args_end or len(text)])


def _complete(text: str, s: _Scan) -> ToolCall | None:
    """The call of a whole object, or None when it is not one."""
    if s.bad or s.end is None:
        return None
    obj = _loads(text[s.start : s.end])
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in _ARGUMENT_KEYS if k in obj), None)
    value = obj[key] if key else {}
    if isinstance(value, str):  # the arguments as a JSON string
        return ToolCall(obj["name"], value) if isinstance(_loads(value), dict) else None
    if not isinstance(value, dict):
        return None
    raw = text[s.args_start : s.args_end] if s.args_start is not None and s.args_end else ""
    if _loads(raw) != value:  # a repeated key: the value JSON keeps
        raw = json.dumps(value, ensure_ascii=False)
    return ToolCall(obj["name"], raw)


def _unheld(text: str, tag: str) -> str:
    """``text`` less an ending that may be the start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return text[:-k]
    return text


def _tool_json(tools: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)


# ---- the formats ------------------------------------------------------------------------------


@dataclass
class _Text:
    """Text between calls, and the calls: whitespace next to a call is markup, not content."""

    pieces: list[str] = field(default_factory=lambda: [""])
    calls: list[ToolCall] = field(default_factory=list)

    def call(self, call: ToolCall) -> None:
        self.calls.append(call)
        self.pieces.append("")

    def parsed(self, open_end: bool) -> Parsed:
        """``open_end``: a call or markup may follow the last piece."""
        last = len(self.pieces) - 1
        out = []
        for i, piece in enumerate(self.pieces):
            piece = piece.lstrip(_WS) if i else piece
            out.append(piece.rstrip(_WS) if i < last or open_end else piece)
        return Parsed("".join(out), self.calls)


class Hermes:
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool = True) -> Parsed:
        out, i = _Text(), 0
        while (k := text.find(self.OPEN, i)) >= 0:
            out.pieces[-1] += text[i:k]
            done, call, end = self._block(text, k, final)
            if not done:  # the block is still being written
                if call is not None:
                    out.calls.append(call)
                return out.parsed(open_end=True)
            if call is None:
                out.pieces[-1] += text[k:end]
            else:
                out.call(call)
            i = end
        out.pieces[-1] += text[i:] if final else _unheld(text[i:], self.OPEN)
        return out.parsed(open_end=not final)

    def _block(self, text: str, k: int, final: bool) -> tuple[bool, ToolCall | None, int]:
        """Whether the block at ``k`` is over, its call (None: not a call), and its end."""
        n, j = len(text), _ws(text, k + len(self.OPEN))
        if j < n and text[j] == "{":
            s = _scan(text, j)
            if s.end is not None and not s.bad:
                m = _ws(text, s.end)
                if text.startswith(self.CLOSE, m):
                    end = m + len(self.CLOSE)
                elif not final and self.CLOSE.startswith(text[m:]):
                    return False, _partial(text, s), n
                else:  # no closing tag: the object ends the block
                    end = s.end
                call = _complete(text, s)
                if call is not None:
                    return True, call, end
            elif not final and not s.bad:
                return False, _partial(text, s), n
        close = text.find(self.CLOSE, j)
        if close >= 0:
            return True, None, close + len(self.CLOSE)
        return final, None, n

    def describe(self, tools: list[dict[str, Any]]) -> str:
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "The functions you can call are described in JSON Schema within <tools></tools> "
            f"tags:\n<tools>\n{_tool_json(tools)}\n</tools>\n\n"
            "To call a function, write a JSON object with its name and arguments within "
            "<tool_call></tool_call> tags, one block per call:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>"
        )

    def render(self, calls: list[dict[str, Any]]) -> str:
        blocks = (json.dumps({"name": c["name"], "arguments": c["arguments"]}, ensure_ascii=False)
                  for c in calls)  # fmt: skip
        return "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)


class Llama3Json:
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool = True) -> Parsed:
        n, j = len(text), _ws(text, 0)
        if text.startswith(self.PYTHON_TAG, j):
            j = _ws(text, j + len(self.PYTHON_TAG))
        elif not final and self.PYTHON_TAG.startswith(text[j:]):
            return Parsed("", [])  # nothing yet, or maybe the tag
        if j >= n or text[j] != "{":
            return Parsed(text if final or j < n else "", [])
        out = _Text()
        while True:
            s = _scan(text, j)
            call = _complete(text, s)
            if call is None:
                if s.end is None and not s.bad and not final:
                    partial = _partial(text, s)
                    return Parsed("", [*out.calls, *([partial] if partial else [])])
                if not out.calls:
                    return Parsed(text, [])
                out.pieces[-1] = text[j:]  # after the calls: text
                return out.parsed(open_end=False)
            out.call(call)
            m = _ws(text, s.end or n)
            after = _ws(text, m + 1) if text.startswith(";", m) else m
            if after < n and text[after] == "{" and after > m:
                j = after
                continue
            if not final and after == n:  # a ";" or whitespace so far: maybe another call
                return out.parsed(open_end=True)
            out.pieces[-1] = text[m:]
            return out.parsed(open_end=not final)

    def describe(self, tools: list[dict[str, Any]]) -> str:
        return (
            "You have access to the following functions, described in JSON Schema:\n\n"
            f"{_tool_json(tools)}\n\n"
            "To call a function, respond with only a JSON object in the format "
            '{"name": function name, "parameters": dictionary of argument name and its value}; '
            "separate several calls with ';'. Do not use variables."
        )

    def render(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(
            json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False)
            for c in calls
        )


class ForcedJson:
    """What a forced call's grammar writes: one call object, or an array of them."""

    name = "forced"

    def parse(self, text: str, final: bool = True) -> Parsed:
        n, j = len(text), _ws(text, 0)
        whole = Parsed(text if final else "", [])
        if j >= n:
            return whole
        array = text[j] == "["
        j = _ws(text, j + 1) if array else j
        calls: list[ToolCall] = []
        while j < n and text[j] == "{":
            s = _scan(text, j)
            call = _complete(text, s)
            if call is None:
                if s.end is None and not s.bad and not final:
                    partial = _partial(text, s)
                    return Parsed("", [*calls, *([partial] if partial else [])])
                return whole
            calls.append(call)
            m = _ws(text, s.end or n)
            if not array:
                return Parsed("", calls) if m == n or not final else whole
            if m < n and text[m] == "]":
                return Parsed("", calls) if _ws(text, m + 1) == n else whole
            if m < n and text[m] == ",":
                j = _ws(text, m + 1)
                continue
            return whole if final or m < n else Parsed("", calls)
        return whole if final or j < n else Parsed("", calls)


ToolFormat = Hermes | Llama3Json  # a format a model is told to call in
ToolParser = Hermes | Llama3Json | ForcedJson
PARSERS: dict[str, ToolFormat] = {p.name: p for p in (Hermes(), Llama3Json())}
FORCED = ForcedJson()
