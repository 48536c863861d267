"""Tensor parallelism over Ray: one actor per rank, in a placement group, one round per step.

Every rank runs the same ``Worker.execute`` on the same plan: the logits are all-gathered to the
full vocabulary on every rank and every rank holds the same seeded per-request generators, so the
ranks stay in lockstep (same shapes, same collectives, same tokens) without exchanging anything
but the plan. The draft loop, the target pass and the rejection sampling all happen inside the
workers; only rank 0's result travels back.

Ray itself: an existing connection (``ray.init`` done by the caller) is used as it is; otherwise
the executor joins ``ray_address`` (``RAY_ADDRESS``, ``auto``) or starts a local instance, and
disconnects / stops it at shutdown. Failures (a dead actor, an exception in a rank, no reply
within the step timeout) become ``EngineError`` naming the rank; the actors and the placement
group are then torn down, so a failed engine holds no resources.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any

from specbatch.config import EngineConfig
from specbatch.distributed.init import (
    Rendezvous,
    backend_for,
    rendezvous_host,
    serve_store,
)
from specbatch.distributed.ray_connect import connect_ray
from specbatch.distributed.ray_settings import (
    CPU_BUNDLE,
    DEFAULT_INIT_TIMEOUT_S,
    DEFAULT_STEP_TIMEOUT_S,
    INIT_TIMEOUT_ENV,
    STEP_TIMEOUT_ENV,
    THREADS_ENV,
    env_seconds,
)
from specbatch.errors import EngineError, InvalidInputError
from specbatch.scheduler.kv_prices import KvPrices
from specbatch.scheduler.output import SchedulerOutput, StepResult
from specbatch.worker.executor import num_kv_blocks_from_budget
from specbatch.worker.ray_failures import describe_failures
from specbatch.worker.ray_rank import RankWorker

logger = logging.getLogger(__name__)


def _threads_for(ranks_on_node: int) -> int:
    raw = os.environ.get(THREADS_ENV)
    if raw:
        return max(1, int(raw))
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, ranks_on_node))


class RayExecutor:
    """``tensor_parallel_size`` Ray actors, one per rank, driven with one call each per step.

    ``workers`` (actor handles, rank order), ``actor_names`` and ``placement_group`` are public
    for inspection.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        step_timeout_s: float | None = None,
        init_timeout_s: float | None = None,
        placement: tuple[Any, int] | None = None,
    ) -> None:
        """``placement``: (placement group, bundle index) to start every rank in, a bundle
        someone else reserved and removes (a data-parallel replica's); None: a placement
        group of one bundle per rank, made and removed here."""
        self.config = config
        self._given_placement = placement
        self.world_size = config.tensor_parallel_size
        self.step_timeout_s = step_timeout_s or env_seconds(
            STEP_TIMEOUT_ENV, DEFAULT_STEP_TIMEOUT_S
        )
        self.init_timeout_s = init_timeout_s or env_seconds(
            INIT_TIMEOUT_ENV, DEFAULT_INIT_TIMEOUT_S
        )
        self.workers: list[Any] = []
        self.actor_names: list[str] = []
        self.placement_group: Any = None
        self.locations: list[tuple[str, str, int]] = []  # (node id, node ip, pid) per rank
        self.rendezvous: Rendezvous | None = None
        self._store: Any = None
        self._owns_ray = False
        self._failure: str | None = None
        self._closed = False
        try:
            self._connect()
            self._place()
            self._start()
        except BaseException:
            self.shutdown()
            raise

    # ---- set-up ----------------------------------------------------------------------------
    def _connect(self) -> None:
        self._owns_ray = connect_ray(self.config.ray_address)

    def _place(self) -> None:
        import ray
        from ray.util.placement_group import placement_group

        if self._given_placement is not None:
            self.placement_group = self._given_placement[0]
            return
        on_gpu = self.config.device == "cuda"
        bundle = {"GPU": 1.0} if on_gpu else {"CPU": CPU_BUNDLE}
        need = "GPU" if on_gpu else "CPU"
        have = float(ray.cluster_resources().get(need, 0.0))
        if have < bundle[need] * self.world_size:
            raise EngineError(
                f"tensor_parallel_size={self.world_size} needs {self.world_size} x {bundle} "
                f"but the Ray cluster has {need}={have:g} in all"
            )
        self.placement_group = placement_group([dict(bundle)] * self.world_size, strategy="PACK")
        try:
            ray.get(self.placement_group.ready(), timeout=self.init_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise EngineError(
                f"could not reserve {self.world_size} x {bundle} on the Ray cluster within "
                f"{self.init_timeout_s:g} s (available now: {ray.available_resources()})"
            ) from None

    def _start(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        on_gpu = self.config.device == "cuda"
        actor_cls = ray.remote(RankWorker)
        tag = uuid.uuid4().hex[:8]
        self.actor_names = [f"specbatch-tp{rank}-{tag}" for rank in range(self.world_size)]
        for rank in range(self.world_size):
            given = self._given_placement
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group,
                placement_group_bundle_index=rank if given is None else given[1],
            )
            self.workers.append(
                actor_cls.options(
                    num_cpus=0,
                    num_gpus=1 if on_gpu else 0,
                    scheduling_strategy=strategy,
                    max_restarts=0,
                    name=self.actor_names[rank],
                ).remote(rank, self.world_size, self.config.device)
            )
        self.locations = self._call_all("start-up", "where", timeout=None)
        nodes = [node for node, _, _ in self.locations]
        ctx = ray.get_runtime_context()
        host = rendezvous_host(ray.util.get_node_ip_address(), ctx.get_node_id(), nodes)
        self._store = serve_store(self.init_timeout_s)
        self.rendezvous = Rendezvous(
            host=host,
            port=self._store.port,
            prefix=f"specbatch-{uuid.uuid4().hex}/",
            backend=backend_for(self.config.device),
            world_size=self.world_size,
            timeout_s=self.step_timeout_s,
        )
        threads = [_threads_for(nodes.count(node)) for node in nodes]
        self._call_ranks(
            "process-group set-up",
            [w.setup.remote(self.rendezvous, n) for w, n in zip(self.workers, threads)],
            self.init_timeout_s,
        )
        config_ref = ray.put(self.config)
        self._call_all("model loading", "load", config_ref, timeout=None)

    def determine_num_kv_blocks(self) -> int:
        infos = self._call_all("KV budget measurement", "kv_info", timeout=None)
        return min(num_kv_blocks_from_budget(self.config, b, n) for b, n in infos)

    def init_kv_cache(self, num_blocks: int) -> KvPrices | None:
        """Every rank allocates its caches; rank 0's attention prices come back."""
        return self._call_all("KV cache allocation", "init_kv_cache", num_blocks, timeout=None)[0]

    # ---- the step --------------------------------------------------------------------------
    def execute(self, plan: SchedulerOutput) -> StepResult:
        """One round: every rank runs the step; rank 0's result comes back.

        ``timings`` gains ``worker`` (rank 0's execute), ``collectives`` (its all-reduces and
        all-gathers) and ``ray`` (the round trip minus rank 0's execute).
        """
        t0 = time.perf_counter()
        results = self._call_all("an engine step", "execute", plan, timeout=self.step_timeout_s)
        result = results[0]
        assert result is not None
        result.timings["ray"] = max(0.0, time.perf_counter() - t0 - result.timings["worker"])
        return result

    def _call_all(self, what: str, method: str, *args: Any, timeout: float | None) -> list[Any]:
        return self._call_ranks(
            what,
            [getattr(w, method).remote(*args) for w in self._live_workers()],
            self.init_timeout_s if timeout is None else timeout,
        )

    def _live_workers(self) -> list[Any]:
        if self._failure is not None:
            raise EngineError(f"the tensor-parallel workers are gone: {self._failure}")
        if self._closed:
            raise EngineError("the executor has been shut down")
        return self.workers

    def _call_ranks(self, what: str, refs: list[Any], timeout: float) -> list[Any]:
        """``ray.get`` of one call per rank, within ``timeout``; any failure tears the workers
        down and raises an ``EngineError`` naming every rank that failed and how."""
        import ray

        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            detail = describe_failures(
                refs, self.locations, f"no reply within {timeout:g} s (hung?)"
            )
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, InvalidInputError):  # a user error on a rank: no wrapping
                self._fail(str(cause))
                raise InvalidInputError(str(cause)) from None
            detail = describe_failures(refs, self.locations, "")
        except ray.exceptions.RayError:
            detail = describe_failures(refs, self.locations, "")
        message = f"tensor-parallel worker failure during {what}: {detail}"
        self._fail(message)
        raise EngineError(message) from None

    # ---- tear-down -------------------------------------------------------------------------
    def _fail(self, message: str) -> None:
        """Remember the failure and release the actors and the placement group at once."""
        if self._failure is None:
            self._failure = message
        logger.error("%s", message)
        self._release()

    def _release(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        workers, self.workers = self.workers, []
        for w in workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception as e:  # already gone
                logger.debug("ray.kill: %s", e)
        if workers:  # wait (bounded) until Ray reports them dead, so callers see them gone
            probes = [w.where.remote() for w in workers]
            ray.wait(probes, num_returns=len(probes), timeout=10.0)
        if self.placement_group is not None and self._given_placement is None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.placement_group)
            except Exception as e:
                logger.debug("remove_placement_group: %s", e)
        self._store = None

    def shutdown(self) -> None:
        """Kill the actors, remove the placement group; stop/disconnect Ray if we started it.
        Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        try:
            self._release()
        finally:
            if self._owns_ray:
                import ray

                ray.shutdown()
                self._owns_ray = False
