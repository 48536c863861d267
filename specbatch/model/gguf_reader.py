"""GGUF's layout, read: metadata as Python values, tensors as views of the mapped file.

A GGUF file (version 2 or 3, little-endian) is the magic ``GGUF``, a uint32 version, uint64
counts of tensors and of metadata pairs, the metadata (a string key, a uint32 value type, the
value; strings are a uint64 length and UTF-8 bytes, arrays a uint32 item type, a uint64 count and
the items), then per tensor its name, uint32 rank, uint64 dimensions (innermost first), uint32
ggml type and uint64 offset, and finally the data, aligned to ``general.alignment`` (32 unless
stated), each tensor at its offset from there. Parsing the metadata here in plain ``struct``
calls takes milliseconds for a 50,000-token vocabulary, where the ``gguf`` package's own reader
takes seconds; the ``gguf`` package still supplies the type table and the dequantization.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specbatch.errors import InvalidInputError

MAGIC = b"GGUF"
DAMAGED = "(damaged or cut short: copy or download it again)"
_SCALARS = {  # value type -> struct format
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}  # fmt: skip
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # as ggml lists them, innermost first
    kind: int  # the ggml type's number
    start: int  # where its data begins in the file

    @property
    def shape(self) -> tuple[int, ...]:
        """Outermost first, as torch and Hugging Face list them."""
        return tuple(reversed(self.dims))


class _Cursor:
    def __init__(self, buf: mmap.mmap, file: Path) -> None:
        self.buf, self.pos, self.file = buf, 0, file

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise InvalidInputError(
                f"'{self.file}' ends inside its header (at byte {len(self.buf)}) {DAMAGED}"
            )

    def scalar(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        self.need(n)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item in _NUMPY:
                dtype = np.dtype(_NUMPY[item])
                self.need(count * dtype.itemsize)
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += count * dtype.itemsize
                return arr.tolist()
            return [self.value(item) for _ in range(count)]
        raise InvalidInputError(
            f"'{self.file}' has a metadata value of unknown type {kind} {DAMAGED}"
        )


class GGUFFile:
    """One GGUF file, mapped read-only: ``fields`` (key -> value) and ``tensors`` (in file
    order); ``tensor_bytes`` gives a tensor's data without copying it."""

    def __init__(self, file: Path, types: dict[int, tuple[str, int, int]]) -> None:
        """``types``: ggml type number -> (name, values per block, bytes per block)."""
        self.file = file
        with file.open("rb") as f:
            try:
                self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                raise InvalidInputError(f"'{file}' is empty {DAMAGED}") from None
        c = _Cursor(self._buf, file)
        if len(self._buf) < 4 or self._buf[:4] != MAGIC:
            raise InvalidInputError(f"'{file}' is not a GGUF file (it does not start with GGUF)")
        c.pos = 4
        version = c.scalar("<I")
        if version not in (2, 3):
            raise InvalidInputError(
                f"'{file}' is GGUF version {version}; supported: 2 and 3 (little-endian)"
            )
        n_tensors, n_fields = c.scalar("<Q"), c.scalar("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = c.string()
            self.fields[key] = c.value(c.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            rank = c.scalar("<I")
            dims = tuple(c.scalar("<Q") for _ in range(rank))
            infos.append((name, dims, c.scalar("<I"), c.scalar("<Q")))
        align = self.fields.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise InvalidInputError(
                f"'{file}': general.alignment must be a power of two, got {align!r}"
            )
        data_start = -(-c.pos // align) * align
        self.tensors = [TensorInfo(n, d, k, data_start + off) for n, d, k, off in infos]
        self._types = types
        for t in self.tensors:
            end = t.start + self.n_bytes(t)
            if end > len(self._buf):
                raise InvalidInputError(
                    f"'{file}' is cut short: tensor '{t.name}' ends at byte {end} but "
                    f"the file has {len(self._buf)} {DAMAGED}"
                )

    def n_bytes(self, t: TensorInfo) -> int:
        return int(np.prod(t.shape[:-1], dtype=np.int64)) * self.row_bytes(t) if t.dims else 0

    def type_name(self, t: TensorInfo) -> str:
        return self._types[t.kind][0] if t.kind in self._types else f"type {t.kind}"

    def row_bytes(self, t: TensorInfo) -> int:
        if t.kind not in self._types:
            raise InvalidInputError(
                f"'{self.file}': tensor '{t.name}' has ggml type {t.kind}, which the "
                "installed gguf package does not know (a newer one may: pip install -U gguf)"
            )
        _, block, block_bytes = self._types[t.kind]
        if t.dims[0] % block:
            raise InvalidInputError(
                f"'{self.file}': tensor '{t.name}' has rows of {t.dims[0]} values, not a "
                f"whole number of its type's {block}-value blocks {DAMAGED}"
            )
        return t.dims[0] // block * block_bytes

    def tensor_bytes(self, t: TensorInfo) -> np.ndarray:
        """The tensor's data as uint8 ``[*shape[:-1], row bytes]``, a view of the mapped file."""
        data = np.frombuffer(self._buf, dtype=np.uint8, count=self.n_bytes(t), offset=t.start)
        return data.reshape(*t.shape[:-1], self.row_bytes(t))
