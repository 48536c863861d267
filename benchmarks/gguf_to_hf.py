"""A GGUF file as a float32 Hugging Face checkpoint, converted once by transformers (which reads
GGUF with the ``gguf`` package) into a folder beside the file, so that engines that cannot read
GGUF (vLLM's CPU build) and specbatch run the very same weights.

    python benchmarks/gguf_to_hf.py FILE.gguf      # prints the checkpoint's folder

The folder is ``<file stem>.hf-float32`` next to the file; a later call finds it there.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path


def converted_dir(gguf_file: Path) -> Path:
    return gguf_file.with_name(gguf_file.stem + ".hf-float32")


def gguf_to_hf(gguf_file: str | Path) -> Path:
    """The folder of the converted checkpoint (weights, config, tokenizer and chat template),
    made first if it is not there."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(gguf_file).resolve()
    out = converted_dir(src)
    if (out / "config.json").is_file():
        return out
    kw = {"gguf_file": src.name}
    loaded = AutoModelForCausalLM.from_pretrained(str(src.parent), dtype=torch.float32, **kw)
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), **kw)
    config = loaded.config
    del config.quantization_config  # the weights are dequantized: a plain checkpoint
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    with tempfile.TemporaryDirectory(dir=src.parent) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        part = Path(tmp) / "part"
        part.mkdir()
        for f in Path(tmp).iterdir():
            if f != part:
                shutil.move(str(f), part / f.name)
        os.replace(part, out)  # a reader never sees half a checkpoint
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].endswith(".gguf") or not Path(args[0]).is_file():
        print("error: give one existing .gguf file", file=sys.stderr)
        return 2
    print(gguf_to_hf(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
