"""GGUF checkpoints (llama.cpp's one-file format): which file, the file checked, its tokenizer.

A GGUF file holds a model's settings as typed metadata (``llama.embedding_length``, ...), its
tokenizer (vocabulary, merges, special ids, chat template) and its weights, each stored as
float32, float16, bfloat16 or one of ggml's block quantizations. specbatch turns the metadata
into a transformers config (``gguf_config.py``) and dequantizes each weight as it loads
(``gguf_tensors.py``), so the model runs like any other checkpoint, in the engine's dtype.

Reading a GGUF file needs the ``gguf`` package (``pip install 'specbatch[gguf]'``); it is
imported only when a GGUF file is given.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from specbatch.errors import InvalidInputError
from specbatch.model.gguf_reader import MAGIC, GGUFFile

EXTRA = "pip install 'specbatch[gguf]'"


def find_gguf_file(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or the one ``*.gguf`` file of a folder
    that is not a Hugging Face checkpoint (no ``config.json``); None when it names neither."""
    p = Path(path)
    if p.is_file():
        return p.resolve() if p.suffix.lower() == ".gguf" or _starts_with_magic(p) else None
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    files = sorted(f for f in p.glob("*.gguf") if f.is_file())
    if len(files) > 1:
        names = ", ".join(f.name for f in files[:5]) + (" ..." if len(files) > 5 else "")
        raise InvalidInputError(
            f"'{path}' holds {len(files)} GGUF files ({names}); pass the file to load"
        )
    return files[0].resolve() if files else None


def _starts_with_magic(file: Path) -> bool:
    try:
        with file.open("rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def import_gguf(file: Path) -> Any:
    """The ``gguf`` package, or an error naming the extra that installs it."""
    try:
        import gguf
    except ImportError:
        raise InvalidInputError(
            f"'{file}' is a GGUF file; reading one needs the gguf package: {EXTRA}"
        ) from None
    return gguf


def open_gguf(file: Path) -> GGUFFile:
    """``file`` mapped and its header read, after checking that it is a whole GGUF file of one
    part."""
    stat = file.stat()
    return _open_gguf(str(file), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=4)  # the engine's config, its loader and its tokenizer read one file
def _open_gguf(file: str, size: int, mtime_ns: int) -> GGUFFile:
    gguf = import_gguf(Path(file))
    types = {int(k): (k.name, *v) for k, v in gguf.GGML_QUANT_SIZES.items()}
    reader = GGUFFile(Path(file), types)
    parts = reader.fields.get("split.count")
    if isinstance(parts, int) and parts > 1:
        raise InvalidInputError(
            f"'{file}' is part of a GGUF split into {parts} files (split.count); merge "
            "them into one file first (llama.cpp's gguf-split --merge)"
        )
    return reader


def has_tokenizer(reader: GGUFFile) -> bool:
    return "tokenizer.ggml.model" in reader.fields and "tokenizer.ggml.tokens" in reader.fields


def is_gguf_tokenizer(path: str) -> bool:
    p = Path(path)
    return p.is_file() and (p.suffix.lower() == ".gguf" or _starts_with_magic(p))


def load_gguf_tokenizer(path: str) -> Any:
    """The tokenizer a GGUF file describes (vocabulary, merges, special tokens, chat template),
    built by transformers from the file's metadata."""
    file = Path(path).resolve()
    import_gguf(file)
    if not has_tokenizer(open_gguf(file)):
        raise InvalidInputError(
            f"tokenizer: '{path}' holds no tokenizer (no tokenizer.ggml.model and "
            "tokenizer.ggml.tokens metadata); pass --tokenizer",
            "tokenizer",
        )
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast.from_pretrained(str(file.parent), gguf_file=file.name)
    except Exception as e:  # transformers raises many kinds; the user needs the file and cause
        raise InvalidInputError(
            f"tokenizer: cannot build the tokenizer of '{path}': {e}", "tokenizer"
        ) from None
