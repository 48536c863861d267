"""Gemma 2 and Gemma 3 (text) decoders over a paged KV cache, tensor-parallel.

What sets them apart from the Llama family (``llama.py``, whose projections and MLP layout
they share, heads split across ranks the same way): RMSNorm scales by ``1 + weight`` in
float32; the embedding is multiplied by ``sqrt(hidden_size)`` in the model dtype; the MLP is
GeGLU (tanh-approximated GELU); queries are scaled by ``query_pre_attn_scalar ** -0.5``; each
layer norms before and after both its attention and its MLP; layers alternate between a
sliding window (``sliding_window`` keys) and global attention (``layer_types``); Gemma 2
soft-caps the attention scores and the final logits, Gemma 3 norms q and k per head and gives
its sliding layers a rope base of their own; the LM head is usually tied.

Attention runs on ``layers/window_attention.py`` over the torch backend's cache layout, the
only one whose reads apply soft-capping and per-row windows exactly, so these models take the
"torch" attention backend. The sliding layers keep every key in the cache as the global layers
do (a cache that stops growing past the window would save memory; not done).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from specbatch.distributed.parallel_state import TensorParallelGroup
from specbatch.errors import InvalidInputError
from specbatch.kernels.cpu import CpuKernels
from specbatch.kernels.huge_pages import pack_for_kernels
from specbatch.model.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    TorchAttentionBackend,
)
from specbatch.model.layers.embedding import VocabParallelEmbedding
from specbatch.model.layers.linear import QKVParallelLinear, RowParallelLinear
from specbatch.model.layers.rotary import RotaryEmbedding, compute_inv_freq, rope_parameters
from specbatch.model.layers.weights import new_param
from specbatch.model.layers.window_attention import window_attention
from specbatch.model.llama import (
    KVCache,
    LlamaForCausalLM,
    LlamaMLP,
    head_dim_of,
    known_architecture,
    num_kv_heads_of,
)

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_BY_MODEL_TYPE = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
LAYER_TYPES = ("sliding_attention", "full_attention")
ACTIVATION = "gelu_pytorch_tanh"


def gemma_architecture(hf_config: Any) -> str | None:
    """The config's architecture if it is a Gemma text model this module runs, else None."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in GEMMA_ARCHITECTURES:
            return arch
    return None if archs else _BY_MODEL_TYPE.get(getattr(hf_config, "model_type", None))


def check_gemma_activation(hf_config: Any) -> None:
    act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", None)
    if act != ACTIVATION:
        raise InvalidInputError(
            f"hidden_activation '{act}' is not supported for {gemma_architecture(hf_config)}; "
            f"supported: {ACTIVATION}"
        )


def check_gemma_config(hf_config: Any) -> None:
    """Everything the model reads of a transformers Gemma config, checked before loading."""
    arch = gemma_architecture(hf_config)
    check_gemma_activation(hf_config)
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise InvalidInputError(
            f"{arch}: use_bidirectional_attention (an embedding model) is not supported"
        )
    types = layer_types_of(hf_config)
    if "sliding_attention" in types and not getattr(hf_config, "sliding_window", None):
        raise InvalidInputError(f"{arch}: sliding layers need a sliding_window >= 1")
    for layer_type in sorted(set(types)):
        rope_of(hf_config, layer_type)  # raises for what is not supported


def layer_types_of(hf_config: Any) -> list[str]:
    """Each layer's attention, ``sliding_attention`` or ``full_attention``."""
    n = int(hf_config.num_hidden_layers)
    types = getattr(hf_config, "layer_types", None)
    if types is None:  # transformers sets it; a config built otherwise alternates as Gemma 2
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    types = list(types)
    bad = [t for t in types if t not in LAYER_TYPES]
    if len(types) != n or bad:
        raise InvalidInputError(
            f"{gemma_architecture(hf_config)}: layer_types must list one of "
            f"{', '.join(LAYER_TYPES)} for each of the {n} layers, got {types}"
        )
    return types


def rope_of(hf_config: Any, layer_type: str) -> tuple[torch.Tensor, float]:
    """A layer type's inverse frequencies and scaling: Gemma 3 gives each type its own rope
    parameters (``rope_parameters[layer_type]``; an older config: ``rope_local_base_freq``
    for the sliding layers, ``rope_theta`` and ``rope_scaling`` for the global ones)."""
    head_dim = head_dim_of(hf_config)
    params = getattr(hf_config, "rope_parameters", None) or {}
    if not any(t in params for t in LAYER_TYPES):
        if gemma_architecture(hf_config) == "Gemma2ForCausalLM":
            return compute_inv_freq(hf_config, head_dim)
        if layer_type == "sliding_attention":
            base = getattr(hf_config, "rope_local_base_freq", None) or 10000.0
            params = {"rope_type": "default", "rope_theta": float(base)}
        else:
            params = rope_parameters(hf_config)
    else:
        params = dict(params.get(layer_type) or {"rope_type": "default"})
        params.setdefault("rope_type", params.get("type", "default"))
    kind = params["rope_type"]
    if kind not in ("default", "linear"):
        raise InvalidInputError(
            f"{gemma_architecture(hf_config)}: rope_type '{kind}' of the {layer_type} layers "
            "is not supported; supported: default, linear"
        )
    flat = SimpleNamespace(rope_parameters={**params, "rope_type": "default"}, layer_types=None)
    inv_freq, scaling = compute_inv_freq(flat, head_dim)
    if kind == "linear":
        inv_freq = inv_freq / float(params["factor"])
    return inv_freq, scaling


def needs_torch_attention(hf_config: Any) -> str | None:
    """Why a model's attention runs only on the torch backend (None: any backend)."""
    arch = gemma_architecture(hf_config)
    if arch is None:
        return None
    what = [
        name
        for name, used in (
            ("attention soft-capping", getattr(hf_config, "attn_logit_softcapping", None)),
            ("sliding-window layers", getattr(hf_config, "sliding_window", None)),
        )
        if used
    ]
    return f"{arch}'s {' and '.join(what) or 'attention'} run on the torch attention backend only"


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)``, all in float32, cast back to the input dtype."""

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = new_param((size,), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


class GeluTanhAndMul(nn.Module):
    """``[..., 2 * d]`` laid out as ``[gate | up]`` -> ``gelu_tanh(gate) * up``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class GemmaAttention(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        *,
        sliding: bool,
        qk_norm: bool,
        rotary: RotaryEmbedding,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim_of(hf_config)
        heads, hidden = int(hf_config.num_attention_heads), int(hf_config.hidden_size)
        bias = bool(getattr(hf_config, "attention_bias", False))
        kw: dict[str, Any] = {"bias": bias, "tp": tp, "dtype": dtype, "device": device}
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, heads, num_kv_heads_of(hf_config), **kw
        )
        self.o_proj = RowParallelLinear(heads * self.head_dim, hidden, **kw)
        eps = float(hf_config.rms_norm_eps)
        norm: dict[str, Any] = {"dtype": dtype, "device": device}
        self.q_norm = GemmaRMSNorm(self.head_dim, eps, **norm) if qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, eps, **norm) if qk_norm else None
        self.rotary = rotary  # shared by the layers of one type
        self.scale = float(hf_config.query_pre_attn_scalar) ** -0.5
        self.softcap = float(getattr(hf_config, "attn_logit_softcapping", None) or 0) or None
        self.window = int(hf_config.sliding_window) if sliding else None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = window_attention(
            q, k, v, kv_cache[0], kv_cache[1], meta, self.scale,
            softcap=self.softcap, window=self.window,
        )  # fmt: skip
        return self.o_proj(out.reshape(out.shape[0], -1))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, attn: GemmaAttention, mlp: LlamaMLP, **kw: Any) -> None:
        super().__init__()
        hidden, eps = int(hf_config.hidden_size), float(hf_config.rms_norm_eps)
        self.input_layernorm = GemmaRMSNorm(hidden, eps, **kw)
        self.self_attn = attn
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, **kw)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, **kw)
        self.mlp = mlp
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, **kw)

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The residual stream after the layer."""
        x = self.self_attn(self.input_layernorm(h), positions, kv_cache, meta)
        h = h + self.post_attention_layernorm(x)
        x = self.mlp(self.pre_feedforward_layernorm(h))
        return h + self.post_feedforward_layernorm(x)


class GemmaModel(nn.Module):
    """Embedding, decoder layers, final norm (parameter names follow the HF ``model.`` prefix)."""

    def __init__(
        self,
        hf_config: Any,
        *,
        arch: str,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        hidden = int(hf_config.hidden_size)
        # the table unscaled, as vLLM has it (a drafter sharing it embeds without the factor)
        self.embed_tokens = VocabParallelEmbedding(int(hf_config.vocab_size), hidden, tp=tp, **kw)
        # sqrt(hidden_size), rounded to the model dtype first as transformers multiplies it
        self.normalizer: torch.Tensor
        scale = torch.tensor(hidden**0.5, dtype=torch.float32).to(dtype)
        self.register_buffer("normalizer", scale.to(device), persistent=False)
        self.layer_types = layer_types_of(hf_config)
        gemma3 = arch == "Gemma3ForCausalLM"
        # Gemma 3 gives each layer type a rotary of its own; Gemma 2's layers share one
        self.rotary_emb = nn.ModuleDict()
        for kind in dict.fromkeys(self.layer_types) if gemma3 else ["full_attention"]:
            inv_freq, scaling = rope_of(hf_config, kind)
            self.rotary_emb[kind] = RotaryEmbedding(
                head_dim_of(hf_config), inv_freq,
                max_positions=int(hf_config.max_position_embeddings),
                attention_scaling=scaling, device=device,
            )  # fmt: skip
        layers = []
        for layer_type in self.layer_types:
            rotary = self.rotary_emb[layer_type if gemma3 else "full_attention"]
            assert isinstance(rotary, RotaryEmbedding)
            sliding = layer_type == "sliding_attention"
            attn = GemmaAttention(
                hf_config, sliding=sliding, qk_norm=gemma3, rotary=rotary, tp=tp, **kw
            )
            mlp = LlamaMLP(hidden, int(hf_config.intermediate_size), bias=False, tp=tp, **kw)
            mlp.act = GeluTanhAndMul()
            layers.append(GemmaDecoderLayer(hf_config, attn, mlp, **kw))
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(hidden, float(hf_config.rms_norm_eps), **kw)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.normalizer

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        streams: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final-normed hidden states, and the residual stream entering each layer of
        ``streams`` (``len(layers)``: the stream after the last one), as ``LlamaModel``."""
        h = self.embed(input_ids)
        seen: dict[int, torch.Tensor] = {0: h} if 0 in streams else {}
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            h = layer(h, positions, kv_cache, meta)
            if i + 1 in streams:
                seen[i + 1] = h
        return self.norm(h), [seen[i] for i in streams]


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 (text) causal LM; this rank's shard when ``tp.size > 1``. The same
    interface as ``LlamaForCausalLM`` (whose forward and cache it uses); logits are soft-capped
    where the config says so."""

    packed_modules: ClassVar[dict[str, tuple[str, object]]] = LlamaForCausalLM.packed_modules

    tie_by_default = True

    def check_config(self, hf_config: Any) -> str:
        arch = gemma_architecture(hf_config)
        arch = known_architecture(arch, "a Gemma text model", GEMMA_ARCHITECTURES)
        check_gemma_config(hf_config)
        return arch

    def choose_backend(self, backend: AttentionBackend | None) -> AttentionBackend:
        if backend is None:
            return TorchAttentionBackend()
        if not isinstance(backend, TorchAttentionBackend):
            raise InvalidInputError(
                f"attention_backend '{backend.name}' cannot run this model: "
                f"{needs_torch_attention(self.hf_config)}",
                "attention_backend",
            )
        return backend

    def context_window(self, hf_config: Any) -> None:
        return None  # no cap on the context: the sliding layers are windowed

    def build_model(self, hf_config: Any, arch: str, backend: AttentionBackend) -> nn.Module:
        self.final_softcap = float(getattr(hf_config, "final_logit_softcapping", None) or 0) or None
        return GemmaModel(hf_config, arch=arch, tp=self.tp, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> float32 logits ``[N, vocab_size]``, soft-capped."""
        logits = self.lm_head(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def use_cpu_kernels(self, kernels: CpuKernels) -> None:
        """Run the projections, rotary and LM head through specbatch's CPU kernels (norms and
        attention stay in torch)."""
        pack_for_kernels(self, kernels)
