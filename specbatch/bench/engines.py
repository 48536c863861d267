"""The offline bench's engines: one per cell of a batch size (plain, each draft length, each
tree, auto), all up for the whole run and sharing the checkpoints' weights."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specbatch.bench.bench_config import BenchConfig
from specbatch.bench.drafts import PLAIN, Draft, is_tree, speculative_keys
from specbatch.config import EngineArgs
from specbatch.engine.data_parallel import DataParallelEngine, create_engine
from specbatch.engine.llm_engine import LLMEngine
from specbatch.errors import InvalidInputError


def drafter(cfg: BenchConfig) -> dict[str, Any]:
    """The grid's drafter as ``speculative_config`` keys (its drafts come from each cell)."""
    if cfg.speculative_config is not None:
        return dict(cfg.speculative_config)
    if cfg.draft_model is not None:
        return {"method": "draft_model", "model": cfg.draft_model}
    return {"method": "eagle"}  # the built-in target's own head


def build_engine(cfg: BenchConfig, draft: Draft, max_seqs: int) -> LLMEngine | DataParallelEngine:
    """The engine of one cell: plain for ``DraftShape()``, else the grid's drafter asked for
    ``draft`` through ``speculative_config``. An engine that rejects a tree (or auto's trees)
    says which cell asked for it."""
    model_len = cfg.shared_prefix_len + cfg.input_len + cfg.max_output_len + cfg.lookahead + 2
    kwargs: dict[str, Any] = {"max_model_len": model_len, **cfg.engine_kwargs}
    kwargs["max_num_seqs"] = max(max_seqs, int(kwargs.get("max_num_seqs") or 0))
    draft_tp = kwargs.pop("draft_tensor_parallel_size", None)
    if draft != PLAIN:
        spec = drafter(cfg) | speculative_keys(draft, cfg.auto_shape, cfg.tree_children)
        if draft_tp is not None:
            spec["draft_tensor_parallel_size"] = draft_tp
        kwargs["speculative_config"] = spec
    else:
        kwargs["num_speculative_tokens"] = 0
    try:
        return create_engine(EngineArgs(model=cfg.model, seed=cfg.seed, **kwargs))
    except InvalidInputError as e:
        if is_tree(draft):
            raise InvalidInputError(f"trees {draft}: {e}", "trees") from None
        if draft == "auto" and not cfg.auto_shape.is_chain:
            raise InvalidInputError(
                f"draft_lengths auto with trees up to {cfg.auto_shape}: {e}", "draft_lengths"
            ) from None
        raise


def share_weights(engines: Sequence[LLMEngine | DataParallelEngine]) -> None:
    """Point every in-process engine's target (and draft) at the first one's tensors: they are
    the same checkpoint, and side by side (cell_run.py) each engine's step would otherwise
    begin by reading its own copy back into the caches that the other engines' steps evicted,
    which one engine running alone never does. Engines whose workers live elsewhere (Ray)
    keep their own."""
    first: dict[str, torch.nn.Module] = {}
    for engine in engines:
        worker = getattr(getattr(engine, "executor", None), "worker", None)
        if worker is None:
            continue
        for role in ("target", "draft"):
            runner = getattr(worker, role)
            if runner is None:
                continue
            source = first.setdefault(role, runner.model)
            if source is runner.model:
                continue
            mine = dict(runner.model.named_parameters())
            for name, tensor in source.named_parameters():
                mine[name].data = tensor.data
            modules = dict(runner.model.named_modules())
            for name, module in source.named_modules():  # the CPU kernels' packed weights
                packed = getattr(module, "packed", None)
                own = getattr(modules[name], "packed", None)
                if packed is not None and own is not None:
                    own.panels.data = packed.panels.data
            for module in modules.values():  # plans hold the addresses of what was re-pointed
                plan = getattr(module, "cpu_plan", None)
                if plan is not None:
                    plan.refresh()
