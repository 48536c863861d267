"""``specbatch serve``: the OpenAI-compatible HTTP server (FastAPI on uvicorn)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from types import FrameType
from typing import Any

from specbatch.engine.async_engine import DEFAULT_MAX_QUEUE_LEN
from specbatch.entrypoints.flags import add_engine_flags, add_options, engine_args_from, values_of
from specbatch.entrypoints.tool_parsers import PARSERS
from specbatch.errors import InvalidInputError
from specbatch.options import check_options, option


@dataclass
class ServerOptions:
    # fmt: off
    host: str = option("127.0.0.1", "address to bind", metavar="HOST")
    port: int = option(8000, "port", ge=0, le=65535, metavar="PORT")
    api_key: str | None = option(None, "require this bearer token on /v1/* (default: "
        "$SPECBATCH_API_KEY, else none)", type=str, metavar="KEY")
    max_queue_len: int = option(DEFAULT_MAX_QUEUE_LEN, "most requests waiting beyond the "
        "running batch; more get 503", ge=0)
    served_model_name: str | None = option(None, "the model name clients send (default: the "
        "--model argument, else specbatch-default)", type=str, metavar="NAME")
    shutdown_timeout: float = option(10.0, "on SIGTERM, how long requests in flight may run "
        "before they are aborted", ge=0, metavar="SECONDS")
    log_level: str = option("info", "uvicorn log level",
        choices=("critical", "error", "warning", "info", "debug"))
    tool_call_parser: str = option("hermes", "the format the model writes tool calls in, read "
        'with tool_choice "auto" (hermes: <tool_call> JSON, as Qwen2.5/Qwen3; llama3_json: '
        "Llama 3's JSON)", choices=tuple(PARSERS))
    # fmt: on

    def __post_init__(self) -> None:
        check_options(ServerOptions, self)
        if self.api_key is not None and not self.api_key.strip():
            raise InvalidInputError("api_key must not be empty", "api_key")


DESCRIPTION = """\
Serve the model over HTTP with the OpenAI API:
  POST /v1/completions       prompt as text or token ids; max_tokens, temperature, top_p,
                             top_k, min_p, seed, stop, stop_token_ids, ignore_eos, stream
  POST /v1/chat/completions  when the tokenizer has a chat template; tools and tool_choice
                             ("required" or a named function forced by a grammar; "auto" read
                             with --tool-call-parser)
  GET  /v1/models, GET /health, GET /metrics (Prometheus text)
  GET  /docs, GET /openapi.json  every request field with its type and default

The server binds to 127.0.0.1 unless --host says otherwise. With --api-key (or
$SPECBATCH_API_KEY), /v1/* requests need 'Authorization: Bearer KEY'. Errors: 400 bad input,
401 bad key, 503 queue full (--max-queue-len requests waiting beyond --max-num-seqs running)
or shutting down, 500 engine failure (then /health answers 503). On SIGTERM or Ctrl-C the
server stops admitting at once, lets requests in flight run for --shutdown-timeout seconds,
then ends the rest with an error (503) and exits."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="serve the model with an OpenAI-compatible HTTP API",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    env_key = os.environ.get("SPECBATCH_API_KEY")
    add_options(p, ServerOptions, "server options", defaults={"api_key": env_key})
    add_engine_flags(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    opts = ServerOptions(**values_of(args, ServerOptions))
    import uvicorn

    from specbatch.entrypoints.openai_server import build_app

    app = build_app(
        engine_args_from(args),
        api_key=opts.api_key,
        max_queue_len=opts.max_queue_len,
        served_model_name=opts.served_model_name,
        tool_call_parser=opts.tool_call_parser,
    )
    timeout = opts.shutdown_timeout

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            app.state.engine.request_shutdown(timeout)  # before uvicorn stops listening
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=opts.host,
        port=opts.port,
        log_level=opts.log_level,
        timeout_graceful_shutdown=timeout + 5,  # the aborted requests' answers go out first
    )
    Server(config).run()
    return 0
