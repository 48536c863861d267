"""SIGTERM handled like Ctrl-C: raised in the main thread as ``Terminated``, a
``KeyboardInterrupt``, so every command stops through its Ctrl-C path (aborting what runs,
keeping what was written, saying so) instead of dying silently.

A signal that arrives while the main thread waits inside Ray (``ray.get``, ``ray.wait``) reaches
the caller as a fresh ``KeyboardInterrupt``: Ray runs the handler, sees it raise and raises its
own. Which signal it was is therefore also remembered here, and ``exit_status`` reads that."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_TERMINATED = 143  # 128 + SIGTERM


class Terminated(KeyboardInterrupt):
    """The process received SIGTERM."""


_sigterm_received = False


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    global _sigterm_received
    _sigterm_received = True
    raise Terminated


def _was_sigterm(e: KeyboardInterrupt) -> bool:
    return isinstance(e, Terminated) or _sigterm_received


def exit_status(e: KeyboardInterrupt) -> int:
    return EXIT_TERMINATED if _was_sigterm(e) else EXIT_INTERRUPTED


def what_happened(e: KeyboardInterrupt) -> str:
    return "terminated (SIGTERM)" if _was_sigterm(e) else "interrupted"


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises ``Terminated`` in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    global _sigterm_received
    _sigterm_received = False
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
