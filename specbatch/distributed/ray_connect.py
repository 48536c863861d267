"""Connecting to Ray: the address checked before ``ray.init`` gets it, and the process's own
SIGTERM handler kept.

``ray.init(address="HOST:PORT")`` with nothing listening there retries for many minutes, printing
only its own warnings. A TCP connection to the address answers in milliseconds (refused) or
within ``timeout_s`` (unreachable), so the engine fails fast with a message naming the address.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator

from specbatch.errors import EngineError, InvalidInputError

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
LOCAL_OBJECT_STORE_BYTES = 256 << 20  # plans, results and outputs are a few KiB
_RESOLVED_BY_RAY = ("auto", "local")  # Ray finds these itself, and fails fast when it cannot


def host_and_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``HOST:PORT`` or ``ray://HOST:PORT``; None for ``auto``/``local``."""
    if address in _RESOLVED_BY_RAY:
        return None
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    host = host.strip("[]")  # an IPv6 literal
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidInputError(
            f"ray_address: expected HOST:PORT (as `ray start --head` prints it), "
            f"ray://HOST:PORT or auto, got {address!r}",
            "ray_address",
        )
    return host, int(port)


def check_ray_address(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raise ``InvalidInputError`` naming ``address`` unless something accepts a connection
    there."""
    target = host_and_port(address)
    if target is None:
        return
    host, port = target
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except TimeoutError:
        reason = f"no answer within {timeout_s:g} s"
    except OSError as e:
        reason = e.strerror or str(e)
    else:
        return
    raise InvalidInputError(
        f"ray_address: no Ray cluster answers at {address} ({reason}); start one there with "
        f"`ray start --head --port={port}`, or pass auto to join this node's cluster",
        "ray_address",
    )


@contextlib.contextmanager
def keep_sigterm_handler() -> Iterator[None]:
    """Restore the SIGTERM handler that ``ray.init`` replaces with its own (``sys.exit``), so
    that the command line's handler still stops a run the way Ctrl-C does."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)


def connect_ray(address: str | None) -> bool:
    """Make sure this process is connected to Ray: an existing connection is used as it is;
    otherwise join ``address`` (``RAY_ADDRESS``, ``auto``) or start a private local instance.
    Returns whether this call connected (the caller then disconnects at shutdown)."""
    import ray

    if ray.is_initialized():
        if address:
            logger.info("Ray is already initialised; ignoring ray_address")
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address:
        check_ray_address(address)  # ray.init would retry for minutes
    try:
        with keep_sigterm_handler():  # ray.init installs its own
            if address:
                ray.init(address=address, logging_level=logging.WARNING)
            else:
                # A private instance on this machine ("local": not a cluster that a `ray
                # start` here advertised), on loopback (an offline machine's reported IP may
                # not be reachable). Ray's authentication default and RAY_AUTH_MODE are left
                # as they are.
                ray.init(
                    address="local",
                    include_dashboard=False,
                    object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                    logging_level=logging.WARNING,
                    _node_ip_address="127.0.0.1",
                    # Ray runs its workers at nice 15, as background work; here they are
                    # the engine, and would yield the CPU to every other process
                    _system_config={"worker_niceness": 0},
                )
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = f"the Ray cluster at {address!r}" if address else "a local Ray instance"
        hint = " (is `ray start --head` running there?)" if address else ""
        raise EngineError(f"could not connect to {where}{hint}: {e}") from e
    return True
