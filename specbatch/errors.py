"""The two kinds of error a user of specbatch can meet."""

from __future__ import annotations


class InvalidInputError(ValueError):
    """Bad user input: a request, a sampling parameter, a file or a configuration value.

    The message always names the offending field and the limit it broke, so that the CLI and the
    server can show it as it is, without a traceback. ``field``, when set, is the field the
    message starts with, as Python spells it (``top_p``, ``speculative_config.topk``): each
    entry point shows it as its user wrote it (``named``: ``--top-p`` on the command line).
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        if field is not None and not message.startswith(field):
            raise AssertionError(f"the message {message!r} does not start with {field!r}")
        super().__init__(message)
        self.field = field

    def named(self, name: str) -> str:
        """The message with its field spelled ``name`` (a flag, a JSON key)."""
        text = str(self)
        return name + text[len(self.field) :] if self.field is not None else text

    def __reduce__(self) -> tuple:  # the field survives pickling (a Ray worker's error)
        return InvalidInputError, (str(self), self.field)


def invalid(field: str, rest: str) -> InvalidInputError:
    """The error of ``field``: its message is the field's name, then ``rest``."""
    return InvalidInputError(field + rest, field)


class EngineError(RuntimeError):
    """The engine itself failed (a worker died, a step timed out); requests in flight are lost.

    Raised from ``LLM.generate`` / ``LLM.chat``, ``outputs`` holds what had finished, in input
    order (None for each request that had not)."""

    outputs: list | None = None
