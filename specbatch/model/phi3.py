"""Phi-3 and Phi-4-mini (``Phi3ForCausalLM``) over a paged KV cache, tensor-parallel.

A Llama-family decoder (``llama.py``'s attention, MLP and layers) with three differences: the
checkpoint fuses q, k and v into one ``qkv_proj`` and gate and up into one ``gate_up_proj``
(split into their parts as they load, so each rank keeps its own heads and intermediate
columns); the rotary embedding may cover only the first ``partial_rotary_factor`` of each head
(Phi-4-mini: 0.75); and the long-context variants scale its frequencies by LongRoPE.

LongRoPE: transformers' model picks the short factors while a forward's largest position is
below ``original_max_position_embeddings`` and the long ones from there on, for every position of
that forward; its ``generate`` recomputes a sequence's whole cache with the long factors when
the sequence first passes that length. A paged cache shared by speculation's rollbacks cannot
re-rotate keys already written, so here each position takes its factors by itself: short below
the original length, long from it on. That is transformers' model fed one token at a time, and
its ``generate`` for every sequence that stays within the original length; past it, the keys
below the switch keep the short factors here where ``generate`` turns them long. Both factors'
cos/sin carry the same attention scaling (``sqrt(1 + ln(factor) / ln(original))``, or the
config's ``attention_factor``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from specbatch.errors import InvalidInputError
from specbatch.kernels.cpu import CpuKernels
from specbatch.kernels.huge_pages import pack_for_kernels
from specbatch.model.layers.attention import AttentionBackend
from specbatch.model.layers.linear import ColumnParallelLinear
from specbatch.model.layers.rotary import RotaryEmbedding, rope_parameters
from specbatch.model.layers.weights import Loaded, check_shape, full_shape, set_weight_loader, take
from specbatch.model.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    head_dim_of,
    known_architecture,
)

PHI3_ARCHITECTURES = ("Phi3ForCausalLM",)
ROPE_TYPES = ("default", "linear", "yarn", "llama3", "longrope")


def phi3_architecture(hf_config: Any) -> str | None:
    """The config's architecture if it is a Phi-3 model this module runs, else None."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if archs:
        return next((a for a in archs if a in PHI3_ARCHITECTURES), None)
    return "Phi3ForCausalLM" if getattr(hf_config, "model_type", None) == "phi3" else None


def rotary_dim_of(hf_config: Any) -> int:
    """How many of each head's dimensions the rotary embedding turns."""
    params = rope_parameters(hf_config)
    factor = params.get("partial_rotary_factor")
    if factor is None:
        factor = getattr(hf_config, "partial_rotary_factor", None) or 1.0
    return int(head_dim_of(hf_config) * float(factor))


def check_phi3_config(hf_config: Any) -> None:
    """Everything the model reads of a transformers Phi3Config, checked before loading."""
    arch = phi3_architecture(hf_config)
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise InvalidInputError(f"hidden_act '{act}' is not supported for {arch}; supported: silu")
    head_dim, rot = head_dim_of(hf_config), rotary_dim_of(hf_config)
    if not (2 <= rot <= head_dim and rot % 2 == 0):
        raise InvalidInputError(
            f"{arch}: partial_rotary_factor gives {rot} rotary dimensions of the {head_dim}-wide "
            "heads; it must give an even number from 2 to the head size"
        )
    phi3_rope_tables(hf_config)  # raises for what is not supported


def phi3_rope_tables(hf_config: Any) -> tuple[torch.Tensor, torch.Tensor | None, int, float]:
    """The inverse frequencies ``[rotary_dim / 2]`` below the switch, those from the switch on
    (None: the same), the switch position, and the cos/sin scaling."""
    arch = phi3_architecture(hf_config)
    params = rope_parameters(hf_config)
    kind = params["rope_type"]
    if kind not in ROPE_TYPES:
        raise InvalidInputError(
            f"{arch}: rope_type '{kind}' is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    half = rotary_dim_of(hf_config) // 2
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            factors = params.get(key)
            if not isinstance(factors, (list, tuple)) or len(factors) != half:
                shown = len(factors) if isinstance(factors, (list, tuple)) else factors
                raise InvalidInputError(
                    f"{arch}: longrope's {key} must list {half} factors (half the rotary "
                    f"dimensions), got {shown}"
                )
        original = params.get("original_max_position_embeddings") or getattr(
            hf_config, "original_max_position_embeddings", None
        )
        if not isinstance(original, int) or original < 1:
            raise InvalidInputError(
                f"{arch}: longrope needs original_max_position_embeddings >= 1, got {original}"
            )
        init = ROPE_INIT_FUNCTIONS["longrope"]
        short, scaling = init(hf_config, torch.device("cpu"))
        long, _ = init(hf_config, torch.device("cpu"), seq_len=original + 1)
        return short.float(), long.float(), original, float(scaling)
    if kind == "default":
        base = float(params["rope_theta"])
        exponents = torch.arange(0, 2 * half, 2, dtype=torch.int64).float() / (2 * half)
        return 1.0 / (base**exponents), None, 0, 1.0
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](hf_config, torch.device("cpu"))
    if inv_freq.numel() != half:
        raise InvalidInputError(
            f"{arch}: rope_type '{kind}' gave {inv_freq.numel()} frequencies; expected {half}"
        )
    return inv_freq.float(), None, 0, float(scaling)


def phi3_gguf_fields(reader: Any, file: Any, head_dim: int, rope_theta: float) -> dict[str, Any]:
    """A llama.cpp "phi3" file's rotary and window as Phi3Config fields: the rotary's width
    (``phi3.rope.dimension_count``), LongRoPE's factors (the ``rope_factors_long`` and
    ``rope_factors_short`` tensors), original length and attention factor, the window (0:
    none, as the converter writes for Phi-4)."""
    from specbatch.model.gguf_tensors import GGUFTensor

    def field(key: str, kinds: tuple[type, ...]) -> Any:
        v = reader.fields.get(f"phi3.{key}")
        if v is not None and (isinstance(v, bool) or not isinstance(v, kinds) or v < 0):
            raise InvalidInputError(
                f"'{file}': metadata 'phi3.{key}' must be a non-negative number; got {v!r}"
            )
        return v

    dims = field("rope.dimension_count", (int,)) or head_dim
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta,
                            "partial_rotary_factor": dims / head_dim}  # fmt: skip
    window = field("attention.sliding_window", (int,)) or None
    pad = reader.fields.get("tokenizer.ggml.padding_token_id")  # Phi3Config's default: 32000
    fields: dict[str, Any] = {"partial_rotary_factor": dims / head_dim, "sliding_window": window,
                              "pad_token_id": pad if isinstance(pad, int) else None}  # fmt: skip
    factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    if factors:
        for kind in ("long", "short"):
            t = factors.get(f"rope_factors_{kind}.weight")
            if t is None:
                raise InvalidInputError(
                    f"'{file}': LongRoPE needs both rope_factors_long.weight and "
                    f"rope_factors_short.weight; rope_factors_{kind}.weight is absent"
                )
            rope[f"{kind}_factor"] = GGUFTensor(reader, t, None)[:].flatten().tolist()
        original = field("rope.scaling.original_context_length", (int,))
        if not original:
            raise InvalidInputError(
                f"'{file}': LongRoPE needs metadata 'phi3.rope.scaling.original_context_length'"
            )
        rope.update(rope_type="longrope", original_max_position_embeddings=original)
        fields["original_max_position_embeddings"] = original
        attn_factor = field("rope.scaling.attn_factor", (int, float))
        if attn_factor:
            rope["attention_factor"] = float(attn_factor)
    fields["rope_parameters"] = rope
    return fields


class Phi3Rotary(RotaryEmbedding):
    """Rotary embedding of each head's first ``rotary_dim`` dimensions (rotate-half within
    them; the rest pass through), its cos/sin read per position from a table that may switch
    frequencies at one position (LongRoPE)."""

    def __init__(self, hf_config: Any, device: torch.device | str) -> None:
        short, long, switch, scaling = phi3_rope_tables(hf_config)
        self.rotary_dim = rotary_dim_of(hf_config)
        self.full = self.rotary_dim == head_dim_of(hf_config)
        n = int(hf_config.max_position_embeddings)
        super().__init__(
            self.rotary_dim, short, max_positions=n, attention_scaling=scaling, device=device
        )
        if long is not None and switch < n:
            freqs = torch.arange(switch, n, dtype=torch.int64).float()[:, None] * long[None, :]
            self.cos[switch:] = (freqs.cos() * scaling).to(self.cos.device)
            self.sin[switch:] = (freqs.sin() * scaling).to(self.sin.device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.full:
            return super().forward(positions, q, k)
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        r = self.rotary_dim
        return (
            torch.cat((self._rotate(q[..., :r], cos, sin), q[..., r:]), dim=-1),
            torch.cat((self._rotate(k[..., :r], cos, sin), k[..., r:]), dim=-1),
        )


def load_fused(layer: ColumnParallelLinear, parts: Sequence[object]) -> None:
    """Let ``layer`` load a checkpoint tensor holding all its parts stacked along the output
    dimension (shard None): each part is cut out and loaded as its own shard."""
    sizes = layer.output_sizes

    def loader(param: nn.Parameter, loaded: Loaded, shard_id: object = None) -> None:
        if shard_id is not None:
            layer.weight_loader(param, loaded, shard_id)
            return
        rest = full_shape(loaded)[1:]
        check_shape(loaded, (sum(sizes), *rest))
        start = 0
        for part, size in zip(parts, sizes, strict=True):
            layer.weight_loader(param, take(loaded, 0, start, size), part)
            start += size

    set_weight_loader(layer.weight, loader)
    if layer.bias is not None:
        set_weight_loader(layer.bias, loader)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-4-mini causal LM; this rank's shard when ``tp.size > 1``. The same
    interface as ``LlamaForCausalLM`` (whose forward, logits and cache it uses)."""

    # the checkpoint's names are the model's: qkv_proj and gate_up_proj load whole
    packed_modules: ClassVar[dict[str, tuple[str, object]]] = {}

    def check_config(self, hf_config: Any) -> str:
        arch = known_architecture(phi3_architecture(hf_config), "a Phi-3 model", PHI3_ARCHITECTURES)
        check_phi3_config(hf_config)
        return arch

    def build_model(self, hf_config: Any, arch: str, backend: AttentionBackend) -> nn.Module:
        kw: dict[str, Any] = {"dtype": self.dtype, "device": self.device}
        hidden, tp = int(hf_config.hidden_size), self.tp
        rotary = Phi3Rotary(hf_config, self.device)

        def layer(_: int) -> nn.Module:
            attn = LlamaAttention(
                hf_config, qkv_bias=False, o_bias=False, qk_norm=False,
                rotary=rotary, backend=backend, tp=tp, **kw,
            )  # fmt: skip
            mlp = LlamaMLP(hidden, int(hf_config.intermediate_size), bias=False, tp=tp, **kw)
            load_fused(attn.qkv_proj, ("q", "k", "v"))
            load_fused(mlp.gate_up_proj, (0, 1))
            return LlamaDecoderLayer(hf_config, attn, mlp, **kw)

        # the forward is LlamaModel's module path: the CPU plan's layer kernel turns whole heads
        return LlamaModel(hf_config, rotary, layer, tp=tp, **kw)

    def use_cpu_kernels(self, kernels: CpuKernels) -> None:
        """Run the projections, rotary (whole heads only) and LM head through specbatch's CPU
        kernels, layer by layer."""
        pack_for_kernels(self, kernels)
