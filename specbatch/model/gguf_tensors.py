"""A GGUF file's tensors under their Hugging Face names, dequantized when first read.

llama.cpp renames every tensor (``blk.3.attn_q.weight`` is ``model.layers.3.self_attn.q_proj.
weight``) and, for the "llama" architecture, reorders the rows of the query and key projections:
its rotary embedding rotates adjacent pairs (x0, x1), (x2, x3)... where Hugging Face's rotates
the two halves of each head, (x0, x_{d/2}), (x1, x_{d/2+1})... so its converter interleaves each
head's two halves. Undoing that order gives back the Hugging Face weights. Qwen2 and Qwen3 files
keep the halves layout and are left as they are. Gemma files store every RMSNorm weight as
``1 + weight`` (the factor Gemma's norm multiplies by), and name the norms around the MLP
otherwise: the weight is read back by subtracting 1, so that the norm's ``1 + weight`` in
float32 is the stored factor exactly (for factors of at least 0.5).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cache
from typing import Any

import numpy as np
import torch

from specbatch.errors import InvalidInputError
from specbatch.model.gguf_checkpoint import import_gguf
from specbatch.model.gguf_reader import DAMAGED, GGUFFile, TensorInfo

_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA_LAYER = {
    **_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3 files keep its fused projections: attn_qkv is qkv_proj, ffn_up holds gate and up
_PHI3_LAYER = {**_LAYER, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_FAMILY_LAYER = {"gemma2": _GEMMA_LAYER, "gemma3_text": _GEMMA_LAYER, "phi3": _PHI3_LAYER}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, model_type: str | None = None) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for a tensor the model has no place for."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    layer = _FAMILY_LAYER.get(model_type or "", _LAYER)
    m = _LAYER_NAME.fullmatch(gguf_name)
    if m is None or m.group(2) not in layer:
        return None
    return f"model.layers.{m.group(1)}.{layer[m.group(2)]}.{m.group(3)}"


def unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of each head's two rotary halves (rows of a query or key
    projection, weight or bias)."""
    rest = w.shape[1:]
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(w.shape)


class GGUFTensor:
    """One tensor of the file, read (and dequantized to float32) when first indexed, as the
    loader's weight loaders read a safetensors slice."""

    def __init__(
        self, reader: GGUFFile, info: TensorInfo, permute_heads: int | None, offset: float = 0.0
    ) -> None:
        """``offset``: added to every value once read (-1: a Gemma norm's weight)."""
        self.reader, self.info, self.permute_heads = reader, info, permute_heads
        self.offset = offset
        self._value: torch.Tensor | None = None

    def get_shape(self) -> list[int]:
        return list(self.info.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        if self._value is None:
            self._value = self._read()
        return self._value[index]

    def _read(self) -> torch.Tensor:
        t, file = self.info, self.reader.file
        gguf = import_gguf(file)
        try:
            data = gguf.quants.dequantize(
                self.reader.tensor_bytes(t), gguf.GGMLQuantizationType(t.kind)
            )
        except ValueError as e:
            raise InvalidInputError(
                f"'{file}': tensor '{t.name}' ({self.reader.type_name(t)}) cannot be "
                f"read: {e} {DAMAGED}"
            ) from None
        # A copy, in float32: the file is mapped read-only.
        value = torch.from_numpy(np.array(data, dtype=np.float32)).reshape(t.shape)
        if self.permute_heads is not None:
            value = unpermute_rows(value, self.permute_heads)
        if self.offset:
            value += self.offset
        return value


def check_tensor_types(reader: GGUFFile) -> None:
    """Raise, naming the first such tensor, if the file holds a type that the installed
    ``gguf`` package cannot dequantize."""
    gguf = import_gguf(reader.file)
    for kind in sorted({t.kind for t in reader.tensors}):
        if not _can_dequantize(gguf, kind):
            t = next(t for t in reader.tensors if t.kind == kind)
            raise InvalidInputError(
                f"'{reader.file}': tensor '{t.name}' is stored as "
                f"{reader.type_name(t)}, which the installed gguf package cannot dequantize (a "
                "newer one may: pip install -U gguf)"
            )


@cache
def _can_dequantize(gguf: Any, kind: int) -> bool:
    try:
        qtype = gguf.GGMLQuantizationType(kind)
        block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
        gguf.quants.dequantize(np.zeros((1, block_bytes), dtype=np.uint8), qtype)
    except (ValueError, KeyError, NotImplementedError):
        return False
    return True


def named_tensors(reader: GGUFFile, hf_config: Any) -> Iterator[tuple[str, GGUFTensor]]:
    """Every tensor of the file by Hugging Face name (its own name when it has none, so the
    loader lists it as unexpected), none read yet."""
    llama = hf_config.model_type in ("llama", "mixtral")  # Mixtral's files are "llama" ones
    gemma = hf_config.model_type in ("gemma2", "gemma3_text")
    heads = {"attn_q": int(hf_config.num_attention_heads), "attn_k": hf_config.num_key_value_heads}
    for t in reader.tensors:
        if t.name.startswith("rope_factors_"):  # LongRoPE's factors: read into the config
            continue
        part = t.name.split(".")[2] if t.name.startswith("blk.") else None
        permute = heads.get(part) if llama and part is not None else None
        offset = -1.0 if gemma and t.name.endswith("norm.weight") else 0.0
        name = hf_name(t.name, hf_config.model_type)
        tensor = GGUFTensor(reader, t, permute, offset)
        if name is None and hasattr(hf_config, "num_experts_per_tok"):
            from specbatch.model.moe import expert_tensors

            yield from expert_tensors(t.name, tensor, hf_config)
            continue
        yield name or t.name, tensor
