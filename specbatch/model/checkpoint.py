"""A model's checkpoint, read and checked once where the engine is configured, then handed to
the loader as it was read: a Hugging Face directory or a GGUF file, its transformers config, its
tokenizer, its safetensors files, an EAGLE head's layout.

Errors found in a checkpoint name the argument that named it (``model``, ``draft_model``,
``speculative_config.model``). The dtype that ``auto`` stands for is settled where the model is
placed: on a CPU it depends on whether specbatch's kernels build there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from specbatch.errors import InvalidInputError
from specbatch.model.checkpoint_files import check_checkpoint_files, checkpoint_files
from specbatch.model.config_fields import check_config_fields, read_config_json
from specbatch.model.gemma import (
    GEMMA_ARCHITECTURES,
    check_gemma_activation,
    check_gemma_config,
    gemma_architecture,
)
from specbatch.model.gguf_checkpoint import find_gguf_file, has_tokenizer, open_gguf
from specbatch.model.gguf_config import gguf_hf_config
from specbatch.model.gguf_tensors import check_tensor_types
from specbatch.model.layers.rotary import compute_inv_freq
from specbatch.model.llama import SUPPORTED_ARCHITECTURES as LLAMA_ARCHITECTURES
from specbatch.model.llama import architecture_of, head_dim_of, sliding_window_of
from specbatch.model.llama import check_architecture as check_llama_architecture
from specbatch.model.moe import (
    MOE_ARCHITECTURES,
    moe_architecture,
    moe_settings,
    moe_sliding_window,
)
from specbatch.model.phi3 import PHI3_ARCHITECTURES, check_phi3_config, phi3_architecture

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass(frozen=True)
class ModelConfig:
    path: str  # a checkpoint directory, or a GGUF file
    hf_config: Any = dataclasses.field(repr=False)
    tokenizer_path: str | None  # None: the checkpoint has no tokenizer, token-id prompts only
    field: str = "model"  # the argument that named it
    files: tuple[str, ...] = ()  # its safetensors files, each checked whole; () for GGUF
    layout: str | None = None  # an EAGLE head's: "eagle" or "eagle3"
    dtype_name: str = "auto"  # as asked for: "auto" takes the checkpoint's (resolve_dtype)
    device: str = "cpu"
    kernels_required: bool = False  # batch_invariant: it may run only on specbatch's kernels
    # the config whose stored dtype "auto" takes (an EAGLE head: its target's)
    dtype_of: Any = dataclasses.field(default=None, repr=False)

    @cached_property
    def dtype(self) -> Any:
        """The torch dtype it runs in (read where the model is placed)."""
        return resolve_dtype(self.dtype_name, self.dtype_of or self.hf_config, self.device)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def context_length(self) -> int:
        n = int(getattr(self.hf_config, "max_position_embeddings", 0) or 0)
        # Gemma's sliding layers are windowed; a Llama-family window caps the context
        if gemma_architecture(self.hf_config):
            window = None
        elif moe_architecture(self.hf_config):
            window = moe_sliding_window(self.hf_config)
        else:
            window = sliding_window_of(self.hf_config)
        return (min(n, window) if n else window) if window else n


def read_checkpoint(
    path: str | Path,
    field: str = "model",
    tokenizer: str | None = None,
    dtype_name: str = "auto",
    device: str = "cpu",
) -> ModelConfig:
    """The checkpoint at ``path`` (a Hugging Face directory, a GGUF file or a folder holding
    one), its config and files checked."""
    try:
        gguf = find_gguf_file(path)
        if gguf is not None:
            reader = open_gguf(gguf)
            check_tensor_types(reader)
            hf_config, files = gguf_hf_config(reader, gguf), ()
            own_tokenizer = str(gguf) if has_tokenizer(reader) else None
            path = gguf
        else:
            hf_config = load_hf_config(path)
            files = tuple(map(str, checkpoint_files(path)))
            has_own = any((Path(path) / name).exists() for name in TOKENIZER_FILES)
            own_tokenizer = str(path) if has_own else None
        check_config(hf_config)
        if files:
            check_checkpoint_files([Path(f) for f in files])
    except InvalidInputError as e:
        raise at(field, e) from None
    tokenizer = tokenizer or own_tokenizer
    return ModelConfig(str(path), hf_config, tokenizer, field, files, None, dtype_name, device)


def load_hf_config(path: str | Path, architecture: bool = True) -> Any:
    """Check that ``path`` is a checkpoint directory and return its transformers config
    (``architecture=False``: a draft head's, whose architecture is not a causal LM's)."""
    p = Path(path)
    if not p.exists():
        raise InvalidInputError(f"path '{path}' does not exist")
    if not p.is_dir() or not (p / "config.json").is_file():
        raise InvalidInputError(
            f"'{path}' is not a Hugging Face checkpoint directory (no config.json)"
        )
    raw = read_config_json(p / "config.json")
    if architecture:  # first: another architecture has other fields
        check_architecture(SimpleNamespace(**raw))
    check_config_fields(raw, p / "config.json")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # transformers raises many kinds; the user needs the file and cause
        raise InvalidInputError(f"cannot read '{p / 'config.json'}': {e}") from None


def check_architecture(hf_config: Any) -> str:
    """The config's architecture, if specbatch implements it (and its activation)."""
    gemma = gemma_architecture(hf_config)
    if gemma is not None:
        check_gemma_activation(hf_config)
        return gemma
    family = phi3_architecture(hf_config) or moe_architecture(hf_config)
    if family is not None:  # their activations are checked with the rest of their configs
        return family
    arch = architecture_of(hf_config)
    if arch in LLAMA_ARCHITECTURES:
        return check_llama_architecture(hf_config)
    hint = ""
    if arch.endswith("ForConditionalGeneration"):
        hint = " (a multimodal model: only text models run; load its text-only causal LM)"
    raise InvalidInputError(
        f"architecture '{arch}' is not supported{hint}; supported: "
        + ", ".join(
            (*LLAMA_ARCHITECTURES, *GEMMA_ARCHITECTURES, *PHI3_ARCHITECTURES, *MOE_ARCHITECTURES)
        )
    )


def check_config(hf_config: Any) -> None:
    """Architecture, activation and rope type, before any loading."""
    check_architecture(hf_config)
    if gemma_architecture(hf_config) is not None:
        check_gemma_config(hf_config)
        return
    if phi3_architecture(hf_config) is not None:
        check_phi3_config(hf_config)
        return
    if moe_architecture(hf_config) is not None:
        moe_settings(hf_config)
    compute_inv_freq(hf_config, head_dim_of(hf_config))  # raises for unsupported rope types


def at(field: str, e: InvalidInputError) -> InvalidInputError:
    """An error found in the checkpoint that ``field`` named, as that argument's."""
    if e.field is not None:
        return e
    return InvalidInputError(f"{field}: {e}", field)


# a mixture of experts' other intermediate sizes, split across ranks as the dense one
_EXPERT_SIZES = ("moe_intermediate_size", "shared_expert_intermediate_size")


def check_tensor_parallel(hf_config: Any, tp: int, field: str = "model") -> None:
    """Every dimension tensor parallelism splits evenly must divide by ``tp`` (the vocabulary's
    last shard is padded)."""
    heads = int(hf_config.num_attention_heads)
    for name, value in (
        ("num_attention_heads", heads),
        ("num_key_value_heads", int(getattr(hf_config, "num_key_value_heads", None) or heads)),
        ("intermediate_size", int(hf_config.intermediate_size)),
        *(
            (name, int(getattr(hf_config, name)))
            for name in _EXPERT_SIZES
            if getattr(hf_config, name, None)
        ),
    ):
        if value % tp:
            raise InvalidInputError(
                f"tensor_parallel_size={tp} does not divide {field}'s {name}={value} (each of "
                f"the tensor_parallel_size={tp} shards must get an equal part)",
                "tensor_parallel_size",
            )


def resolve_dtype(dtype: str, hf_config: Any, device: str) -> Any:
    """``auto`` takes the checkpoint's dtype. On a CPU, 16-bit weights run in bfloat16 where
    specbatch's kernels run (half float32's weight traffic; AVX512-BF16 dot products or AMX
    where the CPU has them, FMA pairs on AVX2), else in float32 (torch's own bfloat16 matrix
    multiplies are slow on CPUs without them); float32 weights stay float32."""
    import torch

    if dtype != "auto":
        return getattr(torch, dtype)
    stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    if stored not in (torch.float16, torch.bfloat16) or device != "cpu":
        return stored if stored in (torch.float16, torch.bfloat16) else torch.float32
    from specbatch.kernels.cpu import cpu_kernels

    return torch.bfloat16 if cpu_kernels() is not None else torch.float32
