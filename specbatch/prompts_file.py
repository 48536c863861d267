"""Reading a prompts file (``specbatch generate``, the benches): ``.txt`` or ``.jsonl``.

``.txt``: every line that is not blank (whitespace only) is one prompt, taken literally: no escape
sequences are interpreted (a backslash is a backslash) and only the line ending is removed. A
prompt with newlines in it, or one given as token ids, needs ``.jsonl``.

``.jsonl`` (or ``.ndjson``): every non-blank line is a JSON object with ``prompt`` (text) or
``prompt_token_ids`` (a list of ints), optionally ``id`` (a string or an integer, copied to the
output) and any of the sampling fields in ``LINE_SAMPLING_FIELDS``, which override the flags for
that line. Other keys are ignored, with one warning per key name.

A prompt's *index* is its position among the file's non-blank lines, counting malformed lines
too, so that indices stay the same when a malformed line is fixed and the run is resumed.
Malformed lines are returned as ``LineError`` values, never raised: the caller reports them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from specbatch.errors import InvalidInputError
from specbatch.options import options_of
from specbatch.sampling_params import SamplingParams

# The sampling fields a line may set: those the command line has flags for, and its seed.
LINE_SAMPLING_FIELDS = (*(n for n, opt, _ in options_of(SamplingParams) if opt.flag), "seed")
PROMPT_FIELDS = ("prompt", "prompt_token_ids")
FILE_FORMATS = {".txt": "txt", ".jsonl": "jsonl", ".ndjson": "jsonl"}


@dataclass
class PromptLine:
    index: int  # 0-based among the file's non-blank lines
    line_no: int  # 1-based line number in the file
    prompt: str | list[int]
    id: str | int | None = None
    overrides: dict[str, Any] = field(default_factory=dict)  # per-line sampling fields


@dataclass
class LineError:
    index: int
    line_no: int
    message: str


@dataclass
class PromptsFile:
    path: str
    format: Literal["txt", "jsonl"]
    prompts: list[PromptLine]
    errors: list[LineError]
    warnings: list[LineError]

    def where(self, line_no: int) -> str:
        return f"{self.path}:{line_no}"


def file_format(path: str | Path) -> Literal["txt", "jsonl"]:
    suffix = Path(path).suffix.lower()
    if suffix not in FILE_FORMATS:
        raise InvalidInputError(
            f"prompts: cannot tell the format of '{path}' from its extension; use .txt "
            "(one prompt a line) or .jsonl (one JSON object a line)",
            "prompts",
        )
    return FILE_FORMATS[suffix]  # type: ignore[return-value]


def read_prompts(path: str | Path) -> PromptsFile:
    """Parse the whole file. Raises ``InvalidInputError`` for a bad extension, ``OSError`` when
    the file cannot be read; malformed lines come back in ``errors``."""
    fmt = file_format(path)
    data = Path(path).read_bytes()
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark
        data = data[3:]
    result = PromptsFile(str(path), fmt, [], [], [])
    unknown_seen: set[str] = set()
    index = 0
    for line_no, raw in enumerate(data.split(b"\n"), start=1):
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if raw.strip():
                result.errors.append(
                    LineError(
                        index,
                        line_no,
                        f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})",
                    )
                )
                index += 1
            continue
        if not text.strip():
            continue
        if fmt == "txt":
            result.prompts.append(PromptLine(index, line_no, text))
        else:
            try:
                result.prompts.append(_parse_json_line(text, index, line_no, result, unknown_seen))
            except InvalidInputError as e:
                result.errors.append(LineError(index, line_no, str(e)))
        index += 1
    return result


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _parse_json_line(
    text: str, index: int, line_no: int, result: PromptsFile, unknown_seen: set[str]
) -> PromptLine:
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise InvalidInputError(f"invalid JSON: {e.msg} (column {e.colno})") from None
    except ValueError as e:  # NaN / Infinity
        raise InvalidInputError(f"invalid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise InvalidInputError(f"expected a JSON object, got {_json_type(obj)}")
    given = [k for k in PROMPT_FIELDS if k in obj]
    if not given:
        raise InvalidInputError(
            "missing 'prompt' (text) or 'prompt_token_ids' (a list of token ids)"
        )
    if len(given) > 1:
        raise InvalidInputError("give 'prompt' or 'prompt_token_ids', not both")
    prompt: str | list[int]
    if "prompt" in obj:
        prompt = obj["prompt"]
        if not isinstance(prompt, str):
            raise InvalidInputError(f"prompt must be a string, got {_json_type(prompt)}", "prompt")
    else:
        prompt = obj["prompt_token_ids"]
        if not isinstance(prompt, list) or any(
            isinstance(t, bool) or not isinstance(t, int) for t in prompt
        ):
            raise InvalidInputError(
                f"prompt_token_ids must be a list of integers, got {json.dumps(prompt)[:60]}",
                "prompt_token_ids",
            )
    rid = obj.get("id")
    if rid is not None and (isinstance(rid, bool) or not isinstance(rid, (str, int))):
        raise InvalidInputError(f"id must be a string or an integer, got {_json_type(rid)}")
    overrides = {k: obj[k] for k in LINE_SAMPLING_FIELDS if k in obj}
    known = {*PROMPT_FIELDS, "id", *LINE_SAMPLING_FIELDS}
    for key in obj:
        if key not in known and key not in unknown_seen:
            unknown_seen.add(key)
            result.warnings.append(
                LineError(index, line_no, f"ignoring unknown field '{key}' (reported once)")
            )
    return PromptLine(index, line_no, prompt, rid, overrides)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    names = {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }
    return names.get(type(value), type(value).__name__)
