"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE) over a paged KV cache,
tensor-parallel.

Attention is the Llama family's (``llama.py``; Qwen3-MoE norms q and k per head, Qwen2-MoE
biases q, k and v); the MLP of a sparse layer is a router over ``E`` experts, each row taking
its top ``k`` (``layers/experts.py``: the rows grouped by expert), plus, where the config has
one (Qwen2-MoE), a shared expert scaled by a sigmoid gate. Qwen's ``decoder_sparse_step`` and
``mlp_only_layers`` leave some layers with a dense MLP.

Tensor parallelism splits every expert's intermediate dimension across the ranks, as vLLM does
(each rank holds a slice of every expert; the router is replicated, every rank routes alike,
and the experts' partial sums are reduced once per layer), rather than placing whole experts on
ranks: the split keeps each rank's share of a step's weight reads equal whichever experts wake.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specbatch.distributed.parallel_state import SINGLE, TensorParallelGroup
from specbatch.errors import InvalidInputError
from specbatch.kernels.cpu import CpuKernels
from specbatch.kernels.huge_pages import pack_for_kernels
from specbatch.model.layers.attention import AttentionBackend
from specbatch.model.layers.experts import ExpertMLP, grouped_experts, route
from specbatch.model.layers.linear import ColumnParallelLinear
from specbatch.model.layers.rotary import RotaryEmbedding
from specbatch.model.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    head_dim_of,
    known_architecture,
)

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
_BY_MODEL_TYPE = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def moe_architecture(hf_config: Any) -> str | None:
    """The config's architecture if it is a mixture of experts this module runs, else None."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if archs:
        return next((a for a in archs if a in MOE_ARCHITECTURES), None)
    return _BY_MODEL_TYPE.get(getattr(hf_config, "model_type", None) or "")


@dataclass(frozen=True)
class MoeSettings:
    """What a config says of its experts."""

    arch: str
    num_experts: int
    top_k: int
    expert_size: int  # each expert's intermediate size
    renormalise: bool  # the top k probabilities scaled to sum to 1
    shared_size: int  # the shared expert's intermediate size (0: none)
    sparse: tuple[bool, ...]  # per layer: experts (True) or a dense MLP
    dense_size: int  # a dense layer's intermediate size

    @property
    def module(self) -> str:
        """The checkpoint's name of a layer's MLP."""
        return "block_sparse_moe" if self.arch == "MixtralForCausalLM" else "mlp"


def _int(hf_config: Any, arch: str, name: str, minimum: int = 1) -> int:
    v = getattr(hf_config, name, None)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise InvalidInputError(f"{arch}: '{name}' must be an integer >= {minimum}, got {v!r}")
    return v


def moe_settings(hf_config: Any) -> MoeSettings:
    """The experts of a (Mixtral / Qwen2-MoE / Qwen3-MoE) config, checked."""
    arch = known_architecture(
        moe_architecture(hf_config), "a mixture of experts", MOE_ARCHITECTURES
    )
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise InvalidInputError(f"hidden_act '{act}' is not supported for {arch}; supported: silu")
    layers = int(hf_config.num_hidden_layers)
    dense = int(hf_config.intermediate_size)
    if arch == "MixtralForCausalLM":
        experts = _int(hf_config, arch, "num_local_experts")
        top_k = _int(hf_config, arch, "num_experts_per_tok")
        size, renormalise, shared = dense, True, 0
        sparse = (True,) * layers
    else:
        experts = _int(hf_config, arch, "num_experts")
        top_k = _int(hf_config, arch, "num_experts_per_tok")
        size = _int(hf_config, arch, "moe_intermediate_size")
        renormalise = bool(getattr(hf_config, "norm_topk_prob", False))
        shared = 0
        if arch == "Qwen2MoeForCausalLM":
            shared = _int(hf_config, arch, "shared_expert_intermediate_size", minimum=0)
        step = _int(hf_config, arch, "decoder_sparse_step")
        only = set(getattr(hf_config, "mlp_only_layers", None) or ())
        sparse = tuple(i not in only and (i + 1) % step == 0 for i in range(layers))
    if top_k > experts:
        raise InvalidInputError(
            f"{arch}: num_experts_per_tok={top_k} is more than the {experts} experts"
        )
    return MoeSettings(arch, experts, top_k, size, renormalise, shared, sparse, dense)


def moe_sliding_window(hf_config: Any) -> int | None:
    """The attention window if the model uses one (not implemented: it caps the context)."""
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return None
    if moe_architecture(hf_config) != "MixtralForCausalLM" and not getattr(
        hf_config, "use_sliding_window", False
    ):
        return None
    return int(window)


class SparseMoeBlock(nn.Module):
    """Router, experts (and a gated shared expert where the config has one); the output is
    the sum over ranks, in the input's dtype."""

    def __init__(
        self,
        hidden_size: int,
        settings: MoeSettings,
        *,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        kw: dict[str, Any] = {"tp": tp, "dtype": dtype, "device": device}
        self.tp = tp
        self.top_k, self.renormalise = settings.top_k, settings.renormalise
        replicated: dict[str, Any] = {"bias": False, "tp": SINGLE, "dtype": dtype,
                                      "device": device}  # fmt: skip
        self.gate = ColumnParallelLinear(hidden_size, settings.num_experts, **replicated)
        self.experts = nn.ModuleList(
            ExpertMLP(hidden_size, settings.expert_size, **kw) for _ in range(settings.num_experts)
        )
        self.shared_expert: ExpertMLP | None = None
        self.shared_expert_gate: ColumnParallelLinear | None = None
        if settings.shared_size:
            self.shared_expert = ExpertMLP(hidden_size, settings.shared_size, **kw)
            self.shared_expert_gate = ColumnParallelLinear(hidden_size, 1, **replicated)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalise)
        out = grouped_experts(x, weights, ids, self.experts)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out += (gate * self.shared_expert(x)).float()
        out = out.to(x.dtype)
        return out if self.tp.size == 1 else self.tp.all_reduce(out)


class MoeForCausalLM(LlamaForCausalLM):
    """Mixtral / Qwen2-MoE / Qwen3-MoE causal LM; this rank's shard when ``tp.size > 1``. The
    same interface as ``LlamaForCausalLM`` (whose forward, logits and cache it uses)."""

    def check_config(self, hf_config: Any) -> str:
        self.moe = moe_settings(hf_config)
        return self.moe.arch

    def context_window(self, hf_config: Any) -> int | None:
        return moe_sliding_window(hf_config)

    def build_model(self, hf_config: Any, arch: str, backend: AttentionBackend) -> nn.Module:
        # Mixtral names an expert's gate, down and up projections w1, w2 and w3
        self.packed_modules = dict(LlamaForCausalLM.packed_modules)
        if arch == "MixtralForCausalLM":  # first: a missing weight is named by them
            mixtral = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
                       "w2": ("down_proj", None)}  # fmt: skip
            self.packed_modules = {**mixtral, **self.packed_modules}
        settings = self.moe
        kw: dict[str, Any] = {"dtype": self.dtype, "device": self.device}
        hidden, tp = int(hf_config.hidden_size), self.tp
        rotary = RotaryEmbedding.from_config(hf_config, head_dim_of(hf_config), self.device)
        qwen2 = arch == "Qwen2MoeForCausalLM"
        bias = bool(getattr(hf_config, "attention_bias", False))

        def layer(i: int) -> nn.Module:
            attn = LlamaAttention(
                hf_config, qkv_bias=qwen2 or bias, o_bias=bias and not qwen2,
                qk_norm=arch == "Qwen3MoeForCausalLM", rotary=rotary,
                backend=backend, tp=tp, **kw,
            )  # fmt: skip
            mlp: nn.Module
            if settings.sparse[i]:
                mlp = SparseMoeBlock(hidden, settings, tp=tp, **kw)
            else:
                mlp = LlamaMLP(hidden, settings.dense_size, bias=False, tp=tp, **kw)
            # the MLP under the checkpoint's name (Mixtral's block_sparse_moe, Qwen's mlp)
            return LlamaDecoderLayer(hf_config, attn, mlp, settings.module, **kw)

        # the forward is LlamaModel's module path: the CPU plan's layer kernel runs dense MLPs only
        return LlamaModel(hf_config, rotary, layer, tp=tp, **kw)

    def use_cpu_kernels(self, kernels: CpuKernels) -> None:
        """Run the projections, experts, rotary and LM head through specbatch's CPU kernels,
        layer by layer."""
        pack_for_kernels(self, kernels)


def moe_gguf_fields(reader: Any, file: Any, arch: str) -> tuple[str, str, dict[str, Any]]:
    """A llama.cpp file's experts as transformers config fields, with the config class and
    architecture: "llama" with ``expert_count`` is Mixtral (``feed_forward_length`` is each
    expert's size), "qwen3moe" is Qwen3-MoE (``expert_feed_forward_length``; the top-k
    renormalised unless ``expert_weights_norm`` says otherwise, as llama.cpp assumes; a layer
    without a router tensor has a dense MLP)."""

    def count(key: str, required: bool = True) -> int | None:
        v = reader.fields.get(f"{arch}.{key}")
        if v is None and not required:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            shown = "it is absent" if v is None else f"got {str(v)[:60]!r}"
            raise InvalidInputError(
                f"'{file}': metadata '{arch}.{key}' must be an integer >= 1; {shown}"
            )
        return v

    experts, top_k = count("expert_count"), count("expert_used_count")
    if arch == "llama":
        fields = {"num_local_experts": experts, "num_experts_per_tok": top_k}
        return "MixtralConfig", "MixtralForCausalLM", fields
    if arch != "qwen3moe":
        raise InvalidInputError(
            f"'{file}': {arch}.expert_count={experts}: experts are supported in 'llama' "
            "(Mixtral) and 'qwen3moe' files only"
        )
    layers = count("block_count")
    routed = {
        t.name.split(".")[1] for t in reader.tensors if t.name.endswith("ffn_gate_inp.weight")
    }
    norm = reader.fields.get(f"{arch}.expert_weights_norm")
    fields = {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": count("expert_feed_forward_length"),
        "norm_topk_prob": True if norm is None else bool(norm),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(layers or 0) if str(i) not in routed],
    }
    return "Qwen3MoeConfig", "Qwen3MoeForCausalLM", fields


class ExpertSlice:
    """One expert's matrix of a GGUF file's stacked expert tensor ``[E, ...]``, as a lazy
    slice (the stacked tensor is read once, when first indexed)."""

    def __init__(self, stacked: Any, expert: int) -> None:
        self.stacked, self.expert = stacked, expert

    def get_shape(self) -> list[int]:
        return list(self.stacked.get_shape()[1:])

    def __getitem__(self, index: Any) -> torch.Tensor:
        rest = index if isinstance(index, tuple) else (index,)
        return self.stacked[(self.expert, *rest)]


_EXPERT_PARTS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
_PART_NAMES = {"MixtralForCausalLM": ("w1", "w3", "w2"),
               "Qwen3MoeForCausalLM": ("gate_proj", "up_proj", "down_proj")}  # fmt: skip


def expert_tensors(gguf_name: str, tensor: Any, hf_config: Any) -> list[tuple[str, Any]]:
    """A GGUF file's router (``ffn_gate_inp``) and stacked expert tensors under the Hugging
    Face names of a layer's router and of each expert's projections; any other tensor under
    its own name (the loader lists it as unexpected)."""
    settings = moe_settings(hf_config)
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk":
        return [(gguf_name, tensor)]
    prefix = f"model.layers.{parts[1]}.{settings.module}"
    if parts[2] == "ffn_gate_inp":
        return [(f"{prefix}.gate.{parts[3]}", tensor)]
    if parts[2] not in _EXPERT_PARTS:
        return [(gguf_name, tensor)]
    part = _PART_NAMES[settings.arch][_EXPERT_PARTS[parts[2]]]
    return [
        (f"{prefix}.experts.{e}.{part}.{parts[3]}", ExpertSlice(tensor, e))
        for e in range(tensor.get_shape()[0])
    ]
