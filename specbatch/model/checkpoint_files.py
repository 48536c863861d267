"""A checkpoint's safetensors files: which they are, and whether each is whole.

A safetensors file is an 8-byte little-endian header length ``H``, ``H`` bytes of JSON mapping
each tensor to its dtype, shape and ``data_offsets`` (begin and end, from the end of the
header), then the data. ``check_safetensors_file`` reads only the length and the header, so a
truncated or damaged file is refused in milliseconds, before any weight is read, with a message
that names the file, what it holds and what it should.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from specbatch.errors import InvalidInputError

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
_HINT = "(damaged or cut short: copy or export it again)"


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: those of the index if any, else all of them."""
    p = Path(path)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise InvalidInputError(
                f"'{index}' is not a safetensors index (a JSON object with a "
                "'weight_map' of tensor names to file names)"
            ) from None
        files = [p / name for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise InvalidInputError(
                f"'{index}' lists files that are not there: {', '.join(missing)}"
            )
        return files
    if (p / "model.safetensors").is_file():
        return [p / "model.safetensors"]
    # Mistral repositories also ship "consolidated.safetensors" with other tensor names.
    files = [f for f in sorted(p.glob("*.safetensors")) if not f.name.startswith("consolidated")]
    if not files:
        raise InvalidInputError(
            f"no *.safetensors weights in '{path}' (only safetensors checkpoints are "
            "supported; convert .bin/.pt weights with transformers' save_pretrained)"
        )
    return files


def check_checkpoint_files(files: list[Path]) -> None:
    for f in files:
        check_safetensors_file(f)


def check_safetensors_file(file: Path) -> None:
    """Raise ``InvalidInputError`` unless ``file`` has a readable header and every tensor's
    bytes, as the header places them, lie inside the file."""
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(8)
            header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            ok_len = header_len is not None and header_len <= min(MAX_HEADER_BYTES, size - 8)
            raw = f.read(header_len) if ok_len and header_len is not None else b""
    except OSError as e:
        raise InvalidInputError(f"cannot read '{file}': {e.strerror or e}") from None
    if header_len is None:
        raise InvalidInputError(
            f"'{file}' has {size} bytes, fewer than the 8 of a safetensors header length {_HINT}"
        )
    if not ok_len:
        raise InvalidInputError(
            f"'{file}' is not a whole safetensors file: its header length says "
            f"{header_len} bytes but only {max(size - 8, 0)} follow {_HINT}"
        )
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict):
        raise InvalidInputError(
            f"'{file}' has a safetensors header that is not a JSON object {_HINT}"
        )
    data_bytes = size - 8 - header_len
    need = max((_tensor_end(file, name, entry) for name, entry in _tensors(header)), default=0)
    if need > data_bytes:
        raise InvalidInputError(
            f"'{file}' is cut short: its tensors need {8 + header_len + need} bytes "
            f"but the file has {size} (copy or export it again)"
        )


def _tensors(header: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(k, v) for k, v in header.items() if k != "__metadata__"]


def _tensor_end(file: Path, name: str, entry: Any) -> int:
    """Where the tensor's data ends, after checking its entry is consistent."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    shape = entry.get("shape") if isinstance(entry, dict) else None
    ok = (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
        and offsets[0] <= offsets[1]
        and isinstance(shape, list)
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    )
    if not ok:
        raise InvalidInputError(
            f"'{file}': tensor '{name}' has no valid shape and data_offsets in the header {_HINT}"
        )
    itemsize = DTYPE_BYTES.get(entry.get("dtype"))
    if itemsize is not None and math.prod(shape) * itemsize != offsets[1] - offsets[0]:
        raise InvalidInputError(
            f"'{file}': tensor '{name}' of shape {shape} and dtype {entry['dtype']} "
            f"needs {math.prod(shape) * itemsize} bytes, its header gives it "
            f"{offsets[1] - offsets[0]} {_HINT}"
        )
    return int(offsets[1])
