"""The two kinds of error a user of specbatch can meet."""


class InvalidInputError(ValueError):
    """Bad user input: a request, a sampling parameter, a file or a configuration value.

    The message always names the offending field and the limit it broke, so that the CLI and the
    server can show it as it is, without a traceback.
    """


class EngineError(RuntimeError):
    """The engine itself failed (a worker died, a step timed out); requests in flight are lost.

    Raised from ``LLM.generate`` / ``LLM.chat``, ``outputs`` holds what had finished, in input
    order (None for each request that had not)."""

    outputs: list | None = None
