"""The engine's arguments, each declared once (type, default, limits, help) and checked when the
arguments are made, and the frozen ``EngineConfig`` they resolve to: the checkpoints as
``model/model_pair.py`` read them, the draft length settled, the limits between arguments checked.
Every error is an ``InvalidInputError`` naming the argument and the limit.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specbatch.drafters import DrafterKind
from specbatch.errors import invalid
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

_SIZE_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9,
               "T": 1e12, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30,
               "TIB": 1 << 40}  # fmt: skip


def parse_memory_size(value: str | int, field_name: str = "kv_cache_memory") -> int:
    """``"2GiB"``, ``"512MB"``, ``"1.5G"`` or a number of bytes, as bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if m is None or m.group(2).upper() not in _SIZE_UNITS:
            why = f": cannot read {value!r} as a size (e.g. 2GiB, 512MiB, 1e9)"
            raise invalid(field_name, why)
        n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])
    if n <= 0:
        raise invalid(field_name, f" must be positive, got {value!r}")
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
        known = [m.context_length for m in (target, draft) if m is not None and m.context_length]
        limit = min(known, default=0)  # the models' shortest context (0: none known)
        max_model_len, batched = self.max_model_len or limit, self.max_num_batched_tokens
        room = max(spec.depth, spec.shape.lookahead) + 1
        tp, draft_tp = self.tensor_parallel_size, spec.draft_tensor_parallel_size
        backend = self.distributed_executor_backend or ("ray" if tp > 1 else "uni")
        invariant, attention = self.batch_invariant, self.attention_backend
        # the limits between arguments; batch_invariant needs every op of a step to sum in an
        # order that does not depend on the batch: specbatch's CPU kernels (the loader refuses
        # to place a model without them), and draft lengths that do not depend on it either
        for broken, name, why in (
            (limit and max_model_len > limit, "max_model_len",
             f"={max_model_len} exceeds the models' context length {limit}"),
            (batched < room, "max_num_batched_tokens",
             f" must be an integer >= {room}, got {batched}"),
            (draft_tp not in (1, tp), "draft_tensor_parallel_size",
             f" must be 1 (replicated) or {tp}, got {draft_tp}"),
            (backend == "uni" and tp > 1, "tensor_parallel_size",
             " > 1 needs distributed_executor_backend='ray'"),
            (invariant and device != "cpu", "batch_invariant",
             f" runs on a CPU (specbatch's kernels), not on device '{device}'"),
            (invariant and spec.auto, "batch_invariant",
             " needs a fixed num_speculative_tokens: 'auto' chooses draft lengths from the batch"),
            (invariant and attention not in ("auto", "cpu"), "batch_invariant",
             f" needs attention_backend 'cpu' (or 'auto'), got '{attention}'"),
            (invariant and self.dtype == "float16", "batch_invariant",
             " needs dtype float32 or bfloat16 (the kernels' matrix multiplies), got float16"),
        ):  # fmt: skip
            if broken:
                raise invalid(name, why)
        model_pair.check_split(target, draft, tp, draft_tp)
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
        k = self.speculative.num_speculative_tokens
        if k is None and (has_draft or not kind.needs_model):
            # by default the controller decides (it drafts only where drafting pays); batch
            # invariance needs draft lengths that do not depend on the batch
            k = DEFAULT_NUM_SPECULATIVE_TOKENS if self.batch_invariant else "auto"
        spec = dataclasses.replace(
            self.speculative, method=kind.method, model=path, num_speculative_tokens=k or 0
        )
        if spec.topk > 1 and spec.topk * (spec.depth - 1) > MAX_TREE_NODES + 1:
            raise invalid("speculative_config.topk", " x (num_speculative_tokens - 1) must be at "
                          f"most {MAX_TREE_NODES + 1} (the nodes a tree's drafter expands), got "
                          f"{spec.topk} x {spec.depth - 1}")  # fmt: skip
        if spec.speculative and not has_draft and kind.needs_model:
            why = f"={spec.depth} needs a draft model (draft_model is not set)"
            raise invalid("num_speculative_tokens", why)
        return spec if spec.speculative else dataclasses.replace(spec, method=None)


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
