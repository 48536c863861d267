"""The engine's arguments, each declared once (type, default, limits, help) and checked when the
arguments are made, and the frozen ``EngineConfig`` they resolve to: the checkpoints as
``model/model_pair.py`` read them, the draft length settled, the limits between arguments checked.

``LLM(...)``, the command line's engine flags and the server all take ``EngineArgs``; every error
is an ``InvalidInputError`` naming the argument and the limit.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specbatch.drafters import DrafterKind
from specbatch.errors import InvalidInputError
from specbatch.options import check_options, option
from specbatch.speculative_config import (
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    MAX_TREE_NODES,
    SHORTHANDS,
    SpeculativeConfig,
    normalise,
    shorthand,
)

if TYPE_CHECKING:
    from specbatch.model.checkpoint import ModelConfig

# fmt: off
_SIZE_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9,
               "T": 1e12, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
# fmt: on


def parse_memory_size(value: str | int, field_name: str = "kv_cache_memory") -> int:
    """``"2GiB"``, ``"512MB"``, ``"1.5G"`` or a number of bytes, as bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if m is None or m.group(2).upper() not in _SIZE_UNITS:
            raise InvalidInputError(
                f"{field_name}: cannot read {value!r} as a size (e.g. 2GiB, 512MiB, 1e9)",
                field_name,
            )
        n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])
    if n <= 0:
        raise InvalidInputError(f"{field_name} must be positive, got {value!r}", field_name)
    return n


@dataclass
class EngineArgs:
    """The engine's arguments, as ``LLM(...)``, the CLI and the server take them."""

    # fmt: off
    model: str | None = option(None, "target model: a Hugging Face checkpoint directory, a GGUF "
        "file or a folder holding one (default: the built-in pair, when installed)", type=Path,
        metavar="DIR")
    draft_model: str | None = shorthand("draft_model", "draft model (directory or GGUF file); "
        "must share the target's vocabulary; turns speculative decoding on")
    speculative_config: dict[str, Any] | str | None = option(None, "the drafter as vLLM's JSON, "
        """e.g. '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}' or """
        """'{"method": "draft_model", "model": "DIR", "num_speculative_tokens": "auto"}'; """
        "--draft-model and --num-speculative-tokens are shorthands for it", type=object,
        metavar="JSON")
    num_speculative_tokens: int | str | None = shorthand("num_speculative_tokens")
    max_draft_length: int = shorthand("max_draft_length")
    tokenizer: str | None = option(None, "tokenizer directory or GGUF file (default: the "
        "model's)", type=Path, metavar="DIR")
    dtype: str = option("auto", "weights and activations dtype; auto takes the checkpoint's (on "
        "a CPU: bfloat16 for 16-bit checkpoints where the CPU multiplies it natively, else "
        "float32)", choices=("auto", "float32", "bfloat16", "float16"))
    seed: int = option(0, "engine seed (see the command's help for how requests use it)", ge=0)
    device: str = option("auto", "where to run", choices=("auto", "cpu", "cuda"))
    block_size: int = option(16, "tokens per KV-cache block", ge=1)
    num_kv_blocks: int | None = option(None, "number of KV-cache blocks (overrides "
        "--kv-cache-memory)", type=int, ge=1)
    kv_cache_memory: str | int | None = option(None, "KV-cache budget, e.g. 2GiB, 512MiB or "
        "bytes (default on CPU: 1GiB; on GPU: from --gpu-memory-utilization)", type=object,
        metavar="SIZE")
    gpu_memory_utilization: float = option(0.9, "fraction of GPU memory the engine may use",
        gt=0, le=1, metavar="F")
    max_num_seqs: int = option(256, "most requests in one batch", ge=1)
    max_num_batched_tokens: int = option(2048, "most tokens in one step", ge=1)
    max_model_len: int | None = option(None, "most tokens (prompt + output) of one request "
        "(default: the models' context length)", type=int, ge=2)
    tensor_parallel_size: int = option(1, "target model shards (GPUs)", ge=1)
    data_parallel_size: int = option(1, "engine replicas, each a Ray actor with its own "
        "tensor-parallel group, spread over the Ray cluster's nodes; requests go to whichever "
        "has room (generate) or the least outstanding tokens (serve)", ge=1, metavar="N")
    draft_tensor_parallel_size: int = shorthand("draft_tensor_parallel_size")
    distributed_executor_backend: str | None = option(None, "uni (one process) or ray (default: "
        "ray when tensor-parallel)", type=str, choices=("uni", "ray"))
    ray_address: str | None = option(None, "join this Ray cluster (default: $RAY_ADDRESS, else "
        "a local one)", type=str, metavar="ADDR")
    attention_backend: str = option("auto", "auto, torch, cpu (specbatch's kernel), flash-attn "
        "(CUDA, block size a multiple of 256) or xformers (CUDA, multiple of 64); auto: on a "
        "CPU the kernel where it runs, on CUDA flash-attn, else xformers, as installed and as "
        "the block size allows; else torch", metavar="NAME")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of prompt prefixes seen "
        "before (the target's and the drafter's); --no-enable-prefix-caching computes every "
        "prompt whole")  # fmt: skip
    batch_invariant: bool = option(False, "every op gives a request's rows the same bits "
        "whatever else is in the batch, and draft lengths never depend on the batch: a seeded "
        "request returns the same tokens alone or in any batch, with or without speculation "
        "(CPU kernels only; not with auto)")
    logprobs_mode: str = option("raw_logprobs", "what logprobs report: raw_logprobs (the "
        "model's log-softmax, as vLLM) or processed_logprobs (after penalties, temperature and "
        "top-k/top-p/min-p)", choices=("raw_logprobs", "processed_logprobs"))
    # fmt: on
    speculative: SpeculativeConfig = dataclasses.field(init=False, repr=False, compare=False)
    kv_bytes: int | None = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_options(EngineArgs, self)
        mem = self.kv_cache_memory
        self.kv_bytes = None if mem is None else parse_memory_size(mem)
        self.speculative = normalise(
            self.speculative_config, **{k: getattr(self, k) for k in SHORTHANDS}
        )

    def create_engine_config(self) -> EngineConfig:
        from specbatch.model import model_pair

        device = model_pair.resolve_device(self.device)
        target = model_pair.read_target(
            self.model, self.tokenizer, self.dtype, device, self.batch_invariant
        )
        field = "draft_model" if self.speculative_config is None else "speculative_config.model"
        kind, path, draft = model_pair.read_drafter(
            self.speculative, target, self.model is None, field
        )
        spec = self._resolve(kind, path, draft is not None)
        limit = target.context_length
        if draft is not None and draft.context_length:
            limit = min(limit, draft.context_length) if limit else draft.context_length
        max_model_len = self.max_model_len or limit
        if limit and max_model_len > limit:
            raise InvalidInputError(
                f"max_model_len={max_model_len} exceeds the models' context length {limit}",
                "max_model_len",
            )
        batched = self.max_num_batched_tokens
        room = max(spec.depth, spec.shape.lookahead) + 1
        if batched < room:
            raise InvalidInputError(
                f"max_num_batched_tokens must be an integer >= {room}, got {batched}",
                "max_num_batched_tokens",
            )
        tp, draft_tp = self.tensor_parallel_size, spec.draft_tensor_parallel_size
        if draft_tp not in (1, tp):
            raise InvalidInputError(
                f"draft_tensor_parallel_size must be 1 (replicated) or {tp}, got {draft_tp}",
                "draft_tensor_parallel_size",
            )
        model_pair.check_split(target, draft, tp, draft_tp)
        backend = self.distributed_executor_backend or ("ray" if tp > 1 else "uni")
        if backend == "uni" and tp > 1:
            raise InvalidInputError(
                "tensor_parallel_size > 1 needs distributed_executor_backend='ray'",
                "tensor_parallel_size",
            )
        if self.batch_invariant:
            self._check_batch_invariant(device, spec)
        resolved = {
            "target": target,
            "draft": draft,
            "speculative_config": spec,
            "device": device,
            "kv_cache_memory": self.kv_bytes,
            "max_model_len": max_model_len,
            "distributed_executor_backend": backend,
            "ray_address": self.ray_address or os.environ.get("RAY_ADDRESS"),
        }
        given = {f.name for f in dataclasses.fields(EngineConfig)} - set(resolved)
        return EngineConfig(**resolved, **{name: getattr(self, name) for name in given})

    def _resolve(self, kind: DrafterKind, path: str | None, has_draft: bool) -> SpeculativeConfig:
        """The speculative config as the engine runs it: the default draft length, no method
        without one."""
        spec = self.speculative
        k = spec.num_speculative_tokens
        if k is None and (has_draft or not kind.needs_model):
            # by default the controller decides (it drafts only where drafting pays); batch
            # invariance needs draft lengths that do not depend on the batch
            k = DEFAULT_NUM_SPECULATIVE_TOKENS if self.batch_invariant else "auto"
        k = 0 if k is None else k
        depth = spec.max_draft_length if k == "auto" else k
        if spec.topk > 1 and spec.topk * (depth - 1) > MAX_TREE_NODES + 1:
            raise InvalidInputError(
                f"speculative_config.topk x (num_speculative_tokens - 1) must be at most "
                f"{MAX_TREE_NODES + 1} (the nodes a tree's drafter expands), got {spec.topk} x "
                f"{depth - 1}",
                "speculative_config.topk",
            )
        if depth > 0 and not has_draft and kind.needs_model:
            raise InvalidInputError(
                f"num_speculative_tokens={depth} needs a draft model (draft_model is not set)",
                "num_speculative_tokens",
            )
        method, k = (kind.method, k) if depth > 0 else (None, 0)
        return dataclasses.replace(spec, method=method, model=path, num_speculative_tokens=k)

    def _check_batch_invariant(self, device: str, spec: SpeculativeConfig) -> None:
        """batch_invariant needs every op of a step to sum in an order that does not depend on
        the batch: specbatch's CPU kernels (matrix multiplies, attention, norms; the loader
        refuses to place a model without them), and draft lengths that do not depend on it."""
        for broken, why in (
            (device != "cpu", f"runs on a CPU (specbatch's kernels), not on device '{device}'"),
            (spec.auto, "needs a fixed num_speculative_tokens: 'auto' "
             "chooses draft lengths from the batch"),
            (self.attention_backend not in ("auto", "cpu"), "needs attention_backend 'cpu' (or "
             f"'auto'), got '{self.attention_backend}'"),
            (self.dtype == "float16", "needs dtype float32 or bfloat16 (the kernels' matrix "
             "multiplies), got float16"),
        ):  # fmt: skip
            if broken:
                raise InvalidInputError(f"batch_invariant {why}", "batch_invariant")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, checked and resolved."""

    target: ModelConfig
    draft: ModelConfig | None
    # resolved: its method None and its num_speculative_tokens 0 when not speculating
    speculative_config: SpeculativeConfig
    device: str
    seed: int
    block_size: int
    num_kv_blocks: int | None
    kv_cache_memory: int | None  # bytes
    gpu_memory_utilization: float
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    tensor_parallel_size: int
    data_parallel_size: int  # engine replicas, each a Ray actor (engine/data_parallel.py)
    distributed_executor_backend: str
    ray_address: str | None
    attention_backend: str
    batch_invariant: bool
    logprobs_mode: str
    enable_prefix_caching: bool
