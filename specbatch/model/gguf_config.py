"""A GGUF file's metadata as a transformers config of the same model.

llama.cpp names every setting ``<architecture>.<key>`` (``llama.attention.head_count``); these
are read as written and checked, each error naming the metadata key. Some settings are not
stored but shown by the tensors: a tied LM head has no ``output.weight``, biases are tensors of
their own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specbatch.errors import InvalidInputError
from specbatch.model.gguf_reader import GGUFFile

# GGUF architecture -> transformers config class and architecture. Mistral's dense models are
# written as "llama" by llama.cpp.
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}
# What llama.cpp's loader assumes where a Gemma file says nothing (with the rest in
# _gemma_fields): every n-th layer global, and the 27B models (told by their layer counts)
# scaling queries by hidden_size / heads rather than the head size.
GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
ROPE_SCALINGS = ("none", "linear", "yarn")


class _Metadata:
    """Typed reads of one file's metadata, each error naming the file and the key."""

    def __init__(self, reader: GGUFFile, file: Path, arch: str) -> None:
        self.reader, self.file, self.arch = reader, file, arch

    def _fail(self, key: str, what: str, value: Any) -> InvalidInputError:
        shown = "it is absent" if value is None else f"got {str(value)[:60]!r}"
        return InvalidInputError(f"'{self.file}': metadata '{key}' must be {what}; {shown}")

    def int(self, name: str, required: bool = True, minimum: int = 1) -> int | None:
        key = f"{self.arch}.{name}"
        v = self.reader.fields.get(key)
        if v is None and not required:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise self._fail(key, f"an integer >= {minimum}", v)
        return v

    def float(self, name: str, required: bool = True) -> float | None:
        key = f"{self.arch}.{name}"
        v = self.reader.fields.get(key)
        if v is None and not required:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise self._fail(key, "a positive number", v)
        return float(v)

    def str(self, key: str) -> str | None:
        v = self.reader.fields.get(key)
        if v is not None and not isinstance(v, str):
            raise self._fail(key, "a string", v)
        return v


def gguf_hf_config(reader: GGUFFile, file: Path) -> Any:
    """The transformers config of the model in ``file``; raises ``InvalidInputError`` naming
    the metadata key for an unsupported architecture or setting, or a missing or bad value."""
    arch = reader.fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise InvalidInputError(
            f"'{file}': general.architecture {arch!r} is not supported; supported: "
            + ", ".join(ARCHITECTURES)
        )
    m = _Metadata(reader, file, arch)
    config_class, architecture = ARCHITECTURES[arch]
    experts = m.int("expert_count", required=False, minimum=0)
    moe: dict[str, Any] = {}
    if experts or arch == "qwen3moe":  # llama.cpp writes Mixtral as "llama" with experts
        from specbatch.model.moe import moe_gguf_fields

        config_class, architecture, moe = moe_gguf_fields(reader, file, arch)
    hidden = m.int("embedding_length")
    heads = m.int("attention.head_count")
    kv_heads = m.int("attention.head_count_kv", required=False) or heads
    assert hidden is not None and heads is not None
    if heads % kv_heads:
        raise InvalidInputError(
            f"'{file}': {arch}.attention.head_count={heads} is not a multiple of "
            f"{arch}.attention.head_count_kv={kv_heads}"
        )
    head_dim = m.int("attention.key_length", required=False)
    if head_dim is None:
        if hidden % heads:
            raise InvalidInputError(
                f"'{file}': {arch}.embedding_length={hidden} is not a multiple of "
                f"{arch}.attention.head_count={heads} (and no {arch}.attention.key_length)"
            )
        head_dim = hidden // heads
    # Phi-3's rotary may turn part of each head (read with its other settings below)
    for name in ("attention.value_length", *(("rope.dimension_count",) if arch != "phi3" else ())):
        v = m.int(name, required=False)
        if v is not None and v != head_dim:
            raise InvalidInputError(
                f"'{file}': {arch}.{name}={v} differs from the head size {head_dim}; "
                "only full rotary with equal key and value sizes is supported"
            )
    names = {t.name for t in reader.tensors}
    bos = reader.fields.get("tokenizer.ggml.bos_token_id")
    eos = reader.fields.get("tokenizer.ggml.eos_token_id")
    kwargs: dict[str, Any] = {
        "architectures": [architecture],
        "vocab_size": _vocab_size(reader, m),
        "hidden_size": hidden,
        "num_hidden_layers": m.int("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": m.int("feed_forward_length"),
        "max_position_embeddings": m.int("context_length"),
        "rms_norm_eps": m.float("attention.layer_norm_rms_epsilon"),
        "rope_theta": m.float("rope.freq_base", required=False) or 10000.0,
        "tie_word_embeddings": "output.weight" not in names,
        "dtype": stored_dtype(reader),
        "bos_token_id": bos if isinstance(bos, int) else None,
        "eos_token_id": eos if isinstance(eos, int) else None,
    }
    kwargs.update(moe)
    if arch == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in names
        kwargs["mlp_bias"] = "blk.0.ffn_up.bias" in names
    if arch in GEMMA_PATTERN:
        kwargs.update(_gemma_fields(m, hidden, heads, head_dim))
    else:
        kwargs["hidden_act"] = "silu"
    if arch == "phi3":
        from specbatch.model.phi3 import phi3_gguf_fields

        kwargs.update(phi3_gguf_fields(reader, file, head_dim, kwargs.pop("rope_theta")))
    scaling = _rope_scaling(m, names)
    if scaling is not None:
        kwargs["rope_scaling"] = scaling
    import transformers

    try:
        return getattr(transformers, config_class)(**kwargs)
    except Exception as e:  # transformers validates some fields itself
        raise InvalidInputError(f"'{file}': its metadata make no valid config: {e}") from None


def _gemma_fields(m: _Metadata, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    """Gemma's settings: soft-capping, the window and which layers slide, the query scale."""
    layers = m.int("block_count")
    assert layers is not None
    gemma2 = m.arch == "gemma2"
    pattern = m.reader.fields.get(f"{m.arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == layers:
        sliding = [bool(p) for p in pattern]
    else:
        if pattern is None:
            pattern = GEMMA_PATTERN[m.arch]
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise m._fail(
                f"{m.arch}.attention.sliding_window_pattern",
                f"an integer >= 1 or {layers} booleans",
                pattern,
            )
        sliding = [bool((i + 1) % pattern) for i in range(layers)]
    scale = m.float("attention.scale", required=False)
    if scale is not None:  # transformers' configs hold the scalar as an integer
        scalar = round(scale**-2) if abs(scale**-2 - round(scale**-2)) < 1e-3 else scale**-2
    elif layers == GEMMA_27B_LAYERS[m.arch]:
        scalar = hidden // heads
    else:
        scalar = head_dim
    window = m.int("attention.sliding_window", required=not gemma2) or 4096
    fields: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": window,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "attn_logit_softcapping": m.float("attn_logit_softcapping", required=False),
        "final_logit_softcapping": m.float("final_logit_softcapping", required=False),
    }
    if gemma2:
        for key, default in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)):
            fields[key] = fields[key] or default
    else:
        fields["rope_local_base_freq"] = 10000.0
    return fields


def _vocab_size(reader: GGUFFile, m: _Metadata) -> int:
    """The embedding's rows (what the weights hold), else the stated size, else the tokens."""
    for t in reader.tensors:
        if t.name == "token_embd.weight" and len(t.shape) == 2:
            return t.shape[0]
    stated = m.int("vocab_size", required=False)
    if stated is not None:
        return stated
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and tokens:
        return len(tokens)
    raise InvalidInputError(
        f"'{m.file}' states no vocabulary size (no token_embd.weight tensor, no "
        f"{m.arch}.vocab_size, no tokenizer.ggml.tokens)"
    )


def _rope_scaling(m: _Metadata, tensor_names: set[str]) -> dict[str, Any] | None:
    if "rope_freqs.weight" in tensor_names:
        raise InvalidInputError(
            f"'{m.file}': tensor 'rope_freqs.weight' (per-dimension rope frequency "
            "factors, as Llama 3.1 files carry) is not supported"
        )
    key = f"{m.arch}.rope.scaling.type"
    kind = m.str(key)
    if kind in (None, "none"):
        return None
    if kind not in ROPE_SCALINGS:
        raise InvalidInputError(
            f"'{m.file}': metadata '{key}' is {kind!r}; supported: " + ", ".join(ROPE_SCALINGS)
        )
    scaling: dict[str, Any] = {"rope_type": kind, "factor": m.float("rope.scaling.factor")}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = m.int("rope.scaling.original_context_length")
    return scaling


def stored_dtype(reader: GGUFFile) -> str:
    """What the weight matrices are stored in, as ``resolve_dtype``'s "auto" reads it:
    float32 when every matrix is float32, bfloat16 when any is, else float16 (float16 and
    the block quantizations, whose scales are float16)."""
    kinds = {reader.type_name(t) for t in reader.tensors if len(t.shape) >= 2}
    if kinds <= {"F32"}:
        return "float32"
    return "bfloat16" if "BF16" in kinds else "float16"
