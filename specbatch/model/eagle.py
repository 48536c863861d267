"""EAGLE draft heads: one decoder layer that reads the target's features, in the two layouts
their authors publish for Llama-family targets.

* EAGLE (-1): ``fc(cat(embed(x_{t+1}), f_t))`` -> a decoder layer whose input norm is the
  identity -> ``g_t``, the predicted feature of the next position; the target's LM head turns
  ``g_t`` into q. ``f_t`` is the target's final (normed) hidden state, or the head's own ``g``
  while drafting. Checkpoint: ``fc.weight`` [h, 2h] (``fc.bias`` optional), ``layers.0.*``,
  optionally ``embed_tokens.weight`` (else the target's is used).
* EAGLE-3: the target's feature is ``fc`` of the residual streams entering three of its layers,
  concatenated; the layer attends over ``cat(input_layernorm(embed(x)), hidden_norm(f))`` (its
  q/k/v projections take 2h inputs), a final ``norm`` and an own LM head over a draft vocabulary
  (``d2t[i]``: the target id of draft id i is ``i + d2t[i]``) give q; the next draft step reads
  the pre-norm output. Checkpoint: ``fc.weight`` [h, n*h], ``midlayer.*`` (or ``layers.0.*``),
  ``norm.weight``, ``lm_head.weight``, ``d2t``; config ``eagle_config.
  eagle_aux_hidden_state_layer_ids`` (default: layers 2, L/2 and L-3 of an L-layer target).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from specbatch.distributed.parallel_state import SINGLE
from specbatch.errors import InvalidInputError
from specbatch.kernels.cpu import CpuKernels
from specbatch.kernels.huge_pages import pack_for_kernels
from specbatch.model.checkpoint import ModelConfig, at, load_hf_config
from specbatch.model.cpu_forward import Eagle3HeadPlan
from specbatch.model.layers.attention import AttentionBackend, AttentionMetadata
from specbatch.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from specbatch.model.layers.linear import ColumnParallelLinear
from specbatch.model.layers.norm import RMSNorm
from specbatch.model.layers.rotary import RotaryEmbedding
from specbatch.model.layers.weights import get_weight_loader
from specbatch.model.llama import (
    KVCache,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    head_dim_of,
)

LAYOUTS = ("eagle", "eagle3")


def _tensor_shapes(path: Path) -> dict[str, list[int]]:
    shapes: dict[str, list[int]] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[_local_name(name)] = list(f.get_slice(name).get_shape())
    return shapes


def _local_name(name: str) -> str:
    """A checkpoint tensor's name in ``EagleHead``: prefixes dropped, fused projections kept."""
    for prefix in ("model.", "midlayer.", "layers.0."):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name


def detect_layout(path: str | Path) -> str:
    """'eagle' or 'eagle3', from the checkpoint's tensors."""
    shapes = _tensor_shapes(Path(path))
    if "fc.weight" not in shapes or "self_attn.q_proj.weight" not in shapes:
        raise InvalidInputError(
            f"speculative_config.model: '{path}' is not an EAGLE head (no fc.weight and "
            "layers.0 / midlayer attention)",
            "speculative_config.model",
        )
    fc_in = shapes["fc.weight"][1]
    hidden = shapes["fc.weight"][0]
    if "lm_head.weight" in shapes or shapes["self_attn.q_proj.weight"][1] == 2 * hidden:
        return "eagle3"
    if fc_in != 2 * hidden:
        raise InvalidInputError(
            f"speculative_config.model: '{path}': fc.weight is {shapes['fc.weight']}, expected "
            f"[{hidden}, {2 * hidden}] for an EAGLE head",
            "speculative_config.model",
        )
    return "eagle"


def read_eagle_head(path: str, method: str | None, target: ModelConfig) -> ModelConfig:
    """An EAGLE head's checkpoint, checked against the method asked for (None: either) and the
    target it drafts for; it runs in the target's dtype."""
    name = "speculative_config.model"
    try:
        hf_config = load_hf_config(path, architecture=False)
    except InvalidInputError as e:
        raise at(name, e) from None
    layout = detect_layout(path)
    if method is not None and method != layout:
        raise InvalidInputError(
            f"speculative_config.method: '{path}' holds an {layout.upper()} head; use method "
            f"'{layout}'",
            "speculative_config.method",
        )
    vocab = int(getattr(hf_config, "vocab_size", target.vocab_size))
    if vocab != target.vocab_size:
        raise InvalidInputError(
            f"{name}: vocab_size {vocab} differs from the target's {target.vocab_size}", name
        )
    return ModelConfig(
        str(path), hf_config, None, name, layout=layout, dtype_name=target.dtype_name,
        device=target.device, dtype_of=target.hf_config,
    )  # fmt: skip


def feature_layers(hf_config: Any, target_layers: int) -> tuple[int, ...]:
    """The target layers whose entering residual streams an EAGLE-3 head reads."""
    ids = (getattr(hf_config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids:
        layers = tuple(int(i) for i in ids)
        if any(not 0 <= i <= target_layers for i in layers):
            raise InvalidInputError(
                f"eagle_config.eagle_aux_hidden_state_layer_ids: {list(layers)} must be layers "
                f"0..{target_layers} of the {target_layers}-layer target"
            )
        return layers
    # a target too shallow for the usual choice reads its valid layers nearest to them
    return tuple(min(max(i, 0), target_layers) for i in (2, target_layers // 2, target_layers - 3))


@dataclass
class TargetParts:
    """What a head uses of its target: its embedding and LM head, and its sizes."""

    embed: Callable[[torch.Tensor], torch.Tensor]
    compute_logits: Callable[[torch.Tensor], torch.Tensor]
    vocab_size: int
    hidden_size: int
    num_layers: int

    @staticmethod
    def of(model: LlamaForCausalLM) -> TargetParts:
        return TargetParts(
            model.model.embed_tokens,
            model.compute_logits,
            model.vocab_size,
            model.hidden_size,
            model.num_layers,
        )


class EagleHead(nn.Module):
    """One EAGLE head beside its target (whose embedding and LM head it may share)."""

    def __init__(
        self,
        hf_config: Any,
        layout: str,
        target: TargetParts,
        backend: AttentionBackend,
        *,
        own_embedding: bool,
        fc_bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.layout = layout
        self.target = target
        h = int(hf_config.hidden_size)
        eps = float(hf_config.rms_norm_eps)
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.num_layers = 1
        self.num_heads_local = int(hf_config.num_attention_heads)
        self.num_kv_heads_local = int(getattr(hf_config, "num_key_value_heads", None) or
                                      hf_config.num_attention_heads)  # fmt: skip
        self.head_dim = head_dim_of(hf_config)
        self.attention_backend = backend
        self.embed_tokens = (
            VocabParallelEmbedding(target.vocab_size, h, tp=SINGLE, **kw) if own_embedding else None
        )
        self.streams: tuple[int, ...] = ()
        if layout == "eagle":
            self.fc = ColumnParallelLinear(2 * h, h, bias=fc_bias, tp=SINGLE, **kw)
        else:
            self.streams = feature_layers(hf_config, target.num_layers)
            self.fc = ColumnParallelLinear(
                len(self.streams) * target.hidden_size, h, bias=False, tp=SINGLE, **kw
            )
            self.input_layernorm = RMSNorm(h, eps, **kw)
            self.hidden_norm = RMSNorm(h, eps, **kw)
            self.norm = RMSNorm(h, eps, **kw)
            draft_vocab = int(getattr(hf_config, "draft_vocab_size", None) or target.vocab_size)
            self.lm_head = ParallelLMHead(draft_vocab, h, tp=SINGLE, **kw)
            self.register_buffer(
                "d2t", torch.zeros(draft_vocab, dtype=torch.int64, device=device), persistent=False
            )
        # the draft vocabulary is the target's, id for id (set again once d2t is loaded)
        self.d2t_identity = True
        self.cpu_plan: Eagle3HeadPlan | None = None  # set once the CPU kernels run every op
        self.rotary = RotaryEmbedding.from_config(hf_config, self.head_dim, device)
        self.self_attn = LlamaAttention(
            hf_config,
            qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
            o_bias=bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=False,
            rotary=self.rotary,
            backend=backend,
            tp=SINGLE,
            input_size=2 * h if layout == "eagle3" else None,
            **kw,
        )
        self.post_attention_layernorm = RMSNorm(h, eps, **kw)
        self.mlp = LlamaMLP(
            h,
            int(hf_config.intermediate_size),
            bias=bool(getattr(hf_config, "mlp_bias", False)),
            tp=SINGLE,
            **kw,
        )

    # ---- the two inputs ------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        return self.target.embed(input_ids)

    def from_target(self, features: torch.Tensor) -> torch.Tensor:
        """The head's input feature for target features (EAGLE-3: their fc fusion)."""
        return self.fc(features) if self.layout == "eagle3" else features

    # ---- one pass ------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Position t reads token x_{t+1} and feature f_t (``from_target``'s, or the head's own
        from the previous pass). Returns the feature for the next pass and the hidden states
        that ``compute_logits`` turns into q."""
        if self.layout == "eagle":
            x = self.fc(torch.cat([self.embed(input_ids), features], dim=-1))
            attn = self.self_attn(x, positions, kv_cache, meta)
            y, residual = self.post_attention_layernorm.add_and_norm(attn, x)
            out = self.mlp(y) + residual
            return out, out
        if self.cpu_plan is not None:
            return self.cpu_plan.forward(self.embed(input_ids), features, positions, kv_cache, meta)
        e = self.input_layernorm(self.embed(input_ids))
        attn = self.self_attn(
            torch.cat([e, self.hidden_norm(features)], dim=-1), positions, kv_cache, meta
        )
        y, residual = self.post_attention_layernorm.add_and_norm(attn, features.clone())
        pre = self.mlp(y) + residual
        return pre, self.norm(pre)

    def forward_logits(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` then ``compute_logits`` of every row: the next pass's feature and q's
        logits (one kernel call where the CPU plan covers the LM head)."""
        plan = self.cpu_plan
        if plan is not None and plan.lm_head is not None:
            return plan.forward(self.embed(input_ids), features, positions, kv_cache, meta, True)
        feature, hidden = self(input_ids, features, positions, kv_cache, meta)
        return feature, self.compute_logits(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits over the target's vocabulary (-inf outside an EAGLE-3 draft vocab)."""
        if self.layout == "eagle":
            return self.target.compute_logits(hidden)
        small = self.lm_head(hidden)
        if self.d2t_identity:
            return small
        full = small.new_full((small.shape[0], self.target.vocab_size), float("-inf"))
        ids = torch.arange(small.shape[-1], device=small.device) + self.d2t
        return full.index_copy_(1, ids, small)

    # ---- set-up --------------------------------------------------------------------------
    def use_cpu_kernels(self, kernels: CpuKernels) -> None:
        pack_for_kernels(self, kernels)
        self.cpu_plan = Eagle3HeadPlan.build(self, kernels)

    def kv_cache_bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.fc.weight.dtype).element_size()
        return 2 * self.num_kv_heads_local * self.head_dim * itemsize

    def allocate_kv_caches(
        self, num_blocks: int, block_size: int, device: torch.device | str
    ) -> list[KVCache]:
        k_shape, v_shape = self.attention_backend.kv_cache_shapes(
            num_blocks, block_size, self.num_kv_heads_local, self.head_dim
        )
        dtype = self.post_attention_layernorm.weight.dtype
        return [
            (
                torch.zeros(k_shape, dtype=dtype, device=device),
                torch.zeros(v_shape, dtype=dtype, device=device),
            )
        ]


_PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # fmt: skip


def load_eagle_head(
    head: ModelConfig | str | Path,
    target: TargetParts,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device | str,
) -> EagleHead:
    """An EAGLE head, either layout, from its checkpoint as ``read_eagle_head`` read it (or its
    directory: config.json + safetensors)."""
    if isinstance(head, ModelConfig):
        path, hf_config, layout = Path(head.path), head.hf_config, head.layout
    else:
        path = Path(head)
        try:
            hf_config = load_hf_config(path, architecture=False)
        except InvalidInputError as e:
            raise at("speculative_config.model", e) from None
        layout = detect_layout(path)
    shapes = _tensor_shapes(path)
    if int(hf_config.hidden_size) != shapes["fc.weight"][0]:
        raise InvalidInputError(
            f"speculative_config.model: config hidden_size {hf_config.hidden_size} does not "
            f"match fc.weight {shapes['fc.weight']}",
            "speculative_config.model",
        )
    if layout == "eagle" and int(hf_config.hidden_size) != target.hidden_size:
        raise InvalidInputError(
            f"speculative_config.model: an EAGLE head of hidden_size {hf_config.hidden_size} "
            f"cannot read a target of hidden_size {target.hidden_size}",
            "speculative_config.model",
        )
    head = EagleHead(
        hf_config,
        layout,
        target,
        backend,
        own_embedding="embed_tokens.weight" in shapes,
        fc_bias="fc.bias" in shapes,
        dtype=dtype,
        device=device,
    )
    params = dict(head.named_parameters())
    loaded: set[str] = set()
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for raw in f.keys():  # noqa: SIM118
                name = _local_name(raw)
                if name in ("t2d",) or (
                    name.endswith("input_layernorm.weight") and layout == "eagle"
                ):
                    continue  # EAGLE-1's first layer has no input norm
                if name == "d2t":
                    head.d2t.copy_(f.get_tensor(raw).to(torch.int64))
                    continue
                shard = None
                for hf_part, (ours, sid) in _PACKED.items():
                    if f".{hf_part}." in f".{name}":
                        name, shard = name.replace(hf_part, ours), sid
                param = params.get(name)
                if param is None:
                    continue
                try:
                    get_weight_loader(param)(param, f.get_slice(raw), shard)
                except InvalidInputError as e:
                    raise InvalidInputError(
                        f"speculative_config.model: weight '{raw}' {e}", "speculative_config.model"
                    ) from None
                loaded.add(name)
    if layout == "eagle3":
        head.d2t_identity = head.lm_head.vocab_size == target.vocab_size and not head.d2t.any()
    missing = sorted(set(params) - loaded)
    if missing:
        raise InvalidInputError(
            f"speculative_config.model: the EAGLE head at '{path}' lacks {', '.join(missing)}",
            "speculative_config.model",
        )
    return head.eval()
