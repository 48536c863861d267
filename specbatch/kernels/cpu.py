"""Tensor-level calls into the CPU kernels (``csrc/``), one per op for the whole batch.

Every function takes and returns torch tensors on the CPU in float32 or bfloat16 (the model's
dtype); inputs must have a contiguous last dimension. ``cpu_kernels()`` is None where the
library cannot be built (the reason is logged once) or ``SPECBATCH_CPU_KERNELS=0``: callers then
run the pure-torch path.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from specbatch.kernels.build import KernelBuildError, load_module
from specbatch.kernels.quantized import QuantizedLinear

logger = logging.getLogger(__name__)

PANEL = 16  # output features per weight panel


@dataclass
class PackedLinear:
    """A linear layer's weight ``[N, K]`` laid out in panels for ``sb_linear_*``."""

    panels: torch.Tensor
    out_features: int
    in_features: int


def _is_bf16(t: torch.Tensor) -> int:
    if t.dtype == torch.bfloat16:
        return 1
    if t.dtype == torch.float32:
        return 0
    raise TypeError(f"CPU kernels take float32 or bfloat16, got {t.dtype}")


class CpuKernels:
    def __init__(self, module: ModuleType) -> None:
        self._m = module
        info = module.info()
        self.bf16_dot = bool(info["bf16_dot"])  # AVX512-BF16 (else bfloat16 runs as FMA pairs)
        self.max_head_dim = int(info["max_head_dim"])
        self.tree_rows = int(info["tree"])  # attention's tree masks cover sequences this long
        self.amx_available = bool(info["amx"])
        self.layer_fields = int(info["layer_fields"])  # csrc/layer.c's descriptor length
        self.stack_fields = int(info["stack_fields"])  # and its stack table's, per layer
        self.use_amx(_env_on("SPECBATCH_CPU_AMX"))

    def use_amx(self, on: bool) -> bool:
        """Route bfloat16 multiplies to the AMX tiles (where the CPU and the OS allow it) or to
        the AVX-512 dot products; returns whether AMX is now used. Either way every output is
        summed in one order whatever the batch; the two give different roundings."""
        self.amx = on and self.amx_available
        self._m.set_amx(int(self.amx))
        return self.amx

    # ---- matrix multiplies -------------------------------------------------------------------
    @staticmethod
    def supports_linear(dtype: torch.dtype) -> bool:
        return dtype in (torch.float32, torch.bfloat16)

    @staticmethod
    def pack_linear(weight: torch.Tensor) -> PackedLinear:
        """Panels of 16 output features: float32 ``[N/16, K, 16]``, bfloat16 ``[N/16, K/2, 16,
        2]`` (N padded to 16 and, for bfloat16, K to even, with zeros)."""
        n, k = weight.shape
        n_pad = -(-n // PANEL) * PANEL
        w = weight.detach()
        if weight.dtype == torch.bfloat16:
            k_pad = k + (k & 1)
            w = torch.nn.functional.pad(w, (0, k_pad - k, 0, n_pad - n))
            panels = w.view(n_pad // PANEL, PANEL, k_pad // 2, 2).permute(0, 2, 1, 3)
        else:
            w = torch.nn.functional.pad(w, (0, 0, 0, n_pad - n))
            panels = w.view(n_pad // PANEL, PANEL, k).permute(0, 2, 1)
        return PackedLinear(panels.contiguous(), n, k)

    def linear(
        self,
        x: torch.Tensor,
        w: PackedLinear,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """``x [M, K] @ W^T + bias`` -> ``[M, N]``; bfloat16 may return float32 (``out_dtype``)."""
        x = _rows(x)
        m = x.shape[0]
        if x.shape[1] != w.in_features:
            raise ValueError(f"linear: input has {x.shape[1]} features, the weight {w.in_features}")
        y = torch.empty((m, w.out_features), dtype=out_dtype or x.dtype)
        b = bias.data_ptr() if bias is not None else None
        if _is_bf16(x):
            self._m.linear_bf16(
                m, w.out_features, w.in_features, x.data_ptr(), x.stride(0),
                w.panels.data_ptr(), b, y.data_ptr(), w.out_features, int(y.dtype != x.dtype),
            )  # fmt: skip
        else:
            self._m.linear_f32(
                m, w.out_features, w.in_features, x.data_ptr(), x.stride(0),
                w.panels.data_ptr(), b, y.data_ptr(), w.out_features,
            )  # fmt: skip
        return y

    def linear_quant(
        self,
        x: torch.Tensor,
        w: QuantizedLinear,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """``linear`` on a weight kept as GGUF blocks (``quantized.py``)."""
        x = _rows(x)
        if x.shape[1] != w.in_features:
            raise ValueError(f"linear: input has {x.shape[1]} features, the weight {w.in_features}")
        y = torch.empty((x.shape[0], w.out_features), dtype=out_dtype or x.dtype)
        self._m.linear_quant(
            x.shape[0], w.out_features, w.in_features, x.data_ptr(), x.stride(0), _is_bf16(x),
            w.desc.data_ptr(), _ptr(bias), y.data_ptr(), w.out_features,
            int(y.dtype != x.dtype),
        )  # fmt: skip
        return y

    # ---- elementwise -------------------------------------------------------------------------
    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """RMSNorm of ``x`` (of ``x + residual`` when given, which is stored into ``residual``)."""
        x = _rows(x)
        out = torch.empty((x.shape[0], x.shape[1]), dtype=x.dtype)
        r = residual.data_ptr() if residual is not None else None
        self._m.rms_norm(
            x.shape[0], x.shape[1], x.data_ptr(), x.stride(0), r, weight.data_ptr(), eps,
            out.data_ptr(), _is_bf16(x),
        )  # fmt: skip
        return out

    def head_rms_norm_(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """Per-head RMSNorm in place of ``x [T, H, D]`` (heads D apart)."""
        t, h, d = x.shape
        self._m.head_rms_norm(
            t, h, d, x.data_ptr(), x.stride(0), weight.data_ptr(), eps, _is_bf16(x)
        )

    def rope_(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """Rotary embedding in place of ``x [T, H, D]`` (heads D apart), float32 cos/sin tables
        ``[max_positions, D / 2]``."""
        t, h, d = x.shape
        self._m.rope(
            t, h, d, x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(),
            sin.data_ptr(), _is_bf16(x),
        )  # fmt: skip

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, 2n]`` as ``[gate | up]`` -> ``silu(gate) * up``."""
        x = x.contiguous()
        n = x.shape[1] // 2
        out = torch.empty((x.shape[0], n), dtype=x.dtype)
        self._m.silu_and_mul(x.shape[0], n, x.data_ptr(), out.data_ptr(), _is_bf16(x))
        return out

    # ---- sampling ----------------------------------------------------------------------------
    def sample_rows(self, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """``sampler.sample`` for float32 ``probs [N, V]`` and ``u [N]``: the same tokens."""
        probs = _rows(probs)
        u = u.to(torch.float32).contiguous()
        out = torch.empty(probs.shape[0], dtype=torch.int64)
        self._m.sample_rows(
            probs.shape[0], probs.shape[1], probs.data_ptr(), probs.stride(0), u.data_ptr(),
            out.data_ptr(),
        )  # fmt: skip
        return out

    def rejection_sample(
        self,
        draft_ids: torch.Tensor,
        num_draft: torch.Tensor,
        q: torch.Tensor | None,
        p: torch.Tensor,
        accept_u: torch.Tensor,
        final_u: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``rejection_sampler.rejection_sample`` for float32 p [B, G+1, V] and q [B, G, V]
        (None: point masses): (tokens [B, G+1], accepted [B]), the same as its torch ops."""
        batch, gamma = draft_ids.shape
        v = p.shape[-1]
        if p.stride(-1) != 1:
            p = p.contiguous()
        if q is not None and q.stride(-1) != 1:
            q = q.contiguous()
        ids = draft_ids.to(torch.int64).contiguous()
        counts = num_draft.to(torch.int64).contiguous()
        au = accept_u.to(torch.float32).contiguous()
        fu = final_u.to(torch.float32).contiguous()
        tokens = torch.empty((batch, gamma + 1), dtype=torch.int64)
        accepted = torch.empty(batch, dtype=torch.int64)
        scratch = torch.empty(v, dtype=torch.float32)
        qp, qsb, qsr = (None, 0, 0) if q is None else (q.data_ptr(), q.stride(0), q.stride(1))
        self._m.rejection_sample(
            batch, gamma, v, ids.data_ptr(), counts.data_ptr(), p.data_ptr(), p.stride(0),
            p.stride(1), qp, qsb, qsr, au.data_ptr(), fu.data_ptr(), scratch.data_ptr(),
            tokens.data_ptr(), accepted.data_ptr(),
        )  # fmt: skip
        return tokens, accepted

    # ---- attention ---------------------------------------------------------------------------
    @staticmethod
    def kv_cache_shapes(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Keys ``[block, head, d, block_size]``, values ``[block, head, slots, d]`` with
        ``slots`` the block size rounded up to even. In bfloat16 the elements inside a block's
        head lie in pairs (``csrc/attention.c``): keys ``[d / 2, block_size, 2]``, values
        ``[slots / 2, d, 2]``."""
        return (
            (num_blocks, num_kv_heads, head_dim, block_size),
            (num_blocks, num_kv_heads, block_size + block_size % 2, head_dim),
        )

    @staticmethod
    def slot_elements(
        k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
        """For the layout of ``kv_cache_shapes``: functions from slots [S] to the flat indices
        [S, heads, D] of their elements in the key and the value cache."""
        _, heads, d, bs = k_cache.shape
        pairs = k_cache.dtype == torch.bfloat16
        slots2 = v_cache.shape[2]
        h = torch.arange(heads, device=k_cache.device)[None, :, None]
        i = torch.arange(d, device=k_cache.device)[None, None, :]

        def keys(slots: torch.Tensor) -> torch.Tensor:
            blk, off = (slots // bs)[:, None, None], (slots % bs)[:, None, None]
            head = (blk * heads + h) * d * bs
            if pairs:  # [d / 2, block_size, 2]
                return head + (i // 2) * bs * 2 + off * 2 + i % 2
            return head + i * bs + off

        def values(slots: torch.Tensor) -> torch.Tensor:
            blk, off = (slots // bs)[:, None, None], (slots % bs)[:, None, None]
            head = (blk * heads + h) * slots2 * d
            if pairs:  # [slots / 2, d, 2]
                return head + (off // 2) * d * 2 + i * 2 + off % 2
            return head + off * d + i

        return keys, values

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> None:
        """Scatter ``k, v [T, Hkv, D]`` (rows may be strided) into their cache slots."""
        t, h, d = k.shape
        self._m.write_kv(
            t, h, d, k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(),
            k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[3], _is_bf16(k),
        )  # fmt: skip

    def paged_attention(
        self,
        q: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        tree_mask: torch.Tensor | None = None,
        tree_starts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``q [T, Hq, D]`` (rows may be strided) over the cache -> ``[T, Hq, D]``.

        Every row sees its sequence's context; of the new tokens, row ``i`` sees ``0 .. i``
        (causal). With ``tree_mask`` (int64 ``[T]``), the sequences whose ``tree_starts``
        (int64 ``[B]``; default: each one's first new token) is not -1 are trees: a row sees
        every key before its tree's start and, from there, the keys ``start + j`` whose bit
        ``j`` is set in its entry (trees of at most ``tree_rows`` keys; longer ones stay
        causal); see ``model/layers/attention.py``. A row must see itself."""
        t, hq, d = q.shape
        out = torch.empty((t, hq, d), dtype=q.dtype)
        tree = starts = None
        if tree_mask is not None:
            if tree_mask.dtype != torch.int64 or tree_mask.shape != (t,):
                raise ValueError(f"tree_mask must be int64 [{t}], got {tree_mask.dtype} "
                                 f"{tuple(tree_mask.shape)}")  # fmt: skip
            if tree_starts is None:
                tree_starts = seq_lens - (query_start_loc[1:] - query_start_loc[:-1])
            tree_mask, tree_starts = tree_mask.contiguous(), tree_starts.contiguous()
            tree, starts = tree_mask.data_ptr(), tree_starts.data_ptr()  # held until it returns
        self._m.paged_attention(
            seq_lens.shape[0], query_start_loc.data_ptr(), seq_lens.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), q.data_ptr(), q.stride(0), hq,
            k_cache.shape[1], d, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[3], scale,
            out.data_ptr(), tree, starts, _is_bf16(q),
        )  # fmt: skip
        return out


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 2-D tensor with a contiguous last dimension (a view when it already is)."""
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x


def _env_on(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


@functools.cache
def cpu_kernels() -> CpuKernels | None:
    """The kernels of this machine, or None (disabled, or they cannot be built: logged once)."""
    if not _env_on("SPECBATCH_CPU_KERNELS"):
        return None
    try:
        return CpuKernels(load_module())
    except KernelBuildError as e:
        logger.warning("CPU kernels unavailable, running the pure-torch path (slower): %s", e)
        return None
