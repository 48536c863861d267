"""A linear layer's weight kept as GGUF blocks, as ``csrc/gemm_quant.c`` multiplies it.

The weight ``[N, K]`` is one or more segments of whole output rows, each rows of ggml blocks of
one type (a fused projection such as ``[q; k; v]`` may hold parts of different types). The
kernel's descriptor lists them: the number of segments, then per segment its ggml type, rows,
first output feature and the address of its bytes (and two fields left 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# ggml type number -> (name, values per block, bytes per block): the types the kernel runs
KEPT_TYPES: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
}


PANEL = 16  # output features per panel (Q4_0, Q4_1, Q8_0)
_PANELED = {2: (2, 0), 3: (4, 2), 8: (2, 0)}  # kind -> (offset of the quants, of the minimum)


@dataclass(frozen=True)
class QuantizedRows:
    """Rows of a matrix as ggml blocks of one type in panels of 16 rows, as the kernel reads
    them (``csrc/gemm_qpanel.c``; a K-quant's blocks as their sub-blocks): ``q`` uint8
    ``[panels, blocks, bytes]``, each block's quants followed by its 16 scales (and minimums)."""

    kind: int
    q: torch.Tensor
    in_features: int
    rows: int

    @staticmethod
    def from_blocks(kind: int, blocks: torch.Tensor, in_features: int) -> QuantizedRows:
        """From rows of blocks as the file stores them, uint8 ``[rows, K / block * bytes]``."""
        name, block, block_bytes = KEPT_TYPES[kind]
        rows = blocks.shape[0]
        if in_features % block or blocks.shape[1] != in_features // block * block_bytes:
            raise ValueError(
                f"{name} rows of {in_features} values must be whole blocks of {block} "
                f"({block_bytes} bytes), got {blocks.shape[1]} bytes"
            )
        if kind in (12, 13):
            return _q45_k_panels(kind, blocks, in_features, rows)
        if kind == 14:
            return _q6_k_panels(blocks, in_features, rows)
        start, at_min = _PANELED[kind]
        nb, pad = in_features // block, -rows % PANEL
        b = torch.nn.functional.pad(blocks.reshape(rows, nb, block_bytes), (0, 0, 0, 0, 0, pad))
        npanel = (rows + pad) // PANEL

        def halves(at: int) -> torch.Tensor:  # each block's 16 as bytes [panels, blocks, 32]
            h = b[:, :, at : at + 2].reshape(npanel, PANEL, nb, 2)
            return h.permute(0, 2, 1, 3).reshape(npanel, nb, 2 * PANEL)

        quants = b[:, :, start:]
        if kind == 8:  # pair i of a block: 32 bytes, output o's values 2i, 2i + 1 at 2o, 2o + 1
            v = quants.reshape(npanel, PANEL, nb, 16, 2).permute(0, 2, 3, 1, 4)
            q = v.reshape(npanel, nb, 512)
        else:  # value j of a block: low nibble of byte j (j < 16), else high nibble of j - 16
            q = _nibble_panels(torch.cat([quants & 15, quants >> 4], dim=2))
        parts = [q, halves(0), *([halves(at_min)] if at_min else [])]
        return QuantizedRows(kind, torch.cat(parts, dim=2).contiguous(), in_features, rows)

    @property
    def type_name(self) -> str:
        return KEPT_TYPES[self.kind][0]

    @property
    def nbytes(self) -> int:
        return self.q.numel()

    def fields(self, first: int) -> list[int]:
        """The kernel's descriptor of these rows, output features from ``first`` on."""
        return [self.kind, self.rows, first, self.q.data_ptr(), 0, 0]


def _nibble_panels(values: torch.Tensor) -> torch.Tensor:
    """4-bit values ``[rows (a multiple of 16), blocks, 32]`` as panels' quants ``[panels,
    blocks, 256]``: chunk c holds pair 2c (values 4c, 4c + 1) in its low nibbles and pair
    2c + 1 (4c + 2, 4c + 3) in its high ones, output o's pair at bytes 2o, 2o + 1."""
    rows, nb, _ = values.shape
    v = values.reshape(rows // PANEL, PANEL, nb, 8, 2, 2).permute(0, 2, 3, 1, 5, 4)
    return (v[..., 0] | (v[..., 1] << 4)).reshape(rows // PANEL, nb, 256)


def _byte_panels(values: torch.Tensor) -> torch.Tensor:
    """Byte values ``[rows (a multiple of 16), blocks, block]`` as panels' quants ``[panels,
    blocks, 16 block]``: pair i of a block (values 2i, 2i + 1) in 32 bytes, output o's at bytes
    2o, 2o + 1."""
    rows, nb, block = values.shape
    v = values.reshape(rows // PANEL, PANEL, nb, block // 2, 2).permute(0, 2, 3, 1, 4)
    return v.reshape(rows // PANEL, nb, PANEL * block)


def _scale_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 per row and block ``[rows, blocks]`` as each panel's 16, bytes ``[panels,
    blocks, 64]``."""
    rows, nb = x.shape
    x = x.reshape(rows // PANEL, PANEL, nb).permute(0, 2, 1).contiguous()
    return x.view(torch.uint8).reshape(rows // PANEL, nb, 4 * PANEL)


def _padded(blocks: torch.Tensor, rows: int, block_bytes: int) -> torch.Tensor:
    b = blocks.reshape(rows, -1, block_bytes)
    return torch.nn.functional.pad(b, (0, 0, 0, 0, 0, -rows % PANEL))


def _q45_k_panels(kind: int, blocks: torch.Tensor, in_features: int, rows: int) -> QuantizedRows:
    """Q4_K and Q5_K as panels of their sub-blocks of 32 (Q4_K's quants as Q4_1's, Q5_K's a
    byte each), then float32 scales d * scale_j and minimums -dmin * min_j (ggml computes
    each product in float32)."""
    b = _padded(blocks, rows, 144 if kind == 12 else 176)
    n, nb = b.shape[0], b.shape[1]
    d = b[:, :, 0:2].contiguous().view(torch.float16).float()  # [n, nb, 1]
    dmin = b[:, :, 2:4].contiguous().view(torch.float16).float()
    s = b[:, :, 4:16].to(torch.int32)
    lo, hi, mix = s[:, :, 0:4], s[:, :, 4:8], s[:, :, 8:12]
    sc = torch.cat([lo & 63, (mix & 15) | ((lo >> 6) << 4)], dim=2).float()  # [n, nb, 8]
    mn = torch.cat([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], dim=2).float()
    qs = b[:, :, -128:].reshape(n, nb, 4, 1, 32)
    nib = torch.cat([qs & 15, qs >> 4], dim=3).reshape(n, nb * 8, 32)  # sub-block j = 2c + h
    if kind == 12:
        q = _nibble_panels(nib)
    else:  # bit j of qh[l] is value l's fifth bit in sub-block j
        qh = b[:, :, 16:48].reshape(n, nb, 1, 32) >> torch.arange(8, dtype=torch.uint8)[:, None]
        q = _byte_panels(nib | ((qh & 1) << 4).reshape(n, nb * 8, 32))
    scales = (d * sc).reshape(n, -1), (-(dmin * mn)).reshape(n, -1)
    parts = [q, *(_scale_bytes(x) for x in scales)]
    return QuantizedRows(kind, torch.cat(parts, dim=2).contiguous(), in_features, rows)


def _q6_k_panels(blocks: torch.Tensor, in_features: int, rows: int) -> QuantizedRows:
    """Q6_K as panels of its sub-blocks of 16, a signed byte a quant, then float32 scales
    d * scale_j."""
    b = _padded(blocks, rows, 210)
    n, nb = b.shape[0], b.shape[1]
    ql = b[:, :, 0:128].reshape(n, nb, 2, 1, 2, 32)  # [half, ., chunk of 32, l]
    low = torch.cat([ql & 15, ql >> 4], dim=3)  # values 32 (4 half + 2 shift + chunk) + l
    qh = (
        b[:, :, 128:192].reshape(n, nb, 2, 1, 32)
        >> (2 * torch.arange(4, dtype=torch.uint8))[:, None]
    )  # [half, j, l]: bits 2j, 2j + 1 of qh[l] for values 32 (4 half + j) + l
    q = (low.reshape(n, nb, 8, 32) | ((qh & 3).reshape(n, nb, 8, 32) << 4)).to(torch.int16) - 32
    q = q.to(torch.int8).view(torch.uint8).reshape(n, nb * 16, 16)
    sc = b[:, :, 192:208].contiguous().view(torch.int8).float()  # [n, nb, 16]
    d = b[:, :, 208:210].contiguous().view(torch.float16).float()
    parts = [_byte_panels(q), _scale_bytes((d * sc).reshape(n, -1))]
    return QuantizedRows(14, torch.cat(parts, dim=2).contiguous(), in_features, rows)


@dataclass(eq=False)
class QuantizedLinear:
    """Segments of output rows (in order), with the kernel's descriptor of them."""

    segments: list[QuantizedRows]
    in_features: int
    out_features: int = 0
    desc: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.repoint(self.segments)

    def repoint(self, segments: list[QuantizedRows]) -> None:
        """Take these segments (the same rows, moved) and describe them anew."""
        self.segments = segments
        fields = [len(self.segments)]
        n = 0
        for seg in self.segments:
            if seg.in_features != self.in_features:
                raise ValueError("segments of one weight must have the same input features")
            fields += seg.fields(n)
            n += seg.rows
        self.out_features = n
        self.desc = torch.tensor(fields, dtype=torch.int64)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def types(self) -> str:
        return "+".join(dict.fromkeys(s.type_name for s in self.segments))
