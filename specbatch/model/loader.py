"""Load a Hugging Face checkpoint directory into a (tensor-parallel shard of a) model.

Every check that can fail on user input runs before any weight is read. Weights are sharded as
they load: each parameter's ``weight_loader`` reads only this rank's rows or columns from the
safetensors file (``get_slice``), so no rank ever holds the whole model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors import safe_open

from specbatch.distributed.parallel_state import SINGLE, TensorParallelGroup
from specbatch.errors import InvalidInputError
from specbatch.model.checkpoint_files import check_checkpoint_files, checkpoint_files
from specbatch.model.config_fields import check_config_fields, read_config_json
from specbatch.model.gguf_checkpoint import find_gguf_file, gguf_weights
from specbatch.model.layers.attention import AttentionBackend
from specbatch.model.layers.rotary import compute_inv_freq
from specbatch.model.layers.weights import Loaded, get_weight_loader
from specbatch.model.llama import (
    LlamaForCausalLM,
    check_architecture,
    head_dim_of,
    num_kv_heads_of,
)

logger = logging.getLogger(__name__)

# Checkpoint tensors that are not weights (old checkpoints saved the rotary buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".inv_freq")


def load_hf_config(path: str | Path, architecture: bool = True) -> Any:
    """Check that ``path`` is a checkpoint directory and return its transformers config
    (``architecture=False``: a draft head's, whose architecture is not a causal LM's)."""
    p = Path(path)
    if not p.exists():
        raise InvalidInputError(f"model: path '{path}' does not exist")
    if not p.is_dir() or not (p / "config.json").is_file():
        raise InvalidInputError(
            f"model: '{path}' is not a Hugging Face checkpoint directory (no config.json)"
        )
    raw = read_config_json(p / "config.json")
    if architecture:  # first: another architecture has other fields
        check_architecture(SimpleNamespace(**raw))
    check_config_fields(raw, p / "config.json")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # transformers raises many kinds; the user needs the file and cause
        raise InvalidInputError(f"model: cannot read '{p / 'config.json'}': {e}") from None


def check_config(hf_config: Any, tp: TensorParallelGroup = SINGLE) -> None:
    """Architecture, activation, rope type and tensor-parallel divisibility, before any loading."""
    check_architecture(hf_config)
    compute_inv_freq(hf_config, head_dim_of(hf_config))  # raises for unsupported rope types
    for field, value in (
        ("num_attention_heads", int(hf_config.num_attention_heads)),
        ("num_key_value_heads", num_kv_heads_of(hf_config)),
        ("intermediate_size", int(hf_config.intermediate_size)),
    ):
        if value % tp.size != 0:
            raise InvalidInputError(
                f"model: {field}={value} is not divisible by tensor_parallel_size={tp.size}"
            )


def _map_name(model: LlamaForCausalLM, hf_name: str) -> tuple[str, object]:
    for hf_part, (ours, shard) in model.packed_modules.items():
        if f".{hf_part}." in hf_name:
            return hf_name.replace(f".{hf_part}.", f".{ours}."), shard
    return hf_name, None


def _hf_name(model: LlamaForCausalLM, name: str, shard: object) -> str:
    for hf_part, (ours, s) in model.packed_modules.items():
        if shard == s and f".{ours}." in name:
            return name.replace(f".{ours}.", f".{hf_part}.")
    return name


def _expected(model: LlamaForCausalLM) -> set[tuple[str, object]]:
    """Every (parameter, shard) the checkpoint must provide."""
    shards_of: dict[str, list[object]] = {}
    for ours, shard in model.packed_modules.values():
        shards_of.setdefault(ours, []).append(shard)
    expected: set[tuple[str, object]] = set()
    for name, _ in model.named_parameters():
        module = name.split(".")[-2]
        for shard in shards_of.get(module, [None]):
            expected.add((name, shard))
    return expected


def _open(file: Path) -> Any:
    """``safe_open`` with its errors (a file damaged past what the header check sees) named."""
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # SafetensorError, OSError: the user needs the file and the cause
        raise InvalidInputError(f"model: cannot read '{file}': {e}") from None


def safetensors_weights(files: list[Path]) -> Iterator[tuple[str, Loaded]]:
    """Every tensor of the files by name, as a lazy slice (read when indexed)."""
    for file in files:
        with _open(file) as f:
            for hf_name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield hf_name, f.get_slice(hf_name)


def load_weights(model: LlamaForCausalLM, files: list[Path], field: str = "model") -> None:
    load_named_weights(model, safetensors_weights(files), field)


def load_named_weights(
    model: LlamaForCausalLM, weights: Iterable[tuple[str, Loaded]], field: str = "model"
) -> None:
    """Fill every parameter from ``weights`` (Hugging Face names, full tensors or lazy slices);
    raise naming any weight they lack (and ``field``, the argument that named the checkpoint)."""
    params = dict(model.named_parameters())
    loaded: set[tuple[str, object]] = set()
    unexpected: list[str] = []
    for hf_name, weight in weights:
        if hf_name.endswith(_IGNORED_SUFFIXES):
            continue
        if model.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        name, shard = _map_name(model, hf_name)
        param = params.get(name)
        if param is None:
            unexpected.append(hf_name)
            continue
        try:
            get_weight_loader(param)(param, weight, shard)
        except InvalidInputError as e:
            raise InvalidInputError(f"{field}: weight '{hf_name}' {e}") from None
        loaded.add((name, shard))
    missing = sorted(_hf_name(model, n, s) for n, s in _expected(model) - loaded)
    if missing:
        shown = ", ".join(missing[:10]) + (
            f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""
        )
        raise InvalidInputError(f"{field}: the checkpoint lacks {len(missing)} weight(s): {shown}")
    if unexpected:
        logger.warning(
            "ignoring %d checkpoint tensor(s) the model has no place for: %s",
            len(unexpected),
            ", ".join(unexpected[:10]),
        )


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: TensorParallelGroup = SINGLE,
    attention_backend: AttentionBackend | None = None,
    use_cpu_kernels: bool = True,
    field: str = "model",
) -> LlamaForCausalLM:
    """This rank's shard of the checkpoint at ``path`` (a Hugging Face checkpoint directory, a
    GGUF file or a folder holding one), in ``dtype`` on ``device``, ready to run:
    on a CPU through specbatch's kernels where they are available (``use_cpu_kernels=False``:
    the pure-torch layers)."""
    gguf_file = find_gguf_file(path)
    if gguf_file is not None:  # a GGUF file: config and weights from it (gguf_checkpoint.py)
        hf_config, weights = gguf_weights(gguf_file)
        check_config(hf_config, tp)
    else:
        hf_config = load_hf_config(path)
        check_config(hf_config, tp)
        files = checkpoint_files(path)
        check_checkpoint_files(files)
        weights = safetensors_weights(files)
    model = LlamaForCausalLM(hf_config, dtype, device, tp, attention_backend)
    load_named_weights(model, weights, field)
    if use_cpu_kernels and torch.device(device).type == "cpu":
        from specbatch.kernels.cpu import cpu_kernels

        kernels = cpu_kernels()
        if kernels is not None:
            model.use_cpu_kernels(kernels)
    return model.eval()
