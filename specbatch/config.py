"""Engine configuration: the user's arguments, checked once, turned into frozen configs.

Every limit the engine enforces on its configuration lives here, and every violation is an
``InvalidInputError`` that names the argument and the limit.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specbatch.draft_shape import DraftShape
from specbatch.errors import InvalidInputError
from specbatch.speculative_config import (
    DEFAULT_PROMPT_LOOKUP_MAX,
    DEFAULT_PROMPT_LOOKUP_MIN,
    SpeculativeArgs,
    parse_speculative_config,
)

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30  # 1 GiB when no budget is given on CPU
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_NUM_SPECULATIVE_TOKENS = 3  # with batch_invariant, when no draft length is given
DEFAULT_MAX_DRAFT_LENGTH = 4  # the cap of num_speculative_tokens="auto"
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "K": 1e3,
    "KB": 1e3,
    "M": 1e6,
    "MB": 1e6,
    "G": 1e9,
    "GB": 1e9,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
    "T": 1e12,
}


def parse_memory_size(value: str | int, field_name: str = "kv_cache_memory") -> int:
    """``"2GiB"``, ``"512MB"``, ``"1.5G"`` or a number of bytes, as bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _SIZE_UNITS:
            raise InvalidInputError(
                f"{field_name}: cannot read {value!r} as a size (e.g. 2GiB, 512MiB, 1e9)"
            )
        n = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if n <= 0:
        raise InvalidInputError(f"{field_name} must be positive, got {value!r}")
    return n


def resolve_device(device: str) -> str:
    if device not in DEVICES:
        raise InvalidInputError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError("device: 'cuda' was asked for but no CUDA device is available")
    return device


def resolve_dtype(dtype: str, hf_config: Any, device: str) -> Any:
    """``auto`` takes the checkpoint's dtype. On a CPU, 16-bit weights run in bfloat16 where
    specbatch's kernels run (half float32's weight traffic; AVX512-BF16 dot products or AMX
    where the CPU has them, FMA pairs on AVX2), else in float32 (torch's own bfloat16 matrix
    multiplies are slow on CPUs without them); float32 weights stay float32."""
    import torch

    if dtype not in DTYPES:
        raise InvalidInputError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype != "auto":
        return getattr(torch, dtype)
    stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    if not isinstance(stored, torch.dtype) or stored not in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
    ):
        stored = torch.float32
    if device == "cpu":
        if stored == torch.float32:
            return stored
        from specbatch.kernels.cpu import cpu_kernels

        kernels = cpu_kernels()
        return torch.bfloat16 if kernels is not None else torch.float32
    return stored


@dataclass(frozen=True)
class ModelConfig:
    path: str
    hf_config: Any = field(repr=False)
    dtype: Any
    tokenizer_path: str | None  # None: the checkpoint has no tokenizer, token-id prompts only
    field: str = "model"  # the argument that named it, for errors found while loading

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def context_length(self) -> int:
        n = int(getattr(self.hf_config, "max_position_embeddings", 0) or 0)
        window = _sliding_window(self.hf_config)
        if window:
            n = min(n, window) if n else window
        return n


def _sliding_window(hf_config: Any) -> int | None:
    window = getattr(hf_config, "sliding_window", None)
    if getattr(hf_config, "use_sliding_window", True) is False:
        return None
    return int(window) if window else None


def _has_tokenizer(path: str) -> bool:
    p = Path(path)
    return any(
        (p / name).exists()
        for name in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    )


def _check_positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidInputError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, checked and resolved."""

    target: ModelConfig
    draft: ModelConfig | None
    num_speculative_tokens: int
    device: str
    seed: int
    block_size: int
    num_kv_blocks: int | None
    kv_cache_memory: int | None
    gpu_memory_utilization: float
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    tensor_parallel_size: int
    draft_tensor_parallel_size: int
    distributed_executor_backend: str
    ray_address: str | None
    attention_backend: str
    # num_speculative_tokens="auto": gamma chosen per request and step, up to
    # num_speculative_tokens (then the max draft length)
    adaptive_speculation: bool = False
    spec_method: str = "draft_model"  # who proposes: "draft_model" or "ngram"
    batch_invariant: bool = False
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN
    logprobs_mode: str = "raw_logprobs"
    draft_topk: int = 1  # children per expanded node: 1 drafts chains
    num_draft_tokens: int = 0  # nodes of a tree (a chain: num_speculative_tokens)
    tree_children: str = "sampled"  # a tree's children drawn from q, or its top draft_topk
    enable_prefix_caching: bool = True

    @property
    def draft_shape(self) -> DraftShape:
        """What each decoding request drafts, unless ``auto`` chooses."""
        k = self.num_speculative_tokens if self.speculative else 0
        if self.draft_topk == 1 or k == 0:
            return DraftShape.chain(k)
        nodes = self.num_draft_tokens or min(63, self.draft_topk * k)
        return DraftShape(k, self.draft_topk, nodes)

    @property
    def speculative(self) -> bool:
        if self.num_speculative_tokens <= 0:
            return False
        return self.draft is not None or self.spec_method == "ngram"


@dataclass
class EngineArgs:
    """The engine's arguments, as ``LLM(...)``, the CLI and the server take them."""

    model: str | None = None
    draft_model: str | None = None
    num_speculative_tokens: int | str | None = None  # or "auto" (see max_draft_length)
    max_draft_length: int = DEFAULT_MAX_DRAFT_LENGTH
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: str | int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    draft_tensor_parallel_size: int | None = None
    distributed_executor_backend: str | None = None
    ray_address: str | None = None
    attention_backend: str = "auto"
    speculative_config: dict[str, Any] | str | None = None
    batch_invariant: bool = False
    logprobs_mode: str = "raw_logprobs"  # or "processed_logprobs"
    enable_prefix_caching: bool = True

    def _speculative_args(self) -> SpeculativeArgs:
        """``speculative_config`` checked, or the shorthand flags as one."""
        if self.speculative_config is None:
            return SpeculativeArgs(
                "draft_model",
                self.draft_model,
                self.num_speculative_tokens,
                draft_tensor_parallel_size=self.draft_tensor_parallel_size,
                max_draft_length=self.max_draft_length,
            )
        shorthands = [
            name
            for name in ("draft_model", "num_speculative_tokens", "draft_tensor_parallel_size")
            if getattr(self, name) is not None
        ]
        if shorthands:
            raise InvalidInputError(
                f"speculative_config and {', '.join(shorthands)} were both given: use one "
                "(the flags are shorthands for speculative_config's fields)"
            )
        return parse_speculative_config(self.speculative_config)

    def create_engine_config(self) -> EngineConfig:
        device = resolve_device(self.device)
        _check_positive_int("seed", self.seed, minimum=0)
        _check_positive_int("block_size", self.block_size)
        _check_positive_int("max_num_seqs", self.max_num_seqs)
        _check_positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.num_kv_blocks is not None:
            _check_positive_int("num_kv_blocks", self.num_kv_blocks)
        kv_bytes = (
            parse_memory_size(self.kv_cache_memory) if self.kv_cache_memory is not None else None
        )
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise InvalidInputError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )

        spec = self._speculative_args()
        model_path = self.model or default_model_path("target")
        target = self._model_config(model_path, "model", self.tokenizer, device, self.dtype)
        draft = None
        k = spec.num_speculative_tokens
        adaptive = k == "auto"
        if adaptive:
            max_draft = spec.max_draft_length or self.max_draft_length
            _check_positive_int("max_draft_length", max_draft)
            k = max_draft
        elif isinstance(k, str):
            raise InvalidInputError(
                f"num_speculative_tokens must be an integer >= 0 or 'auto', got {k!r}"
            )
        ngram = spec.method == "ngram"
        method = spec.method
        drafter_path = spec.model
        if drafter_path is None and not ngram and k != 0 and self.model is None:
            # The built-in target speculates by default, with its EAGLE head (its draft model
            # when speculative_config asks for that method); any other target only with a
            # drafter given. Either EAGLE method name picks the built-in head.
            if method == "draft_model" and self.speculative_config is not None:
                drafter_path = default_model_path("draft")
            else:
                from specbatch.model.eagle import detect_layout

                drafter_path = default_model_path("eagle")
                method = detect_layout(drafter_path)
        elif drafter_path is None and not ngram and self.speculative_config is not None:
            raise InvalidInputError(
                f"speculative_config.model: the {method} method needs a model (only the "
                "built-in target has its own)"
            )
        eagle = method in ("eagle", "eagle3")
        if eagle:
            assert drafter_path is not None
            draft = eagle_head_config(drafter_path, method, target, device, self.dtype)
        elif drafter_path is not None:
            draft = self._model_config(drafter_path, "draft_model", None, device, self.dtype)
            check_same_vocabulary(target, draft)
        if k is None and (draft is not None or ngram):
            # by default the controller decides (it drafts only where drafting pays); batch
            # invariance needs draft lengths that do not depend on the batch
            if self.batch_invariant:
                k = DEFAULT_NUM_SPECULATIVE_TOKENS
            else:
                adaptive = True
                k = spec.max_draft_length or self.max_draft_length
                _check_positive_int("max_draft_length", k)
        k = 0 if k is None else k
        _check_positive_int("num_speculative_tokens", k, minimum=0)
        if k > 0 and draft is None and not ngram:
            raise InvalidInputError(
                f"num_speculative_tokens={k} needs a draft model (draft_model is not set)"
            )

        limit = target.context_length
        if draft is not None and draft.context_length:
            limit = min(limit, draft.context_length) if limit else draft.context_length
        max_model_len = self.max_model_len if self.max_model_len is not None else limit
        _check_positive_int("max_model_len", max_model_len, minimum=2)
        if limit and max_model_len > limit:
            raise InvalidInputError(
                f"max_model_len={max_model_len} exceeds the models' context length {limit}"
            )
        if spec.topk > 1 and k and spec.topk * (k - 1) > 64:
            raise InvalidInputError(
                f"speculative_config.topk x (num_speculative_tokens - 1) must be at most 64 (the "
                f"nodes a tree's drafter expands), got {spec.topk} x {k - 1}"
            )
        lookahead = max(k, spec.num_draft_tokens or 0, spec.topk * (k - 1))
        batched = self.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        _check_positive_int("max_num_batched_tokens", batched, minimum=lookahead + 1)

        tp = self.tensor_parallel_size
        check_tensor_parallel(target, tp, "model")
        draft_tp = spec.draft_tensor_parallel_size
        if draft_tp is None:
            draft_tp = 1
        if draft_tp not in (1, tp):
            raise InvalidInputError(
                f"draft_tensor_parallel_size must be 1 (replicated) or {tp}, got {draft_tp}"
            )
        if eagle and draft_tp != 1:
            raise InvalidInputError(
                "draft_tensor_parallel_size: an EAGLE head runs replicated on every rank (1)"
            )
        if draft is not None and not eagle:
            check_tensor_parallel(draft, draft_tp, "draft_model")
        backend = self.distributed_executor_backend or ("ray" if tp > 1 else "uni")
        if backend not in ("uni", "ray"):
            raise InvalidInputError(
                f"distributed_executor_backend must be 'uni' or 'ray', got {backend!r}"
            )
        if backend == "uni" and tp > 1:
            raise InvalidInputError(
                "tensor_parallel_size > 1 needs distributed_executor_backend='ray'"
            )
        if self.kv_cache_memory is None and self.num_kv_blocks is None and device == "cpu":
            kv_bytes = DEFAULT_CPU_KV_CACHE_MEMORY
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise InvalidInputError(
                "logprobs_mode must be 'raw_logprobs' or 'processed_logprobs', got "
                f"{self.logprobs_mode!r}"
            )
        if self.batch_invariant:
            check_batch_invariant(device, target, draft, adaptive, self.attention_backend)
        return EngineConfig(
            target=target,
            draft=draft,
            num_speculative_tokens=k,
            device=device,
            seed=self.seed,
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory=kv_bytes,
            gpu_memory_utilization=float(self.gpu_memory_utilization),
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=batched,
            max_model_len=max_model_len,
            tensor_parallel_size=tp,
            draft_tensor_parallel_size=draft_tp,
            distributed_executor_backend=backend,
            ray_address=self.ray_address or os.environ.get("RAY_ADDRESS"),
            attention_backend=self.attention_backend,
            adaptive_speculation=adaptive and k > 0,
            spec_method="eagle" if eagle else spec.method,
            prompt_lookup_max=spec.prompt_lookup_max,
            prompt_lookup_min=spec.prompt_lookup_min,
            batch_invariant=bool(self.batch_invariant),
            logprobs_mode=self.logprobs_mode,
            draft_topk=spec.topk,
            num_draft_tokens=spec.num_draft_tokens or 0,
            tree_children=spec.tree_children,
            enable_prefix_caching=bool(self.enable_prefix_caching),
        )

    @staticmethod
    def _model_config(
        path: str, field_name: str, tokenizer: str | None, device: str, dtype: str
    ) -> ModelConfig:
        from specbatch.model.checkpoint_files import check_checkpoint_files, checkpoint_files
        from specbatch.model.gguf_checkpoint import gguf_model
        from specbatch.model.loader import check_config, load_hf_config

        try:
            gguf = gguf_model(path)  # (file, config, its tokenizer); None: not a GGUF checkpoint
            if gguf is not None:
                path, hf_config, own_tokenizer = gguf
            else:
                hf_config = load_hf_config(path)
                own_tokenizer = path if _has_tokenizer(path) else None
            check_config(hf_config)
            if gguf is None:
                check_checkpoint_files(checkpoint_files(path))
        except InvalidInputError as e:
            msg = str(e)
            if msg.startswith("model") and field_name != "model":
                msg = field_name + msg[len("model") :]
            raise InvalidInputError(msg) from None
        tok = tokenizer or own_tokenizer
        dt = resolve_dtype(dtype, hf_config, device)
        return ModelConfig(str(path), hf_config, dt, tok, field_name)


def eagle_head_config(
    path: str, method: str, target: ModelConfig, device: str, dtype: str
) -> ModelConfig:
    """An EAGLE head's checkpoint, checked against its method and its target."""
    from specbatch.model.eagle import detect_layout
    from specbatch.model.loader import load_hf_config

    try:
        hf_config = load_hf_config(path, architecture=False)
    except InvalidInputError as e:
        raise InvalidInputError(f"speculative_config.{e!s}") from None
    layout = detect_layout(path)
    if (method == "eagle3") != (layout == "eagle3"):
        raise InvalidInputError(
            f"speculative_config.method: '{path}' holds an {layout.upper()} head; use method "
            f"'{layout}'"
        )
    if int(getattr(hf_config, "vocab_size", target.vocab_size)) != target.vocab_size:
        raise InvalidInputError(
            f"speculative_config.model: vocab_size {hf_config.vocab_size} differs from the "
            f"target's {target.vocab_size}"
        )
    return ModelConfig(str(path), hf_config, resolve_dtype(dtype, target.hf_config, device), None)


def check_batch_invariant(
    device: str, target: ModelConfig, draft: ModelConfig | None, adaptive: bool, backend: str
) -> None:
    """batch_invariant needs every op of a step to sum in an order that does not depend on the
    batch: specbatch's CPU kernels (matrix multiplies, attention, norms), and draft lengths that
    do not depend on the batch."""
    if device != "cpu":
        raise InvalidInputError(
            f"batch_invariant runs on a CPU (specbatch's kernels), not on device '{device}'"
        )
    if adaptive:
        raise InvalidInputError(
            "batch_invariant needs a fixed num_speculative_tokens: 'auto' chooses draft lengths "
            "from the batch"
        )
    if backend not in ("auto", "cpu"):
        raise InvalidInputError(
            f"batch_invariant needs attention_backend 'cpu' (or 'auto'), got '{backend}'"
        )
    from specbatch.kernels.cpu import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        raise InvalidInputError(
            "batch_invariant needs specbatch's CPU kernels, which are not available here "
            "(see the warning above; SPECBATCH_CPU_KERNELS=0 turns them off)"
        )
    for model, name in ((target, "model"), (draft, "draft_model")):
        if model is not None and not kernels.supports_linear(model.dtype):
            raise InvalidInputError(
                f"batch_invariant: {name}'s dtype {model.dtype} has no kernel matrix multiply "
                "(float32 or bfloat16)"
            )


def check_same_vocabulary(target: ModelConfig, draft: ModelConfig) -> None:
    """The draft must propose ids that mean the same tokens to the target."""
    if target.vocab_size != draft.vocab_size:
        raise InvalidInputError(
            f"draft_model: vocab_size {draft.vocab_size} differs from the target's "
            f"{target.vocab_size}; the draft must share the target's vocabulary"
        )
    if target.tokenizer_path and draft.tokenizer_path:
        from specbatch.tokenizer import load_tokenizer

        a = load_tokenizer(target.tokenizer_path).get_vocab()
        b = load_tokenizer(draft.tokenizer_path).get_vocab()
        if a != b:
            differ = sorted(set(a.items()) ^ set(b.items()))[:3]
            raise InvalidInputError(
                "draft_model: its tokenizer maps tokens to ids differently from the target's "
                f"(e.g. {differ}); the draft must share the target's vocabulary"
            )


def check_tensor_parallel(model: ModelConfig, tp: int, field_name: str) -> None:
    cfg = model.hf_config
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    sizes = {
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": int(cfg.intermediate_size),
        "vocab_size": int(cfg.vocab_size),
    }
    for name, value in sizes.items():
        if value % tp:
            raise InvalidInputError(
                f"tensor_parallel_size={tp} does not divide {field_name}'s {name}={value}"
            )


def default_model_path(which: str) -> str:
    """The built-in models shipped inside the package: 'target', 'draft' or 'eagle'."""
    path = Path(__file__).parent / "assets" / "default_pair" / which
    if not (path / "config.json").exists():
        raise InvalidInputError(
            "model: no model was given and the built-in model pair is not installed "
            f"(looked in {path}); pass --model DIR"
        )
    return str(path)
