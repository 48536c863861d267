"""How a request's output reaches the HTTP client: whole, once it has finished (``collect``),
or as server-sent events while it is generated (``sse_response``), with the OpenAI API's
logprobs and usage objects. Either way a request whose client goes away is aborted, so its KV
blocks go back to the pool."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import string
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from specbatch.engine.async_engine import RequestStream, ShutdownError
from specbatch.entrypoints.openai_protocol import ApiError, error_body
from specbatch.entrypoints.tool_parsers import Parsed
from specbatch.errors import EngineError
from specbatch.outputs import CompletionOutput, Logprob, PositionLogprobDict, RequestOutput
from specbatch.sampling_params import SamplingParams

# the chunks of the stream for one choice (one, or a list of them), from (the text delta, the
# finish reason or None, the output and the choice's completion as they stand, its first token
# not yet reported)
MakeChunk = Callable[
    [str, str | None, RequestOutput, CompletionOutput, int], dict[str, Any] | list[dict[str, Any]]
]


@dataclass(frozen=True)
class ReplyIds:
    """What every reply, and every chunk of a streamed one, carries."""

    id: str
    created: int
    object: str  # "text_completion", "chat.completion" or "chat.completion.chunk"
    model: str

    def wrap(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


def engine_error(e: EngineError) -> ApiError:
    if isinstance(e, ShutdownError):
        return ApiError(503, str(e), "server_error", code="server_shutting_down")
    return ApiError(500, f"engine failure: {e}", "server_error")


# ---- pieces of a reply ------------------------------------------------------------------------


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
    texts: list[str | None],
) -> dict[str, Any]:
    """The completions endpoint's logprobs object for these positions: ``top`` alternatives
    each, and the sampled token when it is not among them (None: the prompt's first token,
    which has no logprob). ``texts``: a token's text where it is not its entry's."""
    offset = 0
    tokens, token_lps, tops, offsets = [], [], [], []
    for entry, tid, given in zip(entries, token_ids, texts, strict=True):
        text = given if given is not None else _token_text(entry[tid], tid) if entry else ""
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(entry[tid].logprob)
        alternatives = {_token_text(v, t): v.logprob for t, v in _top(entry, top) if t != tid}
        tops.append({**alternatives, text: entry[tid].logprob})
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


# ---- tool calls -------------------------------------------------------------------------------

_ID_CHARS = string.ascii_letters + string.digits


def call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def tool_message(text: str, parsed: Parsed) -> dict[str, Any]:
    """The assistant's message: its calls, and the text outside them (null when empty); the
    text as it is when there is no call."""
    if not parsed.calls:
        return {"role": "assistant", "content": text}
    calls = [
        {"id": call_id(), "type": "function",
         "function": {"name": c.name, "arguments": c.arguments}}
        for c in parsed.calls
    ]  # fmt: skip
    return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}


class ToolCallStream:
    """One choice's deltas as OpenAI streams tool calls: content as it becomes certain; a
    call's first delta carries its index, id, type, name and empty arguments, the next ones
    its arguments in fragments. Each delta extends what was sent; nothing is taken back, so
    when a call already begun turns out not to parse (cut by max_tokens, or malformed) the
    stream ends with what it sent, where the whole reply would give the text as content."""

    def __init__(self, parse: Callable[[str, bool], Parsed]) -> None:
        self.parse = parse
        self.text = self.content = ""
        self.names: list[str] = []
        self.arguments: list[str] = []  # each call's arguments sent so far
        self.broken = False  # a call sent no longer parses

    @property
    def called(self) -> bool:
        return bool(self.names)

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        self.text += text
        parsed = self.parse(self.text, final)
        sent = list(zip(self.names, self.arguments, strict=True))
        self.broken = self.broken or any(
            i >= len(parsed.calls)
            or parsed.calls[i].name != name
            or not parsed.calls[i].arguments.startswith(arguments)
            for i, (name, arguments) in enumerate(sent)
        )
        if self.broken:
            return []
        deltas: list[dict[str, Any]] = []
        if len(parsed.content) > len(self.content) and parsed.content.startswith(self.content):
            deltas.append({"content": parsed.content[len(self.content) :]})
            self.content = parsed.content
        for i, call in enumerate(parsed.calls):
            if i == len(self.names):
                head = {"name": call.name, "arguments": ""}
                deltas.append({"tool_calls": [{"index": i, "id": call_id(), "type": "function",
                                               "function": head}]})  # fmt: skip
                self.names.append(call.name)
                self.arguments.append("")
            sent = self.arguments[i]
            if len(call.arguments) > len(sent):
                fragment = {"arguments": call.arguments[len(sent) :]}
                deltas.append({"tool_calls": [{"index": i, "function": fragment}]})
                self.arguments[i] = call.arguments
        return deltas


def sse_event(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# ---- whole or streamed ------------------------------------------------------------------------


async def collect(stream: RequestStream, request: Request) -> RequestOutput:
    """Wait for the whole output; abort the request if the client goes away meanwhile."""
    task = asyncio.ensure_future(stream.final())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                break
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise ApiError(499, "client disconnected", "client_closed_request")
        return task.result()
    except EngineError as e:
        raise engine_error(e) from None
    finally:
        if not task.done():
            task.cancel()


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


def sse_response(
    stream: RequestStream,
    params: SamplingParams,
    ids: ReplyIds,
    make_chunk: MakeChunk,
    *,
    first: list[dict[str, Any]],
    include_usage: bool,
    abort: Callable[[str], None],
    on_error: Callable[[int], None],
) -> StreamingResponse:
    """The ``first`` chunks, then one ``data: {chunk}`` event per choice and engine output
    that added text or finished it, a usage chunk when asked for, then ``data: [DONE]``. An
    engine failure or a shutdown after the headers went out is reported in-band, as OpenAI
    does; a stream left unfinished (the client went away) is aborted with ``abort(request_id)``."""

    async def events() -> AsyncIterator[str]:
        deltas = [TextDelta(params) for _ in range(params.n)]
        try:
            for chunk in first:
                yield sse_event(chunk)
            last: RequestOutput | None = None
            async for out in stream:
                last = out
                for c in out.outputs:
                    delta = deltas[c.index]
                    if delta.done:
                        continue
                    text = delta.next(c)
                    delta.done = c.finish_reason is not None
                    if text or delta.done:
                        start, delta.tokens_sent = delta.tokens_sent, len(c.token_ids)
                        reason = finish_reason_of(c) if delta.done else None
                        chunks = make_chunk(text, reason, out, c, start)
                        for chunk in chunks if isinstance(chunks, list) else [chunks]:
                            yield sse_event(chunk)
            if include_usage and last is not None:
                yield sse_event(ids.wrap([], usage=usage_of(last)))
            yield "data: [DONE]\n\n"
        except EngineError as e:
            err = engine_error(e)
            on_error(err.status)
            yield sse_event(error_body(err))
            yield "data: [DONE]\n\n"
        finally:
            if not stream.finished:
                abort(stream.request_id)

    return EventStream(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
