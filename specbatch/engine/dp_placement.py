"""Starting data-parallel replicas on a Ray cluster, and tearing them down.

One placement group holds a bundle per replica: the replica's actor and, with tensor parallelism,
its ranks (a bundle sits on one node, so a replica's ranks share a node). The bundles are spread
over the cluster's nodes by default (``SPECBATCH_DP_PLACEMENT``: spread, pack, strict_spread or
strict_pack, Ray's strategies). A placement the cluster's nodes cannot hold, and a replica that
fails to start (its actor dies, or loading raises), fail the launch at once with the reason;
nothing is left running.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from specbatch.config import EngineConfig
from specbatch.distributed.ray_connect import connect_ray
from specbatch.distributed.ray_settings import (
    CPU_BUNDLE,
    DEFAULT_INIT_TIMEOUT_S,
    INIT_TIMEOUT_ENV,
    THREADS_ENV,
    env_seconds,
)
from specbatch.errors import EngineError, InvalidInputError

logger = logging.getLogger(__name__)

PLACEMENT_ENV = "SPECBATCH_DP_PLACEMENT"
STRATEGIES = {
    "spread": "SPREAD",
    "pack": "PACK",
    "strict_spread": "STRICT_SPREAD",
    "strict_pack": "STRICT_PACK",
}
ACTOR_CONCURRENCY = 4  # poll, submit, stats and shutdown may overlap


@dataclass
class Replica:
    index: int
    actor: Any
    node_id: str = ""
    node_ip: str = ""
    pid: int = 0
    num_kv_blocks: int = 0
    seq: int = 0  # the last control message sent to it
    error: str | None = None  # why it is down (None: up)

    @property
    def alive(self) -> bool:
        return self.error is None

    @property
    def where(self) -> str:
        return f"pid {self.pid} on {self.node_ip}" if self.pid else "not started"

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq


def strategy_from_env() -> str:
    raw = os.environ.get(PLACEMENT_ENV, "spread").strip().lower()
    if raw not in STRATEGIES:
        raise InvalidInputError(
            f"{PLACEMENT_ENV} must be one of {', '.join(STRATEGIES)}, got {raw!r}"
        )
    return STRATEGIES[raw]


def bundle_for(config: EngineConfig) -> dict[str, float]:
    """One replica's bundle: its actor and its tensor-parallel ranks."""
    tp = config.tensor_parallel_size
    if config.device == "cuda":
        return {"GPU": float(tp), "CPU": CPU_BUNDLE}
    return {"CPU": CPU_BUNDLE * (tp + 1)}


def bundles_per_node(bundle: dict[str, float]) -> dict[str, int]:
    """Node id -> how many ``bundle``s its resources hold, for every live node."""
    import ray

    fits = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        have = node.get("Resources", {})
        fits[node["NodeID"]] = int(min(have.get(k, 0.0) / v for k, v in bundle.items()))
    return fits


def check_feasible(bundle: dict[str, float], count: int, strategy: str) -> None:
    fits = bundles_per_node(bundle)
    if strategy == "STRICT_SPREAD":
        held = sum(1 for n in fits.values() if n >= 1)
    elif strategy == "STRICT_PACK":
        held = max(fits.values(), default=0)
    else:
        held = sum(fits.values())
    if held < count:
        raise EngineError(
            f"data_parallel_size={count} needs {count} x {bundle} ({strategy}) but the Ray "
            f"cluster's {len(fits)} node(s) hold {held}"
        )


def threads_per_replica(node_of: list[str], tp: int) -> list[int]:
    """Torch threads for each replica's ranks: its node's CPUs shared by every rank there
    (``SPECBATCH_WORKER_THREADS`` overrides)."""
    import ray

    raw = os.environ.get(THREADS_ENV)
    if raw:
        return [max(1, int(raw))] * len(node_of)
    cpus = {n["NodeID"]: n.get("Resources", {}).get("CPU", 1.0) for n in ray.nodes()}
    return [max(1, int(cpus.get(n, 1.0)) // (node_of.count(n) * tp)) for n in node_of]


def failure_of(error: BaseException) -> str:
    """How a call to a replica failed, in a clause."""
    import ray

    if isinstance(error, ray.exceptions.RayActorError):
        return "its process died"
    if isinstance(error, ray.exceptions.RayTaskError):
        cause = getattr(error, "cause", None) or error
        lines = str(cause).strip().splitlines()
        return f"raised {type(cause).__name__}: {lines[-1] if lines else ''}"
    if isinstance(error, ray.exceptions.GetTimeoutError):
        return "no reply (hung?)"
    return f"{type(error).__name__}: {error}"


class ReplicaSet:
    """``config.data_parallel_size`` replicas started on the Ray cluster, ready to serve."""

    def __init__(self, config: EngineConfig, init_timeout_s: float | None = None) -> None:
        self.config = config
        self.count = config.data_parallel_size
        self.init_timeout_s = init_timeout_s or env_seconds(
            INIT_TIMEOUT_ENV, DEFAULT_INIT_TIMEOUT_S
        )
        self.replicas: list[Replica] = []
        self.placement_group: Any = None
        self.strategy = strategy_from_env()
        self._owns_ray = False
        self._closed = False
        try:
            self._owns_ray = connect_ray(config.ray_address)
            self._place()
            self._start()
        except BaseException:
            self.shutdown()
            raise

    # ---- set-up ----------------------------------------------------------------------------
    def _place(self) -> None:
        import ray
        from ray.util.placement_group import placement_group

        bundle = bundle_for(self.config)
        check_feasible(bundle, self.count, self.strategy)
        self.placement_group = placement_group([dict(bundle)] * self.count, self.strategy)
        try:
            ray.get(self.placement_group.ready(), timeout=self.init_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise EngineError(
                f"could not reserve {self.count} x {bundle} on the Ray cluster within "
                f"{self.init_timeout_s:g} s (available now: {ray.available_resources()})"
            ) from None

    def _start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from specbatch.engine.dp_replica import EngineReplica

        cfg, pg = self.config, self.placement_group
        tp = cfg.tensor_parallel_size
        table = placement_group_table(pg)["bundles_to_node_id"]
        threads = threads_per_replica([table[i] for i in range(self.count)], tp)
        actor_cls = ray.remote(EngineReplica)
        tag = uuid.uuid4().hex[:8]
        for i in range(self.count):
            actor = actor_cls.options(
                num_cpus=0,
                num_gpus=1 if cfg.device == "cuda" and tp == 1 else 0,
                max_concurrency=ACTOR_CONCURRENCY,
                max_restarts=0,
                name=f"specbatch-dp{i}-{tag}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=i
                ),
            ).remote(i)
            self.replicas.append(Replica(i, actor))
        where = self._gather("start-up", [r.actor.where.remote() for r in self.replicas])
        for r, (node_id, ip, pid) in zip(self.replicas, where):
            r.node_id, r.node_ip, r.pid = node_id, ip, pid
        config_ref = ray.put(cfg)
        loads = [
            r.actor.load.remote(config_ref, n, (pg, r.index) if tp > 1 else None)
            for r, n in zip(self.replicas, threads)
        ]
        for r, blocks in zip(self.replicas, self._gather("model loading", loads)):
            r.num_kv_blocks = blocks
        nodes = len({r.node_id for r in self.replicas})
        logger.info("%d data-parallel replicas on %d node(s), %s", self.count, nodes, threads)

    def _gather(self, what: str, refs: list[Any]) -> list[Any]:
        """Every replica's reply, in order; the first failure (or the init timeout) raises at
        once, naming the replica, where it ran and why."""
        import ray

        index = {ref: i for i, ref in enumerate(refs)}
        pending, deadline = list(refs), time.monotonic() + self.init_timeout_s
        while pending:
            ready, pending = ray.wait(
                pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic())
            )
            if not ready:
                late = ", ".join(str(index[r]) for r in pending)
                raise EngineError(
                    f"data-parallel replica(s) {late} did not finish {what} within "
                    f"{self.init_timeout_s:g} s"
                )
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayTaskError as e:
                    cause = getattr(e, "cause", None)
                    if isinstance(cause, InvalidInputError):
                        raise InvalidInputError(str(cause)) from None
                    self._refuse(what, index[ref], e)
                except ray.exceptions.RayError as e:
                    self._refuse(what, index[ref], e)
        return ray.get(list(refs))

    def _refuse(self, what: str, i: int, error: BaseException) -> None:
        r = self.replicas[i]
        raise EngineError(
            f"data-parallel replica {i} ({r.where}) failed during {what}: {failure_of(error)}"
        ) from None

    # ---- faults and tear-down --------------------------------------------------------------
    def mark_down(self, i: int, why: str) -> None:
        """Replica ``i`` serves no more: record why and kill its actor (and its ranks)."""
        import ray

        r = self.replicas[i]
        if not r.alive:
            return
        r.error = why
        logger.error("data-parallel replica %d (%s) is down: %s", i, r.where, why)
        try:
            ray.kill(r.actor, no_restart=True)
        except Exception as e:  # already gone
            logger.debug("ray.kill: %s", e)

    @property
    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    def shutdown(self) -> None:
        """Stop every replica, remove the placement group, and stop or disconnect Ray if this
        set connected it. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        import ray

        if ray.is_initialized():
            stops = [r.actor.shutdown.remote() for r in self.live]
            if stops:
                ray.wait(stops, num_returns=len(stops), timeout=30.0)
            for r in self.replicas:
                try:
                    ray.kill(r.actor, no_restart=True)
                except Exception as e:
                    logger.debug("ray.kill: %s", e)
            if self.placement_group is not None:
                from ray.util.placement_group import remove_placement_group

                try:
                    remove_placement_group(self.placement_group)
                except Exception as e:
                    logger.debug("remove_placement_group: %s", e)
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
