"""Decoder layers run as flat sequences of CPU kernel calls: a Llama-family target's stack
(``CpuDecoderPlan``) and an EAGLE-3 head's layer (``Eagle3HeadPlan``).

The module path (every layer's modules, one call each per op) spends more time in Python than
the kernels take at small batches: a module call, a tensor allocation and a few attribute
lookups per op, a dozen ops per layer. A plan resolves every weight's address, shape and flag
once, when the kernels are switched on; a forward is then the same kernel calls with the same
arguments in the same order, into a few buffers the layers share, so its outputs and the K/V it
writes are bit for bit the module path's.

A plan is built only where every op has a kernel: one rank (no all-reduce inside the stack),
packed weights, the CPU attention backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specbatch.kernels.cpu import CpuKernels
from specbatch.model.layers.attention import AttentionMetadata
from specbatch.model.layers.cpu_attention import CpuAttentionBackend
from specbatch.model.layers.linear import PackableLinear


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class _Linear:
    """A packed linear layer: its panels and its bias parameter, whose address is read at
    every call (a parameter may be re-pointed after the plan is built, e.g. to share weights)."""

    def __init__(self, layer: PackableLinear) -> None:
        assert layer.packed is not None
        self.panels = layer.packed.panels
        self.bias: torch.Tensor | None = getattr(layer, "bias", None)
        self.n, self.k = layer.packed.out_features, layer.packed.in_features

    @staticmethod
    def of(layer: PackableLinear) -> _Linear | None:
        return None if layer.packed is None else _Linear(layer)

    def pointers(self) -> tuple[int, int | None]:
        return self.panels.data_ptr(), _ptr(self.bias)


@dataclass(frozen=True, eq=False)
class _Layer:
    """One decoder layer's weights: input norm (None: the caller norms), attention, MLP."""

    in_norm: torch.Tensor | None
    qkv: _Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: _Linear
    post_norm: torch.Tensor
    gate_up: _Linear
    down: _Linear

    @staticmethod
    def of(attn: Any, mlp: Any, in_norm: Any, post_norm: Any) -> _Layer | None:
        """None unless every op of the layer runs on a kernel on one rank."""
        norms = [n for n in (in_norm, post_norm, attn.q_norm, attn.k_norm) if n is not None]
        if not isinstance(attn.backend, CpuAttentionBackend) or attn.qkv_proj.tp.size != 1:
            return None
        if any(n.kernels is None for n in norms) or attn.rotary.kernels is None:
            return None
        qkv, o = _Linear.of(attn.qkv_proj), _Linear.of(attn.o_proj)
        gate_up, down = _Linear.of(mlp.gate_up_proj), _Linear.of(mlp.down_proj)
        if qkv is None or o is None or gate_up is None or down is None:
            return None
        return _Layer(
            in_norm.weight if in_norm is not None else None,
            qkv,
            attn.q_norm.weight if attn.q_norm is not None else None,
            attn.k_norm.weight if attn.k_norm is not None else None,
            o,
            post_norm.weight,
            gate_up,
            down,
        )


class _FlatLayers:
    """The kernel calls of a decoder layer's parts, shared by the plans."""

    def __init__(self, kernels: CpuKernels, attn: Any, eps: float) -> None:
        self.m = kernels._m
        self.dtype = attn.o_proj.packed.panels.dtype
        self.bf16 = int(self.dtype == torch.bfloat16)
        self.eps = eps
        self.heads = attn.qkv_proj.num_heads_local
        self.kv_heads = attn.qkv_proj.num_kv_heads_local
        self.head_dim = attn.qkv_proj.head_dim
        self.scale = float(attn.scale)
        self.rotary = attn.rotary

    def new(self, rows: int, cols: int) -> torch.Tensor:
        return torch.empty((rows, cols), dtype=self.dtype)

    def scratch(self, ws: dict[str, torch.Tensor], name: str, rows: int, cols: int) -> torch.Tensor:
        """A buffer of one forward that every layer reuses."""
        buf = ws.get(name)
        if buf is None:
            buf = ws[name] = self.new(rows, cols)
        return buf

    def norm(self, t: int, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
             residual: torch.Tensor | None = None) -> None:  # fmt: skip
        """RMSNorm of the rows of ``x`` (of ``x + residual``, stored into ``residual``)."""
        self.m.rms_norm(t, x.shape[1], x.data_ptr(), x.stride(0), _ptr(residual),
                        weight.data_ptr(), self.eps, out.data_ptr(), self.bf16)  # fmt: skip

    def linear(self, t: int, lin: _Linear, x: torch.Tensor, y: torch.Tensor) -> None:
        panels, bias = lin.pointers()
        if self.bf16:
            self.m.linear_bf16(t, lin.n, lin.k, x.data_ptr(), x.stride(0), panels, bias,
                               y.data_ptr(), lin.n, 0)  # fmt: skip
        else:
            self.m.linear_f32(t, lin.n, lin.k, x.data_ptr(), x.stride(0), panels, bias,
                              y.data_ptr(), lin.n)  # fmt: skip

    def attention(
        self,
        t: int,
        lay: _Layer,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        out: torch.Tensor,
        ws: dict[str, torch.Tensor],
    ) -> None:
        """q/k/v of the normed input ``x``, their rotation, the K/V write and attention over
        the paged cache, then the output projection into ``out``."""
        m, bf16, eps = self.m, self.bf16, self.eps
        hq, hkv, d = self.heads, self.kv_heads, self.head_dim
        qkv = self.scratch(ws, "qkv", t, lay.qkv.n)
        self.linear(t, lay.qkv, x, qkv)
        ld, q = lay.qkv.n, qkv.data_ptr()
        esz = qkv.element_size()
        k, v = q + hq * d * esz, q + (hq + hkv) * d * esz
        if lay.q_norm is not None and lay.k_norm is not None:
            m.head_rms_norm(t, hq, d, q, ld, lay.q_norm.data_ptr(), eps, bf16)
            m.head_rms_norm(t, hkv, d, k, ld, lay.k_norm.data_ptr(), eps, bf16)
        cos, sin = self.rotary.cos.data_ptr(), self.rotary.sin.data_ptr()
        pos = positions.data_ptr()
        m.rope(t, hq, d, q, ld, pos, cos, sin, bf16)
        m.rope(t, hkv, d, k, ld, pos, cos, sin, bf16)
        k_cache, v_cache = cache
        bs, kc, vc = k_cache.shape[3], k_cache.data_ptr(), v_cache.data_ptr()
        m.write_kv(t, hkv, d, k, ld, v, ld, meta.slot_mapping.data_ptr(), kc, vc, bs, bf16)
        attn = self.scratch(ws, "attn", t, hq * d)
        m.paged_attention(
            meta.seq_lens.shape[0], meta.query_start_loc.data_ptr(), meta.seq_lens.data_ptr(),
            meta.block_tables.data_ptr(), meta.block_tables.stride(0), q, ld, hq,
            k_cache.shape[1], d, kc, vc, bs, self.scale, attn.data_ptr(),
            _ptr(meta.tree_masks), _ptr(meta.tree_starts), bf16,
        )  # fmt: skip
        self.linear(t, lay.o, attn, out)

    def mlp(
        self, t: int, lay: _Layer, x: torch.Tensor, out: torch.Tensor, ws: dict[str, torch.Tensor]
    ) -> None:
        gate_up = self.scratch(ws, "gate_up", t, lay.gate_up.n)
        act = self.scratch(ws, "act", t, lay.gate_up.n // 2)
        self.linear(t, lay.gate_up, x, gate_up)
        self.m.silu_and_mul(t, lay.gate_up.n // 2, gate_up.data_ptr(), act.data_ptr(), self.bf16)
        self.linear(t, lay.down, act, out)


class CpuDecoderPlan(_FlatLayers):
    """The decoder layers and final norm of one ``LlamaModel``."""

    def __init__(self, kernels: CpuKernels, model: Any, layers: list[_Layer]) -> None:
        super().__init__(kernels, model.layers[0].self_attn, float(model.norm.eps))
        self.layers = layers
        self.final_norm = model.norm.weight

    @classmethod
    def build(cls, model: Any, kernels: CpuKernels) -> CpuDecoderPlan | None:
        """The plan, or None where an op of the stack would not run on a kernel."""
        if model.norm.kernels is None:
            return None
        layers = []
        for layer in model.layers:
            lay = _Layer.of(layer.self_attn, layer.mlp, layer.input_layernorm,
                            layer.post_attention_layernorm)  # fmt: skip
            if lay is None or layer.self_attn.rotary is not model.rotary_emb:
                return None
            layers.append(lay)
        return cls(kernels, model, layers)

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        streams: tuple[int, ...],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``h``: the embedded tokens ``[T, hidden]``, contiguous, which becomes the residual
        stream's buffer. Returns what ``LlamaModel.forward`` returns."""
        t, hidden = h.shape
        normed, proj, x = self.new(t, hidden), self.new(t, hidden), self.new(t, hidden)
        seen: dict[int, torch.Tensor] = {0: h.clone()} if 0 in streams else {}
        residual, ws = h, {}
        for i, (lay, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            assert lay.in_norm is not None
            if i == 0:
                self.norm(t, h, lay.in_norm, normed)
            else:
                self.norm(t, x, lay.in_norm, normed, residual)
            self.attention(t, lay, normed, positions, cache, meta, proj, ws)
            self.norm(t, proj, lay.post_norm, normed, residual)
            self.mlp(t, lay, normed, x, ws)
            if i + 1 in streams:
                seen[i + 1] = x + residual
        final = self.new(t, hidden)
        self.norm(t, x, self.final_norm, final, residual)
        return final, [seen[i] for i in streams]


class Eagle3HeadPlan(_FlatLayers):
    """An EAGLE-3 head's pass (``EagleHead.forward``) up to its final norm."""

    def __init__(self, kernels: CpuKernels, head: Any, layer: _Layer) -> None:
        super().__init__(kernels, head.self_attn, float(head.norm.eps))
        self.layer = layer
        self.embed_norm = head.input_layernorm.weight
        self.feature_norm = head.hidden_norm.weight
        self.final_norm = head.norm.weight

    @classmethod
    def build(cls, head: Any, kernels: CpuKernels) -> Eagle3HeadPlan | None:
        if head.layout != "eagle3":
            return None
        if any(n.kernels is None for n in (head.input_layernorm, head.hidden_norm, head.norm)):
            return None
        layer = _Layer.of(head.self_attn, head.mlp, None, head.post_attention_layernorm)
        return None if layer is None else cls(kernels, head, layer)

    def forward(
        self,
        embedded: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t, hidden = features.shape
        if features.stride(-1) != 1:
            features = features.contiguous()
        e, f = self.new(t, hidden), self.new(t, hidden)
        self.norm(t, embedded, self.embed_norm, e)
        self.norm(t, features, self.feature_norm, f)
        attn, ws = self.new(t, hidden), {}
        self.attention(t, self.layer, torch.cat([e, f], dim=-1), positions, cache, meta, attn, ws)
        residual, normed = features.clone(), self.new(t, hidden)
        self.norm(t, attn, self.layer.post_norm, normed, residual)
        down = self.new(t, hidden)
        self.mlp(t, self.layer, normed, down, ws)
        pre = down + residual
        out = self.new(t, hidden)
        self.norm(t, pre, self.final_norm, out)
        return pre, out
