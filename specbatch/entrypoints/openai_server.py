"""An OpenAI-compatible HTTP server over ``AsyncLLMEngine`` (FastAPI).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (when the tokenizer has a
chat template), ``GET /v1/models``, ``GET /health``, ``GET /metrics``, and FastAPI's ``/docs``
and ``/openapi.json``. Errors are OpenAI-shaped (``{"error": {"message", "type", "param",
"code"}}``): 400 bad input, 401 missing or wrong API key (``/v1/*`` only), 503 full queue or
shutting down, 500 engine failure. Streams are server-sent events, one ``data: {chunk}`` per
engine output that added text, ending with ``data: [DONE]``.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from specbatch.chat import check_messages, render_chat, template_takes_tools
from specbatch.config import EngineArgs
from specbatch.detokenizer import token_texts
from specbatch.engine.async_data_parallel import create_async_engine
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
    ChatRequest,
    CompletionRequest,
    bad_request,
    check_context_room,
    check_stop_token_ids,
    error_body,
    one_prompt,
    requested_max_tokens,
    sampling_params,
    validation_error,
)
from specbatch.entrypoints.openai_replies import (
    MakeChunk,
    ReplyIds,
    ToolCallStream,
    chat_logprobs_content,
    collect,
    engine_error,
    finish_reason_of,
    legacy_logprobs,
    sse_response,
    tool_message,
    usage_of,
)
from specbatch.entrypoints.openai_structured import StructuredField
from specbatch.entrypoints.openai_tools import ToolPlan, template_messages
from specbatch.entrypoints.tool_parsers import PARSERS
from specbatch.errors import EngineError, InvalidInputError
from specbatch.outputs import CompletionOutput, RequestOutput
from specbatch.sampling_params import SamplingParams
from specbatch.structured_outputs import StructuredOutputsParams

logger = logging.getLogger("specbatch.server")
MAX_UNKNOWN_FIELDS = 256  # names remembered (and logged) at most


class OpenAIServer:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        model_name: str,
        api_key: str | None = None,
        tool_call_parser: str = "hermes",
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.api_key = api_key
        self.tool_call_parser = tool_call_parser
        self._takes_tools: bool | None = None
        self.metrics = ServerMetrics(engine, model_name)
        self.created = int(time.time())
        self.unknown_fields: set[str] = set()
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

    def check_body(self, body: CompletionRequest | ChatRequest) -> None:
        """What the models alone cannot check: the model's name, ``stream_options`` without
        ``stream``; unknown fields are logged, once per name."""
        if body.model is not None and body.model != self.model_name:
            raise ApiError(
                400,
                f"model: unknown model {body.model[:80]!r}; this server serves "
                f"'{self.model_name}' (see GET /v1/models)",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options: only allowed when stream is true", "stream_options")
        room = MAX_UNKNOWN_FIELDS - len(self.unknown_fields)
        for name in sorted(set(body.model_extra or ()) - self.unknown_fields)[:room]:
            self.unknown_fields.add(name)
            logger.warning("ignoring the unknown request field %r (logged once)", name[:80])

    async def start(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        field: str,
        requested: tuple[str, int] | None,
        structured: StructuredField | None = None,
        add_special_tokens: bool = True,
        stream: bool = True,
    ) -> tuple[RequestStream, list[int]]:
        """Check the request against the model (its grammar parsed), tokenize (both off the
        event loop), check the room left for the output, and queue: the request's stream and
        its prompt's token ids. ``stream``: the reply is streamed (else only the last output is
        needed)."""
        e = self.engine.engine
        if params.stop_strings and e.tokenizer is None:
            raise bad_request("stop: stop strings need a tokenizer, and the model has none", "stop")
        check_stop_token_ids(params, e.config.target.vocab_size)
        if structured is not None:
            try:
                await self.engine.run_on_tokenizer_threads(e.grammars.check, structured.params)
            except InvalidInputError as err:
                raise bad_request(structured.message(str(err)), structured.param) from None
        try:
            text, ids = await self.engine.prepare(prompt, params, field, add_special_tokens)
        except InvalidInputError as err:
            raise bad_request(str(err), field) from None
        check_context_room(len(ids), requested, e.config.max_model_len)
        try:
            return await self.engine.add_prepared(text, ids, params, stream=stream), ids
        except QueueFullError as err:
            raise ApiError(503, str(err), "server_overloaded") from None
        except EngineError as err:
            raise engine_error(err) from None

    def _decode(self, ids: list[int]) -> str:
        tok = self.engine.engine.tokenizer
        return tok.decode(ids) if tok is not None else ""

    # -- completions --
    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        self.check_body(body)
        values = body.sampling_values()
        if body.echo and body.logprobs is not None and body.prompt_logprobs is None:
            values["prompt_logprobs"] = body.logprobs
        params, structured = sampling_params(values, None, body)
        requested = requested_max_tokens(body, ("max_tokens",))
        stream, prompt_ids = await self.start(
            one_prompt(body.prompt),
            params,
            "prompt",
            requested,
            structured,
            stream=bool(body.stream),
        )
        reply = ReplyIds(
            f"cmpl-{uuid.uuid4().hex}", int(time.time()), "text_completion", self.model_name
        )
        echo, top, tok = body.echo, body.logprobs, self.engine.engine.tokenizer
        prompt_texts: list[str | None] = [None] * len(prompt_ids)
        if echo and top is not None and tok is not None:  # each token's share of the prompt
            prompt_texts = await self.engine.run_on_tokenizer_threads(
                token_texts, tok, prompt_ids, params.skip_special_tokens
            )

        def chunk(
            text: str, finish: str | None, out: RequestOutput, c: CompletionOutput, start: int
        ) -> dict[str, Any]:
            """The choice's text from token ``start``, after the prompt when it is echoed
            (before a choice's first tokens), with the logprobs of those tokens."""
            prefix, ids, entries = "", c.token_ids[start:], (c.logprobs or [])[start:]
            texts: list[str | None] = [None] * len(ids)
            if echo and start == 0:
                prefix = (
                    out.prompt if out.prompt is not None else self._decode(out.prompt_token_ids)
                )
                ids = [*out.prompt_token_ids, *ids]
                entries = [*(out.prompt_logprobs or []), *entries]
                texts = [*prompt_texts, *texts]
            lps = None
            if top is not None and c.logprobs is not None:
                lps = legacy_logprobs(entries, ids, top, texts)
            choice = {"index": c.index, "text": prefix + text, "logprobs": lps}
            return reply.wrap([{**choice, "finish_reason": finish}])

        if body.stream:
            return self._stream(stream, params, reply, chunk, [], body)
        out = await collect(stream, request)
        choices = [chunk(c.text, finish_reason_of(c), out, c, 0)["choices"][0] for c in out.outputs]
        return JSONResponse(reply.wrap(choices, usage=usage_of(out)))

    # -- chat --
    async def _forced(self, plan: ToolPlan | None) -> StructuredField | None:
        """A forced call's grammar, each tool's parameters checked as a JSON schema first."""
        spec = plan.structured() if plan is not None else None
        if plan is None or spec is None:
            return None
        grammars = self.engine.engine.grammars
        for i, tool in enumerate(plan.tools):
            schema = StructuredOutputsParams(json=tool["function"]["parameters"])
            try:
                await self.engine.run_on_tokenizer_threads(grammars.check, schema)
            except InvalidInputError as e:
                spelt = f"tools[{i}].function.parameters"
                raise bad_request(StructuredField(schema, "tools", spelt).message(str(e)),
                                  "tools") from None  # fmt: skip
        return StructuredField(spec, "tool_choice", "tool_choice")

    async def _prompt(self, body: ChatRequest, plan: ToolPlan | None) -> str:
        tok = self.engine.engine.tokenizer
        try:
            messages = check_messages([m.model_dump() for m in body.messages])
            if self._takes_tools is None:
                self._takes_tools = template_takes_tools(tok)
            parser = PARSERS[self.tool_call_parser]
            messages, tools = template_messages(messages, plan, parser, self._takes_tools)
            return await self.engine.run_on_tokenizer_threads(
                lambda: render_chat(tok, messages, tools=tools)
            )
        except InvalidInputError as e:
            raise bad_request(str(e), "messages") from None

    async def chat(self, body: ChatRequest, request: Request) -> Any:
        self.check_body(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs: needs logprobs set to true", "top_logprobs")
        top = (body.top_logprobs or 0) if body.logprobs else None
        requested = requested_max_tokens(body, ("max_tokens", "max_completion_tokens"))
        values = body.sampling_values()
        values.update(logprobs=top, max_tokens=requested[1] if requested else None)
        wire = {"logprobs": "top_logprobs", "max_tokens": requested[0] if requested else ""}
        plan = body.tool_plan(self.tool_call_parser)
        params, structured = sampling_params(values, wire, body, await self._forced(plan))
        text = await self._prompt(body, plan)
        stream, _ = await self.start(
            text,
            params,
            "messages",
            requested,
            structured,
            add_special_tokens=False,
            stream=bool(body.stream),
        )
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        ids = ReplyIds(rid, created, "chat.completion.chunk", self.model_name)

        def lps_of(c: CompletionOutput, start: int) -> dict[str, Any] | None:
            if top is None or c.logprobs is None:
                return None
            end = len(c.token_ids)
            return {
                "content": chat_logprobs_content(c.logprobs[start:end], c.token_ids[start:end], top)
            }

        def chunk(
            index: int, delta: dict[str, Any], finish: str | None, lps: Any
        ) -> dict[str, Any]:
            choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish}
            return ids.wrap([choice])

        reader = plan.read if plan is not None and plan.reader is not None else None
        if body.stream:
            first = [
                chunk(i, {"role": "assistant", "content": ""}, None, None) for i in range(params.n)
            ]

            def text_chunk(
                text: str, finish: str | None, out: RequestOutput, c: CompletionOutput, start: int
            ) -> dict[str, Any]:
                return chunk(c.index, {"content": text} if text else {}, finish, lps_of(c, start))

            if reader is None:
                return self._stream(stream, params, ids, text_chunk, first, body)
            calls = [ToolCallStream(reader) for _ in range(params.n)]

            def tool_chunks(
                text: str, finish: str | None, out: RequestOutput, c: CompletionOutput, start: int
            ) -> list[dict[str, Any]]:
                """Content and call deltas, then the finish in a chunk of its own."""
                calling = calls[c.index]
                deltas = calling.feed(text, finish is not None)
                lps = lps_of(c, start)
                if lps is not None and not deltas:
                    deltas = [{}]
                chunks = [chunk(c.index, d, None, lps if i == 0 else None)
                          for i, d in enumerate(deltas)]  # fmt: skip
                if finish is not None:
                    reason = "tool_calls" if finish == "stop" and calling.called else finish
                    chunks.append(chunk(c.index, {}, reason, None))
                return chunks

            return self._stream(stream, params, ids, tool_chunks, first, body)
        out = await collect(stream, request)
        choices = []
        for c in out.outputs:
            message, finish = {"role": "assistant", "content": c.text}, finish_reason_of(c)
            if reader is not None:
                message = tool_message(c.text, reader(c.text))
                if finish == "stop" and "tool_calls" in message:
                    finish = "tool_calls"
            choices.append(
                {"index": c.index, "message": message, "logprobs": lps_of(c, 0),
                 "finish_reason": finish}
            )  # fmt: skip
        whole = ReplyIds(rid, created, "chat.completion", self.model_name)
        return JSONResponse(whole.wrap(choices, usage=usage_of(out)))

    # -- shared --
    def _stream(
        self,
        stream: RequestStream,
        params: SamplingParams,
        ids: ReplyIds,
        make_chunk: MakeChunk,
        first: list[dict[str, Any]],
        body: CompletionRequest | ChatRequest,
    ) -> Response:
        options = body.stream_options
        return sse_response(
            stream,
            params,
            ids,
            make_chunk,
            first=first,
            include_usage=options is not None and options.include_usage,
            abort=self.engine.abort,
            on_error=self.metrics.http_error,
        )

    # -- the rest --
    def models(self) -> dict[str, Any]:
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
        """200 ok; with data-parallel replicas, each one's status, and 200 "degraded" while
        some serve; 503 when nothing can serve."""
        replicas = self.engine.replica_health()
        extra = {"replicas": replicas} if replicas is not None else {}
        if not self.engine.is_healthy:
            body = {"status": "unhealthy", "error": str(self.engine.error), **extra}
            return JSONResponse(body, 503)
        down = replicas is not None and any(r["status"] != "ok" for r in replicas)
        return JSONResponse({"status": "degraded" if down else "ok", **extra})

    def metrics_page(self) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)


def build_app(
    engine_args: EngineArgs | None = None,
    api_key: str | None = None,
    max_queue_len: int = DEFAULT_MAX_QUEUE_LEN,
    served_model_name: str | None = None,
    engine: AsyncLLMEngine | None = None,
    tool_call_parser: str = "hermes",
) -> FastAPI:
    """The FastAPI app. Loads the model now (so a bad model fails before the port is bound)
    unless ``engine`` is given; the engine's loop starts with the first request.
    ``app.state.server`` is the ``OpenAIServer`` and ``app.state.engine`` the ``AsyncLLMEngine``.
    ``tool_call_parser``: the format the model writes tool calls in (``tool_choice: "auto"``)."""
    if tool_call_parser not in PARSERS:
        raise InvalidInputError(
            f"tool_call_parser must be one of {', '.join(PARSERS)}, got {tool_call_parser!r}",
            "tool_call_parser",
        )
    if engine is None:
        engine = create_async_engine(engine_args or EngineArgs(), max_queue_len)
    name = served_model_name or (engine_args.model if engine_args and engine_args.model else None)
    server = OpenAIServer(engine, name or DEFAULT_MODEL_NAME, api_key, tool_call_parser)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        yield
        await engine.shutdown()

    app = FastAPI(title="specbatch", lifespan=lifespan, strict_content_type=False)
    app.state.server, app.state.engine = server, engine

    def error(exc: ApiError) -> JSONResponse:
        server.metrics.http_error(exc.status)
        return JSONResponse(error_body(exc), status_code=exc.status)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 400 and exc.__cause__ is not None:  # the body did not parse
            cause = exc.__cause__
            message = f"the request body is not valid JSON: {type(cause).__name__}: {cause}"
        return error(ApiError(exc.status_code, message, "invalid_request_error"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))

    keyed = [Depends(server.check_key)]
    app.add_api_route("/v1/completions", server.completions, methods=["POST"], dependencies=keyed)
    app.add_api_route("/v1/chat/completions", server.chat, methods=["POST"], dependencies=keyed)
    app.add_api_route("/v1/models", server.models, methods=["GET"], dependencies=keyed)
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.metrics_page, methods=["GET"])
    return app
