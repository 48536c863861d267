"""Load a checkpoint (``checkpoint.py`` read and checked it) into a (tensor-parallel shard of
a) model. Weights are sharded as
they load: each parameter's ``weight_loader`` reads only this rank's rows or columns from the
safetensors file (``get_slice``), so no rank ever holds the whole model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from specbatch.distributed.parallel_state import SINGLE, TensorParallelGroup
from specbatch.errors import InvalidInputError
from specbatch.model.checkpoint import ModelConfig, at, check_tensor_parallel, read_checkpoint
from specbatch.model.gemma import GemmaForCausalLM, gemma_architecture, needs_torch_attention
from specbatch.model.gguf_checkpoint import open_gguf
from specbatch.model.gguf_tensors import named_tensors
from specbatch.model.layers.attention import AttentionBackend
from specbatch.model.layers.weights import Loaded, get_weight_loader
from specbatch.model.llama import LlamaForCausalLM
from specbatch.model.moe import MoeForCausalLM, moe_architecture
from specbatch.model.phi3 import Phi3ForCausalLM, phi3_architecture

logger = logging.getLogger(__name__)

CausalLM = LlamaForCausalLM | GemmaForCausalLM


def model_class(hf_config: Any) -> type[LlamaForCausalLM] | type[GemmaForCausalLM]:
    """The class that runs a (checked) config's architecture."""
    if gemma_architecture(hf_config):
        return GemmaForCausalLM
    if phi3_architecture(hf_config):
        return Phi3ForCausalLM
    if moe_architecture(hf_config):
        return MoeForCausalLM
    return LlamaForCausalLM


# Checkpoint tensors that are not weights (old checkpoints saved the rotary buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".inv_freq")


def _map_name(model: CausalLM, hf_name: str) -> tuple[str, object]:
    for hf_part, (ours, shard) in model.packed_modules.items():
        if f".{hf_part}." in hf_name:
            return hf_name.replace(f".{hf_part}.", f".{ours}."), shard
    return hf_name, None


def _hf_name(model: CausalLM, name: str, shard: object) -> str:
    for hf_part, (ours, s) in model.packed_modules.items():
        if shard == s and f".{ours}." in name:
            return name.replace(f".{ours}.", f".{hf_part}.")
    return name


def _expected(model: CausalLM) -> set[tuple[str, object]]:
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
        raise InvalidInputError(f"cannot read '{file}': {e}") from None


def safetensors_weights(files: list[Path]) -> Iterator[tuple[str, Loaded]]:
    """Every tensor of the files by name, as a lazy slice (read when indexed)."""
    for file in files:
        with _open(file) as f:
            for hf_name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield hf_name, f.get_slice(hf_name)


def load_named_weights(model: CausalLM, weights: Iterable[tuple[str, Loaded]]) -> None:
    """Fill every parameter from ``weights`` (Hugging Face names, full tensors or lazy slices);
    raise naming any weight they lack."""
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
            raise InvalidInputError(f"weight '{hf_name}' {e}") from None
        loaded.add((name, shard))
    missing = sorted(_hf_name(model, n, s) for n, s in _expected(model) - loaded)
    if missing:
        shown = ", ".join(missing[:10]) + (
            f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""
        )
        raise InvalidInputError(f"the checkpoint lacks {len(missing)} weight(s): {shown}")
    if unexpected:
        logger.warning(
            "ignoring %d checkpoint tensor(s) the model has no place for: %s",
            len(unexpected),
            ", ".join(unexpected[:10]),
        )


def load_model(
    source: str | Path | ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: TensorParallelGroup = SINGLE,
    attention_backend: AttentionBackend | None = None,
    use_cpu_kernels: bool = True,
) -> CausalLM:
    """This rank's shard of a checkpoint (as ``read_checkpoint`` read it, or its path: a Hugging
    Face checkpoint directory, a GGUF file or a folder holding one), in ``dtype`` on ``device``,
    ready to run: on a CPU through specbatch's kernels where they are available
    (``use_cpu_kernels=False``: the pure-torch layers)."""
    checkpoint = source if isinstance(source, ModelConfig) else read_checkpoint(source)
    if not isinstance(source, ModelConfig):  # the engine's configuration checked its own
        check_tensor_parallel(checkpoint.hf_config, tp.size)
    kernels = None
    if use_cpu_kernels and torch.device(device).type == "cpu":
        from specbatch.kernels.cpu import cpu_kernels

        kernels = cpu_kernels()
    if checkpoint.kernels_required and (kernels is None or not kernels.supports_linear(dtype)):
        raise InvalidInputError(
            "batch_invariant needs specbatch's CPU kernels, which do not run this model here "
            "(see the warning above; SPECBATCH_CPU_KERNELS=0 turns them off)",
            "batch_invariant",
        )
    torch_only = needs_torch_attention(checkpoint.hf_config)
    if checkpoint.kernels_required and torch_only:
        raise InvalidInputError(
            f"batch_invariant needs specbatch's CPU kernels for every op: {torch_only}",
            "batch_invariant",
        )
    try:
        hf_config = checkpoint.hf_config
        if checkpoint.files:
            weights = safetensors_weights([Path(f) for f in checkpoint.files])
        else:  # a GGUF file: its tensors under Hugging Face names, dequantized when read
            weights = named_tensors(open_gguf(Path(checkpoint.path)), hf_config)
        model = model_class(hf_config)(hf_config, dtype, device, tp, attention_backend)
        load_named_weights(model, weights)
    except InvalidInputError as e:
        raise at(checkpoint.field, e) from None
    if kernels is not None:
        model.use_cpu_kernels(kernels)
    return model.eval()
