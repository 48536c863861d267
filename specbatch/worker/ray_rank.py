"""One tensor-parallel rank as a Ray actor: its process group, its Worker, one step a call."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from specbatch.config import EngineConfig
from specbatch.distributed.init import Rendezvous, destroy_process_group, init_process_group
from specbatch.distributed.parallel_state import SINGLE, TensorParallelGroup
from specbatch.scheduler.kv_prices import KvPrices
from specbatch.scheduler.output import SchedulerOutput, StepResult


@dataclass
class TimedGroup(TensorParallelGroup):
    """A tensor-parallel group that adds up the wall time its collectives take (gloo is
    synchronous; on NCCL this measures only the launch)."""

    seconds: float = 0.0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        y = super().all_reduce(x)
        self.seconds += time.perf_counter() - t
        return y

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        t = time.perf_counter()
        y = super().all_gather(x, dim)
        self.seconds += time.perf_counter() - t
        return y


class RankWorker:
    """One tensor-parallel rank; the body of a Ray actor (``ray.remote(RankWorker)``)."""

    def __init__(self, rank: int, world_size: int, device: str) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.tp: TimedGroup | None = None
        self.worker: Any = None

    def where(self) -> tuple[str, str, int]:
        """(Ray node id, node IP, pid) of this actor."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def setup(self, rdv: Rendezvous, num_threads: int) -> None:
        """Threads, device, and the process group (one per engine, shared by target and draft)."""
        torch.set_num_threads(num_threads)
        if self.device == "cuda":
            torch.cuda.set_device(0)  # Ray exposes exactly this actor's GPU
        group = init_process_group(self.rank, rdv)
        self.tp = TimedGroup(rank=group.rank, size=group.size, group=group.group)

    def load(self, config: EngineConfig) -> None:
        """Build this rank's Worker: each model reads only its own slices of the checkpoint.
        The draft shares the group when sharded, and is a whole replica when its size is 1."""
        from specbatch.worker.worker import Worker

        assert self.tp is not None, "setup() first"
        sharded = config.speculative_config.draft_tensor_parallel_size > 1
        draft_tp: TensorParallelGroup = self.tp if sharded else SINGLE
        device = torch.device("cuda", 0) if self.device == "cuda" else torch.device(self.device)
        self.worker = Worker(config, device=device, tp=self.tp, draft_tp=draft_tp)

    def kv_info(self) -> tuple[int, int]:
        """(KV budget in bytes, bytes per block) on this rank."""
        return self.worker.kv_memory_budget(), self.worker.kv_bytes_per_block()

    def init_kv_cache(self, num_blocks: int) -> KvPrices | None:
        return self.worker.init_kv_cache(num_blocks)

    def execute(self, plan: SchedulerOutput) -> StepResult | None:
        """One engine step on this rank; rank 0 returns the result with its timings."""
        assert self.tp is not None
        c0, t0 = self.tp.seconds, time.perf_counter()
        result = self.worker.execute(plan)
        if self.rank != 0:
            return None
        result.timings["worker"] = time.perf_counter() - t0
        result.timings["collectives"] = self.tp.seconds - c0
        return result

    def shutdown(self) -> None:
        destroy_process_group()
