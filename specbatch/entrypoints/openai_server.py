"""An OpenAI-compatible HTTP server over ``AsyncLLMEngine`` (FastAPI).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (when the tokenizer has a
chat template), ``GET /v1/models``, ``GET /health``, ``GET /metrics``. Errors are OpenAI-shaped
(``{"error": {"message", "type", "param", "code"}}``): 400 bad input, 401 missing or wrong API
key (``/v1/*`` only), 503 full queue, 500 engine failure. Streams are server-sent events, one
``data: {chunk}`` per engine output that added text, ending with ``data: [DONE]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specbatch.chat import render_chat
from specbatch.config import EngineArgs
from specbatch.engine.async_engine import (
    DEFAULT_MAX_QUEUE_LEN,
    AsyncLLMEngine,
    QueueFullError,
    RequestStream,
)
from specbatch.engine.prometheus import ServerMetrics
from specbatch.entrypoints.openai_protocol import (
    DEFAULT_MODEL_NAME,
    ApiError,
    bad_request,
    chat_logprobs,
    chat_logprobs_content,
    chat_messages,
    check_context_room,
    completion_logprobs,
    completion_prompt,
    error_body,
    field_of,
    finish_reason_of,
    legacy_logprobs,
    requested_max_tokens,
    sampling_params_from,
    typed_field,
    usage_of,
)
from specbatch.entrypoints.openai_replies import MakeChunk, ReplyIds, collect, sse_response
from specbatch.errors import EngineError, InvalidInputError
from specbatch.outputs import CompletionOutput, RequestOutput
from specbatch.sampling_params import SamplingParams


class OpenAIServer:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        model_name: str,
        api_key: str | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.api_key = api_key
        self.metrics = ServerMetrics()
        self.created = int(time.time())
        engine.on_finish(self.metrics.observe)

    # -- helpers --
    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            raise ApiError(
                401,
                "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                "invalid_request_error",
                code="invalid_api_key",
            )

    async def json_body(self, request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            raise bad_request(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(
                400,
                f"model: unknown model {json.dumps(model)[:80]}; this server serves "
                f"'{self.model_name}' (see GET /v1/models)",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        return body

    async def start(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        field: str,
        requested: tuple[str, int] | None,
        add_special_tokens: bool = True,
    ) -> RequestStream:
        """Tokenize (off the event loop), check the room left for the output, and queue."""
        try:
            text, ids = await self.engine.prepare(prompt, params, field, add_special_tokens)
            check_context_room(len(ids), requested, self.engine.engine.config.max_model_len)
            return await self.engine.add_prepared(text, ids, params)
        except InvalidInputError as e:
            raise bad_request(str(e), field_of(str(e))) from None
        except QueueFullError as e:
            raise ApiError(503, str(e), "server_overloaded") from None
        except EngineError as e:
            raise ApiError(500, str(e), "server_error") from None

    # -- completions --
    async def completions(self, request: Request) -> Any:
        self.check_key(request)
        body = await self.json_body(request)
        prompt = completion_prompt(body)
        stream_flag, include_usage = self._stream_flags(body)
        logprobs, echo = completion_logprobs(body)
        try:
            params = sampling_params_from(body, ("max_tokens",), 16, logprobs)  # OpenAI's 16
            if echo and logprobs is not None and params.prompt_logprobs is None:
                params = dataclasses.replace(params, prompt_logprobs=logprobs)
        except InvalidInputError as e:
            raise bad_request(str(e), field_of(str(e))) from None
        requested = requested_max_tokens(body, ("max_tokens",))
        stream = await self.start(prompt, params, "prompt", requested)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def choice(index: int, text: str, finish: str | None, lps: Any) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [
                    {"index": index, "text": text, "logprobs": lps, "finish_reason": finish}
                ],
            }

        def with_echo(
            out: RequestOutput, c: CompletionOutput, start: int
        ) -> tuple[str, dict[str, Any] | None]:
            """The prompt (when echoed, before a choice's first tokens) and the logprobs of
            the tokens from ``start``."""
            prefix, ids, entries = "", c.token_ids[start:], (c.logprobs or [])[start:]
            if echo and start == 0:
                prefix = (
                    out.prompt if out.prompt is not None else self._decode(out.prompt_token_ids)
                )
                ids = [*out.prompt_token_ids, *ids]
                entries = [*(out.prompt_logprobs or []), *entries]
            if logprobs is None or c.logprobs is None:
                return prefix, None
            return prefix, legacy_logprobs(entries, ids, logprobs, self._decode)

        def chunk(
            text: str, finish: str | None, out: RequestOutput, c: CompletionOutput, start: int
        ) -> dict[str, Any]:
            prefix, lps = with_echo(out, c, start)
            return choice(c.index, prefix + text, finish, lps)

        if stream_flag:
            ids = ReplyIds(rid, created, "text_completion", self.model_name)
            return self._stream(stream, params, ids, chunk, [], include_usage)
        out = await collect(stream, request)
        body_out = choice(0, "", None, None)
        body_out["choices"] = [
            chunk(c.text, finish_reason_of(c), out, c, 0)["choices"][0] for c in out.outputs
        ]
        body_out["usage"] = usage_of(out)
        return JSONResponse(body_out)

    def _decode(self, ids: list[int]) -> str:
        tok = self.engine.engine.tokenizer
        return tok.decode(ids) if tok is not None else ""

    # -- chat --
    async def chat(self, request: Request) -> Any:
        self.check_key(request)
        body = await self.json_body(request)
        messages = chat_messages(body)
        stream_flag, include_usage = self._stream_flags(body)
        names = ("max_tokens", "max_completion_tokens")
        top = chat_logprobs(body)
        try:
            params = sampling_params_from(body, names, None, top)
        except InvalidInputError as e:
            raise bad_request(str(e), field_of(str(e))) from None
        tok = self.engine.engine.tokenizer
        try:
            text = await self.engine.run_on_tokenizer_threads(render_chat, tok, messages)
        except InvalidInputError as e:
            raise bad_request(str(e), "messages") from None
        requested = requested_max_tokens(body, names)
        stream = await self.start(text, params, "messages", requested, add_special_tokens=False)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def lps_of(c: CompletionOutput, start: int) -> dict[str, Any] | None:
            if top is None or c.logprobs is None:
                return None
            end = len(c.token_ids)
            return {
                "content": chat_logprobs_content(c.logprobs[start:end], c.token_ids[start:end], top)
            }

        def chunk(
            index: int, delta: dict[str, str], finish: str | None, lps: Any
        ) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": [
                    {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish}
                ],
            }

        if stream_flag:
            ids = ReplyIds(rid, created, "chat.completion.chunk", self.model_name)
            first = [
                chunk(i, {"role": "assistant", "content": ""}, None, None) for i in range(params.n)
            ]

            def text_chunk(
                text: str, finish: str | None, out: RequestOutput, c: CompletionOutput, start: int
            ) -> dict[str, Any]:
                return chunk(c.index, {"content": text} if text else {}, finish, lps_of(c, start))

            return self._stream(stream, params, ids, text_chunk, first, include_usage)
        out = await collect(stream, request)
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": self.model_name,
                "choices": [
                    {
                        "index": c.index,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": lps_of(c, 0),
                        "finish_reason": finish_reason_of(c),
                    }
                    for c in out.outputs
                ],
                "usage": usage_of(out),
            }
        )

    # -- shared --
    @staticmethod
    def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
        stream_flag = typed_field(body, "stream", "bool", False)
        opts = typed_field(body, "stream_options", "object", {})
        include_usage = opts.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise bad_request("stream_options.include_usage must be a boolean", "stream_options")
        return stream_flag, include_usage

    def _stream(
        self,
        stream: RequestStream,
        params: SamplingParams,
        ids: ReplyIds,
        make_chunk: MakeChunk,
        first: list[dict[str, Any]],
        include_usage: bool,
    ) -> StreamingResponse:
        def engine_failed() -> None:
            self.metrics.http_errors[500] += 1

        return sse_response(
            stream,
            params,
            ids,
            make_chunk,
            first=first,
            include_usage=include_usage,
            abort=self.engine.abort,
            on_engine_error=engine_failed,
        )

    # -- the rest --
    def models(self, request: Request) -> dict[str, Any]:
        self.check_key(request)
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "specbatch",
                    "root": self.engine.engine.config.target.path,
                    "max_model_len": self.engine.engine.config.max_model_len,
                }
            ],
        }

    def health(self) -> JSONResponse:
        if self.engine.is_healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy", "error": str(self.engine.error)}, 503)

    def metrics_page(self) -> PlainTextResponse:
        e = self.engine
        text = self.metrics.render(e.engine, e.is_healthy, e.num_aborted)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def build_app(
    engine_args: EngineArgs | None = None,
    api_key: str | None = None,
    max_queue_len: int = DEFAULT_MAX_QUEUE_LEN,
    served_model_name: str | None = None,
    engine: AsyncLLMEngine | None = None,
) -> FastAPI:
    """The FastAPI app. Loads the model now (so a bad model fails before the port is bound)
    unless ``engine`` is given; the engine's loop starts with the first request.
    ``app.state.server`` is the ``OpenAIServer`` and ``app.state.engine`` the ``AsyncLLMEngine``."""
    if engine is None:
        engine = AsyncLLMEngine.from_engine_args(engine_args or EngineArgs(), max_queue_len)
    name = served_model_name or (engine_args.model if engine_args and engine_args.model else None)
    server = OpenAIServer(engine, name or DEFAULT_MODEL_NAME, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        yield
        await engine.shutdown()

    app = FastAPI(title="specbatch", lifespan=lifespan)
    app.state.server, app.state.engine = server, engine

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        server.metrics.http_errors[exc.status] += 1
        return JSONResponse(error_body(exc), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        server.metrics.http_errors[exc.status_code] += 1
        err = ApiError(exc.status_code, str(exc.detail), "invalid_request_error")
        return JSONResponse(error_body(err), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        server.metrics.http_errors[500] += 1
        err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")
        return JSONResponse(error_body(err), status_code=500)

    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.metrics_page, methods=["GET"])
    return app
