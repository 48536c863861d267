"""Tiny GGUF files for tests, written with the ``gguf`` package's own writer.

``write_gguf`` turns a Hugging Face checkpoint directory (such as ``make_random_checkpoint``
writes) into the GGUF file llama.cpp's converter would make of it: its tensor names from the
``gguf`` package's own name map, the rows of Llama's query and key projections interleaved as
llama.cpp's rotary wants them, the tokenizer and chat template as metadata, and the matrices
stored in the ggml type asked for. Types the ``gguf`` package can quantize (F16, BF16, Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1) are quantized from the weights; the K-quants it cannot write (Q4_K, Q5_K,
Q6_K) are filled with random blocks scaled like the weights they replace, so their
dequantization is exercised all the same. Norms and biases stay float32, as llama.cpp keeps them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

GGUF_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# K-quants: where each block's float16 scales sit, and the value each gets before rescaling
# (the second scale of Q4_K and Q5_K is the block minimum, chosen to centre the values).
_K_QUANT_SCALES = {
    "Q4_K": ((0, 1.0), (2, 7.5)),
    "Q5_K": ((0, 1.0), (2, 15.5)),
    "Q6_K": ((208, 1.0),),
}


def write_gguf(
    hf_dir: str | Path,
    out: str | Path,
    *,
    matrix_type: str = "F32",
    types: dict[str, str] | None = None,
    tokenizer: bool = True,
    metadata: dict[str, Any] | None = None,
    drop_tensors: Iterable[str] = (),
    extra_tensors: dict[str, np.ndarray] | None = None,
    architecture: str | None = None,
    seed: int = 0,
) -> Path:
    """Write the GGUF file of the checkpoint in ``hf_dir`` to ``out``.

    ``matrix_type``: the ggml type of every 2-D weight, ``types`` per GGUF tensor name
    (``{"token_embd.weight": "Q8_0"}``). ``metadata`` adds or replaces keys (None drops one),
    ``drop_tensors`` and ``extra_tensors`` (float arrays, written as they are) change the
    tensors, ``architecture`` the ``general.architecture`` written: for files that must fail.
    """
    import gguf
    import torch
    from safetensors.torch import load_file

    hf = Path(hf_dir)
    config = json.loads((hf / "config.json").read_text())
    arch = GGUF_ARCHS[config["model_type"]]
    weights = load_file(str(hf / "model.safetensors"))
    n_layers = int(config["num_hidden_layers"])
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layers)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rng = np.random.default_rng(seed)

    fields = _model_fields(arch, config, head_dim)
    if tokenizer:
        fields.update(_tokenizer_fields(hf, config))
    for key, value in (metadata or {}).items():
        if value is None:
            fields.pop(key, None)
        else:
            fields[key] = value

    writer = gguf.GGUFWriter(str(out), architecture or arch)
    for key, value in fields.items():
        _add_field(writer, key, value)
    drop = set(drop_tensors)
    for hf_name, tensor in weights.items():
        if config.get("tie_word_embeddings") and hf_name == "lm_head.weight":
            continue
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{name_map.get_name(base)}.{suffix}"
        if name in drop:
            continue
        w = tensor.to(torch.float32).numpy()
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            w = _interleave_halves(w, heads if ".attn_q." in name else kv_heads)
        kind = (types or {}).get(name, matrix_type) if w.ndim == 2 else "F32"
        _add_tensor(writer, gguf, name, w, kind, rng)
    for name, value in (extra_tensors or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)


def _model_fields(arch: str, config: dict[str, Any], head_dim: int) -> dict[str, Any]:
    rope = config.get("rope_parameters") or {}
    fields: dict[str, Any] = {
        f"{arch}.context_length": config["max_position_embeddings"],
        f"{arch}.embedding_length": config["hidden_size"],
        f"{arch}.block_count": config["num_hidden_layers"],
        f"{arch}.feed_forward_length": config["intermediate_size"],
        f"{arch}.attention.head_count": config["num_attention_heads"],
        f"{arch}.attention.head_count_kv": config["num_key_value_heads"],
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        f"{arch}.rope.dimension_count": head_dim,
        f"{arch}.rope.freq_base": float(rope.get("rope_theta", config.get("rope_theta", 1e4))),
        f"{arch}.attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        f"{arch}.vocab_size": config["vocab_size"],
    }
    kind = rope.get("rope_type", "default")
    if kind in ("linear", "yarn"):
        fields[f"{arch}.rope.scaling.type"] = kind
        fields[f"{arch}.rope.scaling.factor"] = float(rope["factor"])
    if kind == "yarn":
        original = rope["original_max_position_embeddings"]
        fields[f"{arch}.rope.scaling.original_context_length"] = original
    return fields


def _tokenizer_fields(hf: Path, config: dict[str, Any]) -> dict[str, Any]:
    """A byte-level BPE tokenizer.json as llama.cpp stores it ("gpt2" model), padded to the
    model's vocabulary with unused tokens."""
    tok = json.loads((hf / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    special = {t["content"]: t["id"] for t in tok.get("added_tokens", ())}
    tokens = [f"[PAD{i}]" for i in range(config["vocab_size"])]
    kinds = [5] * len(tokens)  # UNUSED
    for text, i in {**vocab, **special}.items():
        tokens[i] = text
        kinds[i] = 3 if text in special else 1  # CONTROL, NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    fields: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": kinds,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": config["bos_token_id"],
        "tokenizer.ggml.eos_token_id": config["eos_token_id"],
        "tokenizer.ggml.add_bos_token": False,
    }
    tok_config = json.loads((hf / "tokenizer_config.json").read_text())
    template = tok_config.get("chat_template")
    if template is None and (hf / "chat_template.jinja").is_file():
        template = (hf / "chat_template.jinja").read_text()
    if template:
        fields["tokenizer.chat_template"] = template
    return fields


def _add_field(writer: Any, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, list(value))


def _interleave_halves(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows (x_0..x_{d/2-1}, x_{d/2}..x_{d-1}) reordered as
    (x_0, x_{d/2}, x_1, x_{d/2+1}, ...), so that its rotary can rotate adjacent pairs."""
    d = w.shape[0] // n_heads
    out = np.empty_like(w)
    for h in range(n_heads):
        rows = w[h * d : (h + 1) * d]
        out[h * d : (h + 1) * d : 2] = rows[: d // 2]
        out[h * d + 1 : (h + 1) * d : 2] = rows[d // 2 :]
    return out


def _add_tensor(
    writer: Any, gguf: Any, name: str, w: np.ndarray, kind: str, rng: np.random.Generator
) -> None:
    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        writer.add_tensor(name, w.astype(np.float32))
    elif kind in _K_QUANT_SCALES:
        writer.add_tensor(name, _random_k_blocks(gguf, w, kind, rng), raw_dtype=qtype)
    else:
        data = gguf.quants.quantize(w.astype(np.float32), qtype)
        writer.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)


def _random_k_blocks(gguf: Any, w: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of K-quant ``kind`` for a matrix shaped like ``w``, its scales set so that
    the dequantized values have ``w``'s standard deviation."""
    qtype = gguf.GGMLQuantizationType[kind]
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = w.shape
    blocks = rng.integers(0, 256, size=(rows * cols // block, block_bytes), dtype=np.uint8)

    def set_scales(unit: float) -> None:
        for offset, value in _K_QUANT_SCALES[kind]:
            half = np.full(len(blocks), value * unit, dtype=np.float16)
            blocks[:, offset : offset + 2] = half.view(np.uint8).reshape(-1, 2)

    set_scales(1.0)
    std = float(gguf.quants.dequantize(blocks, qtype).std())
    set_scales(float(w.std()) / std)
    return blocks.reshape(rows, cols // block * block_bytes)
