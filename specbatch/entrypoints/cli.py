"""The ``specbatch`` command: ``generate``, ``verify``, ``bench``, ``bench serve`` and ``serve``.

Every user error (a bad flag value, a model directory that is not a checkpoint, a KV budget too
small, a missing file) ends as ``error: <message>`` on stderr with exit status 2, never a
traceback. Ctrl-C exits with status 130, SIGTERM (handled the same way) with 143.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from specbatch import __version__
from specbatch.entrypoints import bench, bench_long_context, bench_serve, generate, serve, verify
from specbatch.entrypoints.flags import flag
from specbatch.entrypoints.signals import exit_status, sigterm_as_interrupt, what_happened
from specbatch.errors import EngineError, InvalidInputError

EXIT_USAGE = 2


class CliParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors read ``error: <message>`` (after the usage), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"error: {message}\n")


def build_parser() -> CliParser:
    parser = CliParser(
        prog="specbatch",
        description="Speculative decoding inside continuous batching over a paged KV cache.",
    )
    parser.add_argument("--version", action="version", version=f"specbatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    generate.add_parser(sub)
    verify.add_parser(sub)
    modes = bench.add_parser(sub)
    bench_serve.add_serve_parser(modes)
    bench_long_context.add_parser(modes)
    serve.add_parser(sub)
    return parser


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error (already printed)
        return int(e.code or 0) if not isinstance(e.code, str) else EXIT_USAGE
    try:
        with sigterm_as_interrupt():
            return int(args.func(args))
    except InvalidInputError as e:
        return _error(e.named(flag(e.field)) if e.field is not None else str(e))
    except OSError as e:
        where = f"'{e.filename}': " if getattr(e, "filename", None) else ""
        return _error(f"{where}{e.strerror or e}")
    except EngineError as e:  # a worker died or hung: what was written is kept
        print(f"error: engine failure: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt as e:
        print(f"\n{what_happened(e)}", file=sys.stderr, flush=True)
        return exit_status(e)


if __name__ == "__main__":
    sys.exit(main())
