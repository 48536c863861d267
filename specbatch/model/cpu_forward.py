"""Decoder layers run as a few CPU kernel calls: a Llama-family target's stack
(``CpuDecoderPlan``) and an EAGLE-3 head's pass (``Eagle3HeadPlan``), or its whole drafting call.

The module path (every layer's modules, one call each per op) spends more time in Python than
the kernels take at small batches: a module call, a tensor allocation and a few attribute
lookups per op, a dozen ops per layer. A plan resolves every weight's address, shape and flag
once, when the kernels are switched on: a layer's attention and MLP are then one kernel call
(``csrc/layer.c``) reading the layer's weights from a descriptor of their addresses (written
again by ``refresh`` after weights are re-pointed, as engines sharing one copy do), the
target's layers with their norms one call for the whole stack (or one per stretch between the
residual streams a drafter reads), and a head's pass one more. They run the module path's
kernels in the same order on the same values, so the outputs and the K/V written are bit for
bit the module path's.

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
    """A packed linear layer: its panels (or its weight kept as GGUF blocks, ``quant``) and its
    bias parameter."""

    def __init__(self, layer: PackableLinear) -> None:
        weight = layer.packed if layer.packed is not None else layer.quant
        assert weight is not None
        self.panels = layer.packed.panels if layer.packed is not None else None
        self.quant = layer.quant.desc if layer.quant is not None else None
        self.dtype = layer.weight.dtype
        self.bias: torch.Tensor | None = getattr(layer, "bias", None)
        self.n, self.k = weight.out_features, weight.in_features

    @staticmethod
    def of(layer: PackableLinear) -> _Linear | None:
        return None if layer.packed is None and layer.quant is None else _Linear(layer)

    def fields(self) -> list[int]:
        """The descriptor's two fields: panels (0: kept quantized), bias (0: none)."""
        return [_ptr(self.panels) or 0, _ptr(self.bias) or 0]


@dataclass(frozen=True, eq=False)
class _Descriptor:
    """A layer's descriptor for csrc/layer.c and the storage of the tensors whose addresses it
    holds, kept alive: a weight re-pointed after it was written stays readable (the old copy)
    until the plan's ``refresh``."""

    fields: torch.Tensor
    held: tuple[torch.Tensor, ...]


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

    def descriptor(self, flat: _FlatLayers) -> _Descriptor:
        """csrc/layer.c's LAYER_* fields of this layer: sizes, then addresses."""
        linears = (self.qkv, self.o, self.gate_up, self.down)
        tensors = (self.qkv.panels, self.qkv.bias, self.q_norm, self.k_norm, self.o.panels,
                   self.o.bias, self.post_norm, self.gate_up.panels, self.gate_up.bias,
                   self.down.panels, self.down.bias, flat.rotary.cos, flat.rotary.sin,
                   *(lin.quant for lin in linears))  # fmt: skip
        held = tuple(t.detach() for t in tensors if t is not None)
        fields = [
            self.qkv.k, self.o.n, flat.heads, flat.kv_heads, flat.head_dim, self.gate_up.n // 2,
            *self.qkv.fields(), _ptr(self.q_norm) or 0, _ptr(self.k_norm) or 0,
            *self.o.fields(), self.post_norm.data_ptr(), *self.gate_up.fields(),
            *self.down.fields(), flat.rotary.cos.data_ptr(), flat.rotary.sin.data_ptr(),
            *(_ptr(lin.quant) or 0 for lin in linears),
        ]  # fmt: skip
        assert len(fields) == flat.layer_fields
        return _Descriptor(torch.tensor(fields, dtype=torch.int64), held)

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
        self.dtype = attn.o_proj.weight.dtype
        self.bf16 = int(self.dtype == torch.bfloat16)
        self.eps = eps
        self.heads = attn.qkv_proj.num_heads_local
        self.kv_heads = attn.qkv_proj.num_kv_heads_local
        self.head_dim = attn.qkv_proj.head_dim
        self.scale = float(attn.scale)
        self.rotary = attn.rotary
        self.layer_fields = kernels.layer_fields
        self.stack_fields = kernels.stack_fields

    def new(self, rows: int, cols: int) -> torch.Tensor:
        return torch.empty((rows, cols), dtype=self.dtype)

    def norm(self, t: int, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
             residual: torch.Tensor | None = None) -> None:  # fmt: skip
        """RMSNorm of the rows of ``x`` (of ``x + residual``, stored into ``residual``)."""
        self.m.rms_norm(t, x.shape[1], x.data_ptr(), x.stride(0), _ptr(residual),
                        weight.data_ptr(), self.eps, out.data_ptr(), self.bf16)  # fmt: skip

    def step_args(self, positions: torch.Tensor, meta: AttentionMetadata) -> _StepArgs:
        """What every layer.c call of one forward passes alike."""
        return _StepArgs(
            (positions.data_ptr(), meta.slot_mapping.data_ptr()),
            (meta.seq_lens.shape[0], meta.query_start_loc.data_ptr(), meta.seq_lens.data_ptr(),
             meta.block_tables.data_ptr(), meta.block_tables.stride(0), _ptr(meta.tree_masks),
             _ptr(meta.tree_starts), self.eps, self.scale, self.bf16),
        )  # fmt: skip


@dataclass(frozen=True)
class _StepArgs:
    """The arguments csrc/layer.c's calls end with, read once a forward: positions and slots,
    then (after a layer's K/V caches) the attention metadata, eps, scale and the dtype flag."""

    head: tuple
    tail: tuple

    def around(self, cache: tuple[torch.Tensor, torch.Tensor]) -> tuple:
        k_cache, v_cache = cache
        return (*self.head, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1],
                k_cache.shape[3], *self.tail)  # fmt: skip


class CpuDecoderPlan(_FlatLayers):
    """The decoder layers and final norm of one ``LlamaModel``."""

    def __init__(self, kernels: CpuKernels, model: Any, layers: list[_Layer]) -> None:
        super().__init__(kernels, model.layers[0].self_attn, float(model.norm.eps))
        self.layers = layers
        self.final_norm = model.norm.weight
        self.refresh()

    def refresh(self) -> None:
        """Re-read the weights' addresses (after they were re-pointed)."""
        self.descs = [lay.descriptor(self) for lay in self.layers]
        self._table: tuple[tuple[int, ...], torch.Tensor] | None = None

    def stack_table(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """csrc/layer.c's table of the stack over these caches (per layer: its descriptor,
        input norm, K and V caches, kv heads and block size), kept while their addresses
        stay."""
        key = tuple(t.data_ptr() for kv in kv_caches for t in kv)
        if self._table is None or self._table[0] != key:
            rows = []
            for lay, desc, (k, v) in zip(self.layers, self.descs, kv_caches, strict=True):
                assert lay.in_norm is not None
                rows.append([desc.fields.data_ptr(), lay.in_norm.data_ptr(), k.data_ptr(),
                             v.data_ptr(), k.shape[1], k.shape[3]])  # fmt: skip
            table = torch.tensor(rows, dtype=torch.int64)
            assert table.shape[1] == self.stack_fields
            self._table = (key, table)
        return self._table[1]

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
        normed, x = self.new(t, hidden), self.new(t, hidden)
        seen: dict[int, torch.Tensor] = {0: h.clone()} if 0 in streams else {}
        residual, step = h, self.step_args(positions, meta)
        table = self.stack_table(kv_caches).data_ptr()
        n = len(self.layers)
        lo = 0
        for hi in sorted({i for i in streams if 0 < i < n} | {n}):  # one call to each stream
            self.m.decoder_layers(table, lo, hi, t, hidden, x.data_ptr(), residual.data_ptr(),
                                  normed.data_ptr(), *step.head, *step.tail)  # fmt: skip
            if hi in streams:
                seen[hi] = x + residual
            lo = hi
        final = self.new(t, hidden)
        self.norm(t, x, self.final_norm, final, residual)
        return final, [seen[i] for i in streams]


class Eagle3HeadPlan(_FlatLayers):
    """An EAGLE-3 head's pass (``EagleHead.forward``) as one kernel call, its logits in the same
    call where ``lm_head`` is set."""

    def __init__(self, kernels: CpuKernels, head: Any, layer: _Layer) -> None:
        super().__init__(kernels, head.self_attn, float(head.norm.eps))
        self.layer = layer
        self.embed_norm = head.input_layernorm.weight
        self.feature_norm = head.hidden_norm.weight
        self.final_norm = head.norm.weight
        # logits in the same call: the head's own LM head, packed, over the target's vocabulary
        lm_head = head.lm_head if head.d2t_identity else None
        self.lm_head = lm_head.packed if lm_head is not None else None
        self.fc = _Linear.of(head.fc)  # the target's features into the head's (``round``)
        self.refresh()

    def refresh(self) -> None:
        """Re-read the weights' addresses (after they were re-pointed)."""
        self.desc = self.layer.descriptor(self)

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
        logits: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The next pass's feature, and the normed hidden states as ``EagleHead.forward`` or,
        with ``logits`` (only where ``lm_head`` is set), every row's float32 logits."""
        t, hidden = features.shape
        if features.stride(-1) != 1:
            features = features.contiguous()
        embedded = embedded.contiguous()  # rows read ``hidden`` apart
        pre = self.new(t, hidden)
        lm_head = self.lm_head if logits else None
        if logits:
            assert lm_head is not None
            out = torch.empty((t, lm_head.out_features), dtype=torch.float32)
        else:
            out = self.new(t, hidden)
        self.m.eagle3_pass(
            self.desc.fields.data_ptr(), t, embedded.data_ptr(), features.data_ptr(),
            features.stride(0), self.embed_norm.data_ptr(), self.feature_norm.data_ptr(),
            self.final_norm.data_ptr(), None if lm_head is None else lm_head.panels.data_ptr(),
            0 if lm_head is None else lm_head.out_features, pre.data_ptr(),
            None if logits else out.data_ptr(), out.data_ptr() if logits else None,
            *self.step_args(positions, meta).around(cache),
        )  # fmt: skip
        return pre, out

    def round(
        self,
        embed: torch.Tensor,
        ids: torch.Tensor,
        target_features: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        rows: torch.Tensor,
        temperature: torch.Tensor,
        u: torch.Tensor,
        base: torch.Tensor,
        tables: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        depths: list[int],
        keep_q: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """The head's pass over the T rows it has not seen (tokens ``ids`` [T], the target's
        features [T, fc in] of their positions, ``positions`` and ``meta`` as its forward
        takes them), then draft chains past the roots at rows ``rows`` [A] of that pass (row r:
        ``depths[r]`` drafts, the first pass at key index ``base[r]``, block table
        ``tables[r]``), every row sampled at its temperature alone (0: greedy) with its
        uniforms ``u[r]``: one kernel call (``csrc/draft_round.c``; ``lm_head`` and ``fc`` must
        be set), the same bits as ``EagleHead.from_target``, ``forward``, ``compute_logits`` of
        those rows and ``draft_loop.grow``'s chains. Returns the drafts int64 [A, D] (D the
        deepest; 0 past a row's own), with ``keep_q`` q [A, D, V], and the seconds the pass and
        the roots took."""
        assert self.lm_head is not None and self.fc is not None
        vocab, a = self.lm_head.out_features, rows.shape[0]
        width = max(depths, default=0)
        tokens = torch.zeros((a, width), dtype=torch.int64)
        probs = torch.zeros((a, width, vocab), dtype=torch.float32) if keep_q else None
        depth_t = torch.tensor(depths, dtype=torch.int64)
        if target_features.stride(-1) != 1:
            target_features = target_features.contiguous()
        u = u.to(torch.float32).contiguous()
        temperature = temperature.to(torch.float32).contiguous()
        step = self.step_args(positions, meta)
        positions_ptr, slots_ptr = step.head
        num_seqs, qsl, seq_lens, catch_tables, catch_stride = step.tail[:5]
        k_cache, v_cache = cache
        seconds = self.m.eagle3_round(
            self.desc.fields.data_ptr(), self.fc.n, ids.shape[0], ids.data_ptr(),
            target_features.data_ptr(), target_features.stride(0), self.fc.k,
            self.fc.panels.data_ptr(), _ptr(self.fc.bias), positions_ptr, slots_ptr, num_seqs,
            qsl, seq_lens, catch_tables, catch_stride, a, rows.data_ptr(), depth_t.data_ptr(),
            embed.data_ptr(), self.embed_norm.data_ptr(), self.feature_norm.data_ptr(),
            self.final_norm.data_ptr(), self.lm_head.panels.data_ptr(), vocab,
            temperature.data_ptr(), u.data_ptr(), u.stride(0), tokens.data_ptr(), width,
            _ptr(probs), width * vocab, base.data_ptr(), tables.data_ptr(), tables.stride(0),
            k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1], k_cache.shape[3], self.eps,
            self.scale, self.bf16,
        )  # fmt: skip
        return tokens, probs, seconds
