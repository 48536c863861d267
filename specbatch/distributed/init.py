"""Setting up the tensor-parallel process group of the workers.

The rendezvous store is a ``torch.distributed.TCPStore`` served by the *driver* (the engine's
process), on a port the operating system picks when the store binds it (port 0). The bind is the
reservation, so two engines or parallel test runs can never be handed the same port; the only
failure left, a port taken between picking and binding, cannot happen. The workers connect to it
as clients:

- on one node (every rank on the driver's node) at ``tcp://127.0.0.1:PORT``: Ray may report a
  node IP that is not reachable on an offline machine, loopback always is;
- across nodes at the driver's node IP.

The backend is NCCL on CUDA and gloo on CPU.
"""

from __future__ import annotations

import errno
import ipaddress
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from specbatch.distributed.parallel_state import TensorParallelGroup

LOOPBACK = "127.0.0.1"


def backend_for(device: str) -> str:
    """``nccl`` on CUDA devices, ``gloo`` otherwise."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


def rendezvous_host(driver_ip: str, driver_node_id: str, worker_node_ids: list[str]) -> str:
    """Loopback when every worker runs on the driver's node, else the driver's node IP."""
    if all(node == driver_node_id for node in worker_node_ids):
        return LOOPBACK
    return driver_ip


def tcp_url(host: str, port: int) -> str:
    """``tcp://host:port``, with IPv6 addresses in brackets."""
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass  # a host name
    return f"tcp://{host}:{port}"


@dataclass(frozen=True)
class Rendezvous:
    """Where the workers meet: the store's host and port, and a prefix unique to one engine."""

    host: str
    port: int
    prefix: str
    backend: str
    world_size: int
    timeout_s: float

    @property
    def url(self) -> str:
        return tcp_url(self.host, self.port)


def serve_store(timeout_s: float, attempts: int = 5) -> dist.TCPStore:
    """The driver's rendezvous store on a free port (``store.port``), listening on every
    interface so that workers on other nodes reach it too.

    Port 0 lets the kernel pick the port atomically; the retry covers the EADDRINUSE a port-0
    bind can still meet when the ephemeral range is momentarily exhausted.
    """
    last: Exception | None = None
    for _ in range(attempts):
        try:
            return dist.TCPStore(
                LOOPBACK,
                0,
                None,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=timeout_s),
            )
        except (RuntimeError, OSError) as e:  # torch wraps socket errors in RuntimeError
            if not _address_in_use(e):
                raise
            last = e
    raise RuntimeError(f"could not bind a rendezvous port after {attempts} attempts: {last}")


def _address_in_use(e: BaseException) -> bool:
    return (
        getattr(e, "errno", None) == errno.EADDRINUSE or "address already in use" in str(e).lower()
    )


def init_process_group(rank: int, rdv: Rendezvous) -> TensorParallelGroup:
    """Join this process to the group as ``rank`` (call once per process, on every rank).

    Collectives that wait longer than ``rdv.timeout_s`` for a peer raise instead of hanging.
    """
    client = dist.TCPStore(
        rdv.host,
        rdv.port,
        None,
        is_master=False,
        timeout=timedelta(seconds=rdv.timeout_s),
    )
    store = dist.PrefixStore(rdv.prefix, client)
    dist.init_process_group(
        rdv.backend,
        store=store,
        rank=rank,
        world_size=rdv.world_size,
        timeout=timedelta(seconds=rdv.timeout_s),
    )
    return TensorParallelGroup(rank=rank, size=rdv.world_size, group=dist.group.WORLD)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
