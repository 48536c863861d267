"""The OpenAI API's wire format: request bodies checked field by field, errors, SSE chunks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Callable
from typing import Any

from fastapi.responses import StreamingResponse

from specbatch.chat import check_messages
from specbatch.errors import InvalidInputError
from specbatch.outputs import CompletionOutput, Logprob, PositionLogprobDict, RequestOutput
from specbatch.sampling_params import MAX_LOGPROBS, SamplingParams

DEFAULT_MODEL_NAME = "specbatch-default"
_FIELD_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*)(?=[ :])")


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, kind: str, param: str | None = None, code: Any = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status,
            message,
            kind,
            param,
            code,
        )


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


def error_body(e: ApiError) -> dict[str, Any]:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}


# ---- request parsing -------------------------------------------------------------------------

_MISSING = object()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def typed_field(body: dict[str, Any], name: str, kind: str, default: Any = None) -> Any:
    """``body[name]`` checked against ``kind`` (int, number, bool, str, str_list, int_list);
    null means the default."""
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    ok = {
        "int": _is_int(v),
        "number": _is_num(v),
        "bool": isinstance(v, bool),
        "str": isinstance(v, str),
        "object": isinstance(v, dict),
        "stop": isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)),
        "int_list": isinstance(v, list) and all(_is_int(t) for t in v),
    }[kind]
    if not ok:
        what = {
            "int": "an integer",
            "number": "a number",
            "bool": "a boolean",
            "str": "a string",
            "object": "an object",
            "stop": "a string or a list of strings",
            "int_list": "a list of integers",
        }[kind]
        raise bad_request(f"{name} must be {what}, got {json.dumps(v)[:80]}", name)
    return v


# Fields this server does not implement, each with the test of the values that mean "off",
# which are accepted whatever their JSON type (0 and 0.0 alike): clients send the defaults.
_NEUTRAL: dict[str, tuple[str, Any]] = {
    "best_of": ("1", lambda v: _is_num(v) and v == 1),
    "suffix": ('""', lambda v: v == ""),
    "logit_bias": ("{}", lambda v: v == {}),
}


def _reject_unsupported(body: dict[str, Any]) -> None:
    for name, (neutral, is_neutral) in _NEUTRAL.items():
        v = body.get(name)
        if v is not None and not is_neutral(v):
            raise bad_request(
                f"{name}: not supported by this server; only {neutral} (off) is accepted, "
                f"got {json.dumps(v)[:80]}",
                name,
            )


def sampling_params_from(
    body: dict[str, Any],
    max_tokens_names: tuple[str, ...],
    default_max_tokens: int | None,
    logprobs: int | None = None,
) -> SamplingParams:
    """``SamplingParams`` from an OpenAI request body (plus vLLM's extra fields); ``logprobs``
    as the endpoint reads it from its own fields."""
    _reject_unsupported(body)
    max_tokens = default_max_tokens
    for name in max_tokens_names:
        v = typed_field(body, name, "int")
        if v is not None:
            max_tokens = v
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": typed_field(body, "temperature", "number", 1.0),
        "top_p": typed_field(body, "top_p", "number", 1.0),
        "top_k": typed_field(body, "top_k", "int", 0),
        "min_p": typed_field(body, "min_p", "number", 0.0),
        "seed": typed_field(body, "seed", "int"),
        "stop": typed_field(body, "stop", "stop"),
        "stop_token_ids": typed_field(body, "stop_token_ids", "int_list"),
        "ignore_eos": typed_field(body, "ignore_eos", "bool", False),
        "include_stop_str_in_output": typed_field(
            body, "include_stop_str_in_output", "bool", False
        ),
        "skip_special_tokens": typed_field(body, "skip_special_tokens", "bool", True),
        "n": typed_field(body, "n", "int", 1),
        "presence_penalty": typed_field(body, "presence_penalty", "number", 0.0),
        "frequency_penalty": typed_field(body, "frequency_penalty", "number", 0.0),
        "repetition_penalty": typed_field(body, "repetition_penalty", "number", 1.0),
        "min_tokens": typed_field(body, "min_tokens", "int", 0),
        "logprobs": logprobs,
        "prompt_logprobs": typed_field(body, "prompt_logprobs", "int"),
    }
    return SamplingParams(**kwargs)


def completion_logprobs(body: dict[str, Any]) -> tuple[int | None, bool]:
    """The completions endpoint's ``logprobs`` (top alternatives per token) and ``echo``."""
    return typed_field(body, "logprobs", "int"), typed_field(body, "echo", "bool", False)


def chat_logprobs(body: dict[str, Any]) -> int | None:
    """The chat endpoint's ``logprobs`` (a flag) with ``top_logprobs`` (how many)."""
    wanted = typed_field(body, "logprobs", "bool", False)
    top = typed_field(body, "top_logprobs", "int")
    if top is not None and not wanted:
        raise bad_request("top_logprobs: needs logprobs set to true", "top_logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
    return (top or 0) if wanted else None


def requested_max_tokens(body: dict[str, Any], names: tuple[str, ...]) -> tuple[str, int] | None:
    """The field and value of the client's own output limit (the last of ``names`` given)."""
    given = [(n, body[n]) for n in names if _is_int(body.get(n))]
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


def field_of(message: str) -> str | None:
    m = _FIELD_RE.match(message)
    return m.group(1) if m else None


def completion_prompt(body: dict[str, Any]) -> str | list[int]:
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("prompt is required", "prompt")
    p = body["prompt"]
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        if len(p) != 1:
            raise bad_request(
                f"prompt: one prompt per request is supported, got {len(p)}", "prompt"
            )
        p = p[0]
    if isinstance(p, str):
        return p
    if isinstance(p, list) and all(_is_int(t) for t in p):
        return p
    raise bad_request(
        "prompt must be a string, a list of token ids, or a list holding one of those", "prompt"
    )


def chat_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    try:
        return check_messages(body.get("messages"))
    except InvalidInputError as e:
        raise bad_request(str(e), "messages") from None


# ---- responses --------------------------------------------------------------------------------


def usage_of(out: RequestOutput) -> dict[str, int]:
    n_prompt = len(out.prompt_token_ids)
    n_out = sum(len(c.token_ids) for c in out.outputs)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def finish_reason_of(c: CompletionOutput) -> str | None:
    return None if c.finish_reason == "abort" else c.finish_reason


def _token_text(lp: Logprob, token_id: int) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{token_id}"


def _top(entry: PositionLogprobDict, k: int) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda kv: kv[1].rank)[:k]


def legacy_logprobs(
    entries: list[PositionLogprobDict | None],
    token_ids: list[int],
    top: int,
    decode: Callable[[list[int]], str],
) -> dict[str, Any]:
    """The completions endpoint's logprobs object for these positions, ``top`` alternatives
    each (None: the prompt's first token, which has no logprob; ``decode`` gives its text)."""
    offset = 0
    tokens, token_lps, tops, offsets = [], [], [], []
    for entry, tid in zip(entries, token_ids, strict=True):
        text = _token_text(entry[tid], tid) if entry else decode([tid])
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(entry[tid].logprob)
        tops.append({_token_text(v, t): v.logprob for t, v in _top(entry, top)})
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs_content(
    entries: list[PositionLogprobDict], token_ids: list[int], top: int
) -> list[dict[str, Any]]:
    """The chat endpoint's ``logprobs.content`` for these positions."""

    def item(lp: Logprob, tid: int) -> dict[str, Any]:
        text = _token_text(lp, tid)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    out = []
    for entry, tid in zip(entries, token_ids, strict=True):
        alternatives = [item(v, t) for t, v in _top(entry, top)]
        out.append({**item(entry[tid], tid), "top_logprobs": alternatives})
    return out


class TextDelta:
    """Text deltas of one completion: never streams a (partial) stop string, flushes at finish."""

    def __init__(self, params: SamplingParams) -> None:
        self.sent = ""
        self.tokens_sent = 0
        self.done = False
        self.hold = max((len(s) for s in params.stop_strings), default=1) - 1

    def next(self, c: CompletionOutput) -> str:
        text = c.text
        if c.finish_reason is None:
            text = text[: len(text) - self.hold] if self.hold else text
            text = text.rstrip("\ufffd")  # an incomplete character: wait for its other bytes
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta


def sse_event(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """A streaming response that notices a client that went away even while no event is due,
    and always closes its body iterator (whose ``finally`` aborts the request)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        streamer = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streamer, watcher):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, OSError, Exception):
                    await task
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[union-attr]


# ---- the app ----------------------------------------------------------------------------------
