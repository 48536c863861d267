"""How a request's output reaches the HTTP client: whole, once it has finished (``collect``),
or as server-sent events while it is generated (``sse_response``). Either way a request whose
client goes away is aborted, so its KV blocks go back to the pool."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from specbatch.engine.async_engine import RequestStream
from specbatch.entrypoints.openai_protocol import (
    ApiError,
    EventStream,
    TextDelta,
    error_body,
    finish_reason_of,
    sse_event,
    usage_of,
)
from specbatch.errors import EngineError
from specbatch.outputs import CompletionOutput, RequestOutput
from specbatch.sampling_params import SamplingParams

# a chunk of the stream for one choice, from (the text delta, the finish reason or None, the
# output and the choice's completion as they stand, its first token not yet reported)
MakeChunk = Callable[[str, str | None, RequestOutput, CompletionOutput, int], dict[str, Any]]


@dataclass(frozen=True)
class ReplyIds:
    """What every chunk of one streamed reply carries."""

    id: str
    created: int
    object: str  # "text_completion" or "chat.completion.chunk"
    model: str


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
        raise ApiError(500, f"engine failure: {e}", "server_error") from None
    finally:
        if not task.done():
            task.cancel()


def sse_response(
    stream: RequestStream,
    params: SamplingParams,
    ids: ReplyIds,
    make_chunk: MakeChunk,
    *,
    first: list[dict[str, Any]],
    include_usage: bool,
    abort: Callable[[str], None],
    on_engine_error: Callable[[], None],
) -> StreamingResponse:
    """The ``first`` chunks, then one ``data: {chunk}`` event per choice and engine output
    that added text or finished it, a usage chunk when asked for, then ``data: [DONE]``. An
    engine failure after the headers went out is reported in-band, as OpenAI does; a stream
    left unfinished (the client went away) is aborted with ``abort(request_id)``."""

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
                        yield sse_event(make_chunk(text, reason, out, c, start))
            if include_usage and last is not None:
                yield sse_event(
                    {
                        "id": ids.id,
                        "object": ids.object,
                        "created": ids.created,
                        "model": ids.model,
                        "choices": [],
                        "usage": usage_of(last),
                    }
                )
            yield "data: [DONE]\n\n"
        except EngineError as e:
            on_engine_error()
            yield sse_event(error_body(ApiError(500, f"engine failure: {e}", "server_error")))
            yield "data: [DONE]\n\n"
        finally:
            if not stream.finished:
                abort(stream.request_id)

    return EventStream(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
