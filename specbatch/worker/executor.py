"""Executors: how the engine reaches its workers. One ``execute`` call per engine step."""

from __future__ import annotations

from typing import Protocol

from specbatch.config import EngineConfig
from specbatch.errors import InvalidInputError
from specbatch.scheduler.kv_prices import KvPrices
from specbatch.scheduler.output import SchedulerOutput, StepResult


class Executor(Protocol):
    def determine_num_kv_blocks(self) -> int: ...
    def init_kv_cache(self, num_blocks: int) -> KvPrices | None: ...
    def execute(self, plan: SchedulerOutput) -> StepResult: ...
    def shutdown(self) -> None: ...


def num_kv_blocks_from_budget(config: EngineConfig, budget_bytes: int, bytes_per_block: int) -> int:
    """Blocks that fit the budget; an explicit ``num_kv_blocks`` wins. Errors if one request of
    ``max_model_len`` tokens would not fit."""
    if config.num_kv_blocks is not None:
        blocks = config.num_kv_blocks
        source = f"num_kv_blocks={blocks}"
    else:
        blocks = budget_bytes // bytes_per_block
        source = f"a KV budget of {budget_bytes / 2**20:.1f} MiB ({bytes_per_block} bytes a block)"
    if blocks * config.block_size < config.max_model_len:
        raise InvalidInputError(
            f"KV cache too small: {source} gives {blocks} blocks x block_size "
            f"{config.block_size} = {blocks * config.block_size} token slots, fewer than "
            f"max_model_len={config.max_model_len}; raise kv_cache_memory / num_kv_blocks or "
            "lower max_model_len"
        )
    return blocks


class UniprocExecutor:
    """The worker lives in the engine's own process (tensor_parallel_size 1)."""

    def __init__(self, config: EngineConfig) -> None:
        from specbatch.worker.worker import Worker

        self.config = config
        self.worker = Worker(config)

    def determine_num_kv_blocks(self) -> int:
        return num_kv_blocks_from_budget(
            self.config, self.worker.kv_memory_budget(), self.worker.kv_bytes_per_block()
        )

    def init_kv_cache(self, num_blocks: int) -> KvPrices | None:
        return self.worker.init_kv_cache(num_blocks)

    def execute(self, plan: SchedulerOutput) -> StepResult:
        return self.worker.execute(plan)

    def shutdown(self) -> None:
        pass
