"""An OpenAI-compatible HTTP server over ``AsyncLLMEngine`` (FastAPI).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (when the tokenizer has a
chat template), ``GET /v1/models``, ``GET /health``, ``GET /metrics``. Errors are OpenAI-shaped
(``{"error": {"message", "type", "param", "code"}}``): 400 bad input, 401 missing or wrong API
key (``/v1/*`` only), 503 full queue, 500 engine failure. Streams are server-sent events, one
``data: {chunk}`` per engine output that added text, ending with ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specbatch.config import EngineArgs
from specbatch.engine.async_engine import (
    DEFAULT_MAX_QUEUE_LEN,
    AsyncLLMEngine,
    QueueFullError,
    RequestStream,
)
from specbatch.engine.prometheus import ServerMetrics
from specbatch.errors import EngineError, InvalidInputError
from specbatch.outputs import RequestOutput
from specbatch.sampling_params import SamplingParams

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


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


def _error_body(e: ApiError) -> dict[str, Any]:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}


# ---- request parsing -------------------------------------------------------------------------

_MISSING = object()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _typed(body: dict[str, Any], name: str, kind: str, default: Any = None) -> Any:
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
        raise _bad(f"{name} must be {what}, got {json.dumps(v)[:80]}", name)
    return v


def _reject_unsupported(body: dict[str, Any]) -> None:
    for name, neutral in (
        ("presence_penalty", (0, 0.0)),
        ("frequency_penalty", (0, 0.0)),
        ("repetition_penalty", (1, 1.0)),
        ("best_of", (1,)),
        ("echo", (False,)),
        ("suffix", ("",)),
        ("logprobs", (False, 0)),
        ("top_logprobs", (0,)),
        ("logit_bias", ({},)),
    ):
        v = body.get(name)
        if v is not None and not (v in neutral and type(v) is type(neutral[0])):
            raise _bad(f"{name} is not supported by this server (got {json.dumps(v)[:80]})", name)


def sampling_params_from(
    body: dict[str, Any], max_tokens_names: tuple[str, ...], default_max_tokens: int | None
) -> SamplingParams:
    """``SamplingParams`` from an OpenAI request body (plus vLLM's extra fields)."""
    _reject_unsupported(body)
    max_tokens = default_max_tokens
    for name in max_tokens_names:
        v = _typed(body, name, "int")
        if v is not None:
            max_tokens = v
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": _typed(body, "temperature", "number", 1.0),
        "top_p": _typed(body, "top_p", "number", 1.0),
        "top_k": _typed(body, "top_k", "int", 0),
        "min_p": _typed(body, "min_p", "number", 0.0),
        "seed": _typed(body, "seed", "int"),
        "stop": _typed(body, "stop", "stop"),
        "stop_token_ids": _typed(body, "stop_token_ids", "int_list"),
        "ignore_eos": _typed(body, "ignore_eos", "bool", False),
        "include_stop_str_in_output": _typed(body, "include_stop_str_in_output", "bool", False),
        "skip_special_tokens": _typed(body, "skip_special_tokens", "bool", True),
        "n": _typed(body, "n", "int", 1),
    }
    return SamplingParams(**kwargs)


def _field_of(message: str) -> str | None:
    m = _FIELD_RE.match(message)
    return m.group(1) if m else None


def _completion_prompt(body: dict[str, Any]) -> str | list[int]:
    if "prompt" not in body or body["prompt"] is None:
        raise _bad("prompt is required", "prompt")
    p = body["prompt"]
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        if len(p) != 1:
            raise _bad(f"prompt: one prompt per request is supported, got {len(p)}", "prompt")
        p = p[0]
    if isinstance(p, str):
        return p
    if isinstance(p, list) and all(_is_int(t) for t in p):
        return p
    raise _bad(
        "prompt must be a string, a list of token ids, or a list holding one of those", "prompt"
    )


def _chat_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise _bad(f"{where}.content[{i}]: only text parts are supported", "messages")
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad(f"{where}.content[{i}].text must be a string", "messages")
            parts.append(text)
        return "".join(parts)
    raise _bad(f"{where}.content must be a string or a list of text parts", "messages")


def _chat_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a string role", "messages")
        out.append({"role": m["role"], "content": _chat_text(m.get("content"), f"messages[{i}]")})
    return out


# ---- responses --------------------------------------------------------------------------------


def _usage(out: RequestOutput) -> dict[str, int]:
    n_prompt, n_out = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def _finish_reason(out: RequestOutput) -> str | None:
    reason = out.outputs[0].finish_reason
    return None if reason == "abort" else reason


class _Delta:
    """Text deltas of one request: never streams a (partial) stop string, flushes at finish."""

    def __init__(self, params: SamplingParams) -> None:
        self.sent = ""
        self.hold = max((len(s) for s in params.stop_strings), default=1) - 1

    def next(self, out: RequestOutput) -> str:
        text = out.outputs[0].text
        if not out.finished:
            text = text[: len(text) - self.hold] if self.hold else text
            text = text.rstrip("\ufffd")  # an incomplete character: wait for its other bytes
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _EventStream(StreamingResponse):
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
            raise _bad(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
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
        self, prompt: str | list[int], params: SamplingParams, field: str
    ) -> RequestStream:
        try:
            return await self.engine.add_request(prompt, params, field=field)
        except InvalidInputError as e:
            raise _bad(str(e), _field_of(str(e))) from None
        except QueueFullError as e:
            raise ApiError(503, str(e), "server_overloaded") from None
        except EngineError as e:
            raise ApiError(500, str(e), "server_error") from None

    # -- completions --
    async def completions(self, request: Request) -> Any:
        self.check_key(request)
        body = await self.json_body(request)
        prompt = _completion_prompt(body)
        stream_flag, include_usage = self._stream_flags(body)
        try:
            params = sampling_params_from(body, ("max_tokens",), 16)  # OpenAI's default
        except InvalidInputError as e:
            raise _bad(str(e), _field_of(str(e))) from None
        stream = await self.start(prompt, params, "prompt")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            }

        if stream_flag:
            return self._sse_response(
                stream,
                params,
                lambda d, f: chunk(d, f),
                None,
                include_usage,
                rid,
                created,
                "text_completion",
            )
        out = await self._collect(stream, request)
        body_out = chunk(out.outputs[0].text, _finish_reason(out))
        body_out["usage"] = _usage(out)
        return JSONResponse(body_out)

    # -- chat --
    async def chat(self, request: Request) -> Any:
        self.check_key(request)
        body = await self.json_body(request)
        tok = self.engine.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise _bad(
                f"the model '{self.model_name}' has no chat template in its tokenizer, so "
                "/v1/chat/completions is unavailable; use /v1/completions",
                "messages",
            )
        messages = _chat_messages(body)
        stream_flag, include_usage = self._stream_flags(body)
        try:
            params = sampling_params_from(body, ("max_tokens", "max_completion_tokens"), None)
        except InvalidInputError as e:
            raise _bad(str(e), _field_of(str(e))) from None
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template may raise on roles it does not know
            raise _bad(f"messages: the chat template rejected them: {e}", "messages") from None
        ids = list(tok.encode(text, add_special_tokens=False))
        stream = await self.start(ids, params, "messages")
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(delta: dict[str, str], finish: str | None) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                ],
            }

        if stream_flag:
            first = chunk({"role": "assistant", "content": ""}, None)
            return self._sse_response(
                stream,
                params,
                lambda d, f: chunk({"content": d} if d else {}, f),
                first,
                include_usage,
                rid,
                created,
                "chat.completion.chunk",
            )
        out = await self._collect(stream, request)
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": self.model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": out.outputs[0].text},
                        "logprobs": None,
                        "finish_reason": _finish_reason(out),
                    }
                ],
                "usage": _usage(out),
            }
        )

    # -- shared --
    @staticmethod
    def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
        stream_flag = _typed(body, "stream", "bool", False)
        opts = _typed(body, "stream_options", "object", {})
        include_usage = opts.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise _bad("stream_options.include_usage must be a boolean", "stream_options")
        return stream_flag, include_usage

    async def _collect(self, stream: RequestStream, request: Request) -> RequestOutput:
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

    def _sse_response(
        self,
        stream: RequestStream,
        params: SamplingParams,
        make_chunk: Any,
        first: dict[str, Any] | None,
        include_usage: bool,
        rid: str,
        created: int,
        obj: str,
    ) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            delta = _Delta(params)
            it = stream.__aiter__()
            try:
                if first is not None:
                    yield _sse(first)
                last: RequestOutput | None = None
                async for out in it:
                    last = out
                    d = delta.next(out)
                    finish = _finish_reason(out) if out.finished else None
                    if d or out.finished:
                        yield _sse(make_chunk(d, finish))
                if include_usage and last is not None:
                    usage_chunk = {
                        "id": rid,
                        "object": obj,
                        "created": created,
                        "model": self.model_name,
                        "choices": [],
                        "usage": _usage(last),
                    }
                    yield _sse(usage_chunk)
                yield "data: [DONE]\n\n"
            except EngineError as e:  # headers are sent: report in-band, as OpenAI does
                self.metrics.http_errors[500] += 1
                err = ApiError(500, f"engine failure: {e}", "server_error")
                yield _sse(_error_body(err))
                yield "data: [DONE]\n\n"
            finally:
                if not stream.finished:
                    self.engine.abort(stream.request_id)

        return _EventStream(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
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
        return JSONResponse(_error_body(exc), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        server.metrics.http_errors[exc.status_code] += 1
        err = ApiError(exc.status_code, str(exc.detail), "invalid_request_error")
        return JSONResponse(_error_body(err), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        server.metrics.http_errors[500] += 1
        err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")
        return JSONResponse(_error_body(err), status_code=500)

    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.metrics_page, methods=["GET"])
    return app
