"""The Ray executors' settings from the environment: names, defaults and how a number of seconds
is read (plain Python, so that the engine's modules import no torch through them)."""

from __future__ import annotations

import os

from specbatch.errors import InvalidInputError

STEP_TIMEOUT_ENV = "SPECBATCH_RAY_STEP_TIMEOUT"  # seconds one engine step may take
INIT_TIMEOUT_ENV = "SPECBATCH_RAY_INIT_TIMEOUT"  # seconds to place, start and load the workers
THREADS_ENV = "SPECBATCH_WORKER_THREADS"  # torch threads per CPU rank
DEFAULT_STEP_TIMEOUT_S = 60.0
DEFAULT_INIT_TIMEOUT_S = 900.0
CPU_BUNDLE = 0.01  # logical CPUs a CPU rank reserves: places it without starving other tasks


def env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from ``$name``, ``default`` when unset."""
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise InvalidInputError(f"{name} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise InvalidInputError(f"{name} must be positive, got {raw!r}")
    return value
