"""``specbatch serve``: the OpenAI-compatible HTTP server (FastAPI on uvicorn)."""

from __future__ import annotations

import argparse
import os
from types import FrameType
from typing import Any

from specbatch.engine.async_engine import DEFAULT_MAX_QUEUE_LEN
from specbatch.entrypoints.engine_flags import add_engine_flags, engine_args_from
from specbatch.errors import InvalidInputError

FIELDS = ("host", "port", "api_key", "max_queue_len", "served_model_name", "shutdown_timeout")
DEFAULT_SHUTDOWN_TIMEOUT = 10.0

DESCRIPTION = """\
Serve the model over HTTP with the OpenAI API:
  POST /v1/completions       prompt as text or token ids; max_tokens, temperature, top_p,
                             top_k, min_p, seed, stop, stop_token_ids, ignore_eos, stream
  POST /v1/chat/completions  when the tokenizer has a chat template
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
    g = p.add_argument_group("server options")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    g.add_argument(
        "--api-key",
        default=os.environ.get("SPECBATCH_API_KEY"),
        metavar="KEY",
        help="require this bearer token on /v1/* (default: $SPECBATCH_API_KEY, else none)",
    )
    g.add_argument(
        "--max-queue-len",
        type=int,
        default=DEFAULT_MAX_QUEUE_LEN,
        metavar="N",
        help="most requests waiting beyond the running batch; more get 503 "
        f"(default: {DEFAULT_MAX_QUEUE_LEN})",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model name clients send (default: the --model argument, else specbatch-default)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT,
        metavar="SECONDS",
        help="on SIGTERM, how long requests in flight may run before they are aborted "
        f"(default: {DEFAULT_SHUTDOWN_TIMEOUT:g})",
    )
    g.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn log level (default: info)",
    )
    add_engine_flags(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port < 65536:
        raise InvalidInputError(f"port must be in [0, 65535], got {args.port}")
    if args.max_queue_len < 0:
        raise InvalidInputError(f"max_queue_len must be >= 0, got {args.max_queue_len}")
    if not 0 <= args.shutdown_timeout < float("inf"):
        raise InvalidInputError(f"shutdown_timeout must be >= 0, got {args.shutdown_timeout}")
    if args.api_key is not None and not args.api_key.strip():
        raise InvalidInputError("api_key must not be empty")
    import uvicorn

    from specbatch.entrypoints.openai_server import build_app

    app = build_app(
        engine_args_from(args),
        api_key=args.api_key,
        max_queue_len=args.max_queue_len,
        served_model_name=args.served_model_name,
    )
    timeout = args.shutdown_timeout

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            app.state.engine.request_shutdown(timeout)  # before uvicorn stops listening
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=timeout + 5,  # the aborted requests' answers go out first
    )
    Server(config).run()
    return 0
