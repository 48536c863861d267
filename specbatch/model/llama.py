"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache, tensor-parallel.

One class covers the four architectures; they differ only in a few switches read from the config:
which projections carry a bias, whether q and k get a per-head RMSNorm (Qwen3), tied embeddings,
an explicit ``head_dim``, and the rope settings. The model holds only weights: the KV caches and
the attention metadata are passed to every forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from specbatch.distributed.parallel_state import SINGLE, TensorParallelGroup
from specbatch.errors import InvalidInputError
from specbatch.kernels.cpu import CpuKernels
from specbatch.kernels.huge_pages import pack_for_kernels
from specbatch.model.cpu_forward import CpuDecoderPlan
from specbatch.model.layers.activation import SiluAndMul
from specbatch.model.layers.attention import AttentionBackend, AttentionMetadata
from specbatch.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from specbatch.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    divide,
)
from specbatch.model.layers.norm import RMSNorm
from specbatch.model.layers.rotary import RotaryEmbedding

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

KVCache = tuple[torch.Tensor, torch.Tensor]


def architecture_of(hf_config: Any) -> str:
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:
        by_type = {"llama": 0, "mistral": 1, "qwen2": 2, "qwen3": 3}
        model_type = getattr(hf_config, "model_type", None)
        if model_type in by_type:
            return SUPPORTED_ARCHITECTURES[by_type[model_type]]
        return f"(none listed; model_type '{model_type}')"
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    return archs[0]


def known_architecture(arch: str | None, kind: str, supported: Sequence[str]) -> str:
    """``arch``, a family's architecture found in a config, unless None (then an error: the
    config is not ``kind``, and the family runs ``supported``)."""
    if arch is None:
        raise InvalidInputError(f"not {kind}; supported: {', '.join(supported)}")
    return arch


def check_architecture(hf_config: Any) -> str:
    """The config's architecture, if this module implements it (and its activation)."""
    arch = architecture_of(hf_config)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise InvalidInputError(
            f"architecture '{arch}' is not supported; supported: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise InvalidInputError(f"hidden_act '{act}' is not supported; supported: silu")
    return arch


def head_dim_of(hf_config: Any) -> int:
    return int(
        getattr(hf_config, "head_dim", None)
        or hf_config.hidden_size // hf_config.num_attention_heads
    )


def num_kv_heads_of(hf_config: Any) -> int:
    return int(getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)


def sliding_window_of(hf_config: Any) -> int | None:
    """The attention window if any layer uses one (not implemented: cap max_model_len to it)."""
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return None
    if getattr(hf_config, "model_type", None) in ("qwen2", "qwen3"):
        layer_types = getattr(hf_config, "layer_types", None)
        uses = getattr(hf_config, "use_sliding_window", False)
        if layer_types is not None:
            uses = uses and "sliding_attention" in layer_types
        return int(window) if uses else None
    return int(window)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        device: torch.device | str,
        input_size: int | None = None,
    ) -> None:
        """``input_size``: the width of the layer's input when it is not ``hidden_size`` (an
        EAGLE-3 head attends over token embedding and feature side by side)."""
        super().__init__()
        self.head_dim = head_dim_of(hf_config)
        num_heads = int(hf_config.num_attention_heads)
        self.qkv_proj = QKVParallelLinear(
            input_size or int(hf_config.hidden_size),
            self.head_dim,
            num_heads,
            num_kv_heads_of(hf_config),
            bias=qkv_bias,
            tp=tp,
            dtype=dtype,
            device=device,
        )
        self.o_proj = RowParallelLinear(
            num_heads * self.head_dim,
            int(hf_config.hidden_size),
            bias=o_bias,
            tp=tp,
            dtype=dtype,
            device=device,
        )
        eps = float(hf_config.rms_norm_eps)
        self.q_norm = RMSNorm(self.head_dim, eps, dtype=dtype, device=device) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, dtype=dtype, device=device) if qk_norm else None
        self.rotary = rotary  # one module shared by all layers (its cos/sin are not weights)
        self.backend = backend
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.norm_heads_(q), self.k_norm.norm_heads_(k)
        q, k = self.rotary(positions, q, k)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(out.shape[0], -1))


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        bias: bool,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        kw: dict[str, Any] = {"bias": bias, "tp": tp, "dtype": dtype, "device": device}
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], **kw
        )
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Norm, attention, norm, MLP; the MLP under ``mlp_name``, the checkpoint's name for it
    (Mixtral's ``block_sparse_moe``)."""

    def __init__(
        self, hf_config: Any, attn: LlamaAttention, mlp: nn.Module, mlp_name: str = "mlp", **kw: Any
    ) -> None:
        super().__init__()
        hidden, eps = int(hf_config.hidden_size), float(hf_config.rms_norm_eps)
        self.input_layernorm = RMSNorm(hidden, eps, **kw)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(hidden, eps, **kw)
        self.mlp_name = mlp_name
        self.add_module(mlp_name, mlp)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output and the residual stream before it (``None`` at the first layer):
        the stream after the layer is their sum, added by the next norm."""
        x, residual = self.input_layernorm.add_and_norm(h, residual)
        x = self.self_attn(x, positions, kv_cache, meta)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self._modules[self.mlp_name](x), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm (parameter names follow the HF ``model.`` prefix):
    ``rotary`` (one module shared by all layers) and ``make_layer(i)`` for each layer ``i``
    (each family's ``build_model`` passes its own)."""

    def __init__(
        self,
        hf_config: Any,
        rotary: RotaryEmbedding,
        make_layer: Callable[[int], nn.Module],
        *,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        hidden = int(hf_config.hidden_size)
        self.embed_tokens = VocabParallelEmbedding(int(hf_config.vocab_size), hidden, tp=tp, **kw)
        self.rotary_emb = rotary
        self.layers = nn.ModuleList(make_layer(i) for i in range(int(hf_config.num_hidden_layers)))
        self.norm = RMSNorm(hidden, float(hf_config.rms_norm_eps), **kw)
        self.cpu_plan: CpuDecoderPlan | None = None  # set once the CPU kernels run every op

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        streams: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final-normed hidden states, and the residual stream entering each layer of
        ``streams`` in that order, repeats included (``len(layers)``: the stream after the last
        one), for an EAGLE-3 head."""
        h = self.embed_tokens(input_ids)
        if self.cpu_plan is not None:
            return self.cpu_plan.forward(h, positions, kv_caches, meta, streams)
        residual: torch.Tensor | None = None
        seen: dict[int, torch.Tensor] = {0: h.clone()} if 0 in streams else {}
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            h, residual = layer(h, residual, positions, kv_cache, meta)
            if i + 1 in streams:
                seen[i + 1] = h + residual
        return self.norm.add_and_norm(h, residual)[0], [seen[i] for i in streams]


def take_shape(model: nn.Module, hf_config: Any, tp: TensorParallelGroup) -> None:
    """The sizes a causal LM exposes to the engine (its vocabulary, hidden size, heads on this
    rank, layers, positions), read off ``hf_config``."""
    model.vocab_size = int(hf_config.vocab_size)
    model.hidden_size = int(hf_config.hidden_size)
    model.head_dim = head_dim_of(hf_config)
    model.num_layers = int(hf_config.num_hidden_layers)
    heads = int(hf_config.num_attention_heads)
    model.num_heads_local = divide(heads, tp.size, "num_attention_heads")
    model.num_kv_heads_local = divide(num_kv_heads_of(hf_config), tp.size, "num_key_value_heads")
    model.max_position_embeddings = int(hf_config.max_position_embeddings)


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM; this rank's shard when ``tp.size > 1``.

    Parameters are allocated uninitialised on ``device`` in ``dtype``; ``load_weights`` (through
    :func:`specbatch.model.loader.load_model`) fills them.
    """

    # HF checkpoint name -> (our fused parameter, shard id)
    packed_modules: ClassVar[dict[str, tuple[str, object]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        hf_config: Any,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallelGroup = SINGLE,
        attention_backend: AttentionBackend | None = None,
    ) -> None:
        super().__init__()
        arch = self.check_config(hf_config)
        self.hf_config = hf_config
        self.architecture = arch
        self.dtype = dtype
        self.device = torch.device(device)
        self.tp = tp
        self.attention_backend = attention_backend = self.choose_backend(attention_backend)
        take_shape(self, hf_config, tp)
        self.sliding_window = self.context_window(hf_config)
        self.tie_word_embeddings = bool(
            getattr(hf_config, "tie_word_embeddings", self.tie_by_default)
        )

        self.model = self.build_model(hf_config, arch, attention_backend)
        self.lm_head = ParallelLMHead(
            self.vocab_size,
            self.hidden_size,
            tp=tp,
            dtype=dtype,
            device=device,
            tied_weight=self.model.embed_tokens.weight if self.tie_word_embeddings else None,
        )

    # What a family changes (MoE, Phi-3 and Gemma subclass this class): ------------------------

    tie_by_default: ClassVar[bool] = False  # the head is the embedding where the config is silent

    def check_config(self, hf_config: Any) -> str:
        """The config's architecture, if this class runs it (else InvalidInputError)."""
        return check_architecture(hf_config)

    def choose_backend(self, backend: AttentionBackend | None) -> AttentionBackend:
        """``backend``, or where it is None the one chosen for the device, dtype and head size
        (``self.hf_config``, ``dtype`` and ``device`` are set)."""
        if backend is not None:
            return backend
        from specbatch.model.layers.backend_choice import select_backend

        head_dim = head_dim_of(self.hf_config)
        return select_backend(self.device, dtype=self.dtype, head_dim=head_dim)

    def context_window(self, hf_config: Any) -> int | None:
        """The attention window that caps the context (``sliding_window``), if any."""
        return sliding_window_of(hf_config)

    def build_model(self, hf_config: Any, arch: str, backend: AttentionBackend) -> nn.Module:
        """The decoder (``self.model``: embedding, layers, final norm), once the shape and
        the attributes above are set."""
        kw: dict[str, Any] = {"dtype": self.dtype, "device": self.device}
        hidden, tp = int(hf_config.hidden_size), self.tp
        rotary = RotaryEmbedding.from_config(hf_config, head_dim_of(hf_config), self.device)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(getattr(hf_config, "attention_bias", False))

        def layer(_: int) -> nn.Module:
            attn = LlamaAttention(
                hf_config,
                qkv_bias=is_qwen2 or attention_bias,
                o_bias=attention_bias and not is_qwen2,
                qk_norm=arch == "Qwen3ForCausalLM",
                rotary=rotary,
                backend=backend,
                tp=tp,
                **kw,
            )
            mlp = LlamaMLP(
                hidden,
                int(hf_config.intermediate_size),
                bias=bool(getattr(hf_config, "mlp_bias", False)),
                tp=tp,
                **kw,
            )
            return LlamaDecoderLayer(hf_config, attn, mlp, **kw)

        return LlamaModel(hf_config, rotary, layer, tp=tp, **kw)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions ``[T]`` int64 -> final-normed hidden states ``[T, hidden]``.

        Writes the new tokens' K/V into ``kv_caches`` (one ``(k, v)`` pair per layer, in the
        attention backend's layout, in the model dtype).
        """
        return self.model(input_ids, positions, kv_caches, meta)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> float32 logits ``[N, vocab_size]`` (full vocabulary on each rank)."""
        return self.lm_head(hidden)

    def use_cpu_kernels(self, kernels: CpuKernels) -> None:
        """Run the layers through specbatch's CPU kernels (the weights must be loaded)."""
        pack_for_kernels(self, kernels)
        self.model.cpu_plan = CpuDecoderPlan.build(self.model, kernels)

    def kv_cache_bytes_per_token(self, cache_dtype: torch.dtype | None = None) -> int:
        """Bytes one token costs in this rank's cache: K and V, every layer."""
        itemsize = torch.empty((), dtype=cache_dtype or self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads_local * self.head_dim * itemsize

    def allocate_kv_caches(
        self, num_blocks: int, block_size: int, device: torch.device | str | None = None
    ) -> list[KVCache]:
        """Zero-filled caches for every layer, in the attention backend's layout (zeros, so
        padded reads in the reference backend never meet NaN bit patterns)."""
        k_shape, v_shape = self.attention_backend.kv_cache_shapes(
            num_blocks, block_size, self.num_kv_heads_local, self.head_dim
        )
        dev = self.device if device is None else device
        return [
            (
                torch.zeros(k_shape, dtype=self.dtype, device=dev),
                torch.zeros(v_shape, dtype=self.dtype, device=dev),
            )
            for _ in range(self.num_layers)
        ]
