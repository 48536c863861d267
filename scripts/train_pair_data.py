"""Data for scripts/train_pair.py: the stdlib corpus, its held-out split, the BPE tokenizer.

The corpus is the ``.py`` files of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``), so nothing has to be downloaded. Directories named in
``EXCLUDED_DIRS`` are left out: ``site-packages`` is not the stdlib, and ``test``/``tests``/
``idlelib``/``lib2to3``/``turtledemo``/``ensurepip`` are shipped as separate, optional packages by
several Linux distributions, so leaving them out keeps the corpus the same on every install of a
given Python version. Files that are not valid UTF-8 are skipped (none in CPython 3.11).

The held-out split is a pure function of each file's relative path (sha256 of the POSIX path), so
it never depends on the order files are listed in, and held-out files are never trained on: they
are excluded from tokenizer training too.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

import torch

EOT = "<|endoftext|>"
EXCLUDED_DIRS = (
    "site-packages",
    "__pycache__",
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "turtledemo",
    "ensurepip",
)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def is_heldout(relpath: str, percent: float) -> bool:
    """Deterministic split: about ``percent`` % of files, chosen by a hash of the path."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 10000 < round(percent * 100)


def list_stdlib_files(root: Path | None = None) -> tuple[Path, list[tuple[str, str]]]:
    """All ``(relative_posix_path, text)`` of the stdlib's .py files, sorted by path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]) or not path.is_file():
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        found.append((rel.as_posix(), text))
    found.sort(key=lambda item: item[0])
    return root, found


def split_files(files, percent: float, max_files: int | None = None):
    train = [f for f in files if not is_heldout(f[0], percent)]
    heldout = [f for f in files if is_heldout(f[0], percent)]
    if max_files:  # --tiny and quick experiments: a prefix of each list, same split rule
        train = train[:max_files]
        heldout = heldout[: max(2, max_files // 10)]
    return train, heldout


def describe_files(files) -> dict:
    paths = [p for p, _ in files]
    return {
        "count": len(files),
        "bytes": sum(len(t.encode("utf-8")) for _, t in files),
        "paths_sha256": sha256_text("\n".join(paths)),
        "content_sha256": sha256_text("".join(f"{p}\0{t}\0" for p, t in files)),
        "paths": paths,
    }


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style pre-tokenisation, no prefix space) with one special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def wrap_hf(tok, context: int):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        unk_token=EOT,
        model_max_length=context,
        clean_up_tokenization_spaces=False,
    )


def encode_stream(tok, files) -> torch.Tensor:
    """One token stream: ``EOT file EOT file ...`` as int16 (vocab < 32768)."""
    eot = tok.token_to_id(EOT)
    encs = tok.encode_batch([t for _, t in files], add_special_tokens=False)
    ids = []
    for enc in encs:
        ids.append(eot)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.int16)


def check_roundtrip(tok, files) -> int:
    """Number of files whose text does not survive encode/decode exactly (expected 0)."""
    encs = tok.encode_batch([t for _, t in files], add_special_tokens=False)
    decoded = tok.decode_batch([e.ids for e in encs], skip_special_tokens=False)
    return sum(d != t for d, (_, t) in zip(decoded, files))


def build(out: Path, vocab_size: int, heldout_percent: float, context: int, max_files, log):
    """Tokenizer phase: writes ``out/tokenizer/`` (HF), ``out/data.pt`` and ``out/data.json``."""
    root, files = list_stdlib_files()
    train, heldout = split_files(files, heldout_percent, max_files)
    log(f"stdlib {root}: {len(files)} files; train {len(train)}, held-out {len(heldout)}")
    tok = train_tokenizer([t for _, t in train], vocab_size)
    bad = check_roundtrip(tok, train + heldout)
    if bad:
        raise RuntimeError(f"tokenizer does not round-trip {bad} files")
    hf = wrap_hf(tok, context)
    tok_dir = out / "tokenizer"
    hf.save_pretrained(str(tok_dir))
    train_ids, heldout_ids = encode_stream(tok, train), encode_stream(tok, heldout)
    tmp = out / "data.pt.tmp"
    torch.save({"train": train_ids, "heldout": heldout_ids}, tmp)
    os.replace(tmp, out / "data.pt")
    meta = {
        "source": "python stdlib .py files (sysconfig.get_paths()['stdlib'])",
        "stdlib_root": str(root),
        "python_version": sys.version.split()[0],
        "excluded_dirs": list(EXCLUDED_DIRS),
        "skipped": "files that are not valid UTF-8",
        "heldout_rule": f"sha256(relative posix path)[:8] as big-endian int % 10000 "
        f"< {round(heldout_percent * 100)}",
        "heldout_percent": heldout_percent,
        "max_files": max_files,
        "train_files": describe_files(train),
        "heldout_files": describe_files(heldout),
        "train_tokens": int(train_ids.numel()),
        "heldout_tokens": int(heldout_ids.numel()),
        "tokenizer": {
            "type": "byte-level BPE (tokenizers), trained on the train files only",
            "vocab_size": tok.get_vocab_size(),
            "special_tokens": [EOT],
            "eot_id": tok.token_to_id(EOT),
            "roundtrip_failures": bad,
            "tokenizer_json_sha256": hashlib.sha256(
                (tok_dir / "tokenizer.json").read_bytes()
            ).hexdigest(),
        },
    }
    (out / "data.json").write_text(json.dumps(meta, indent=1))
    for key in ("train_files", "heldout_files"):
        d = meta[key]
        log(f"{key}: {d['count']} files, {d['bytes']} bytes, paths sha256 {d['paths_sha256'][:16]}")
    log(
        f"tokenizer vocab {meta['tokenizer']['vocab_size']}; train tokens {meta['train_tokens']}, "
        f"held-out tokens {meta['heldout_tokens']} "
        f"({meta['train_files']['bytes'] / max(1, meta['train_tokens']):.2f} bytes/token)"
    )
    return meta


def load(out: Path):
    data = torch.load(out / "data.pt", weights_only=True)
    meta = json.loads((out / "data.json").read_text())
    return data["train"], data["heldout"], meta
