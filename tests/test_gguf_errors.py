"""Bad GGUF files and a missing gguf package end in an ``InvalidInputError`` naming the file
and what is wrong (the metadata key, the tensor, the type), and on the CLI in ``error: ...``
with exit status 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specbatch import LLM
from specbatch.errors import InvalidInputError
from specbatch.testing.gguf_files import write_gguf


@pytest.fixture(scope="module")
def hf_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama", with_tokenizer=True)


def refused(path: Path | str, **kwargs: Any) -> str:
    with pytest.raises(InvalidInputError) as e:
        LLM(str(path), num_kv_blocks=16, max_model_len=64, **kwargs)
    return str(e.value)


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (dict(architecture="gpt2"), "general.architecture 'gpt2' is not supported"),
        (dict(metadata={"llama.embedding_length": None}), "metadata 'llama.embedding_length'"),
        (dict(metadata={"llama.block_count": 0}), "'llama.block_count' must be an integer >= 1"),
        (dict(metadata={"llama.expert_count": 8}), "metadata 'llama.expert_used_count'"),
        (dict(metadata={"llama.attention.head_count_kv": 3}), "not a multiple of"),
        (dict(metadata={"llama.rope.dimension_count": 8}), "llama.rope.dimension_count=8"),
        (dict(metadata={"llama.rope.scaling.type": "longrope"}), "'llama.rope.scaling.type'"),
        (dict(metadata={"split.count": 3}), "split into 3 files"),
        (
            dict(extra_tensors={"rope_freqs.weight": np.ones(8, dtype=np.float32)}),
            "tensor 'rope_freqs.weight'",
        ),
        (
            dict(extra_tensors={"blk.0.extra.weight": np.ones(4, dtype=np.float64)}),
            "tensor 'blk.0.extra.weight' is stored as F64",
        ),
        (dict(drop_tensors=["blk.1.ffn_up.weight"]), "model.layers.1.mlp.up_proj.weight"),
    ],
)
def test_a_bad_file_names_what_is_wrong(
    hf_dir: Path, tmp_path: Path, write: dict[str, Any], message: str
) -> None:
    file = write_gguf(hf_dir, tmp_path / "bad.gguf", **write)
    msg = refused(file)
    assert message in msg, msg
    assert msg.startswith("model: ")


def test_a_cut_short_or_foreign_file_is_refused_before_loading(
    hf_dir: Path, tmp_path: Path
) -> None:
    data = write_gguf(hf_dir, tmp_path / "m.gguf").read_bytes()
    for size, message in ((len(data) - 100, "is cut short"), (1000, "ends inside its header")):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(data[:size])
        assert message in refused(cut)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04" + bytes(100))
    assert "is not a GGUF file" in refused(junk)


def test_a_folder_with_two_files_asks_for_one(hf_dir: Path, tmp_path: Path) -> None:
    write_gguf(hf_dir, tmp_path / "a.gguf")
    write_gguf(hf_dir, tmp_path / "b.gguf", matrix_type="F16")
    assert "holds 2 GGUF files (a.gguf, b.gguf)" in refused(tmp_path)


def test_a_draft_models_bad_file_names_the_draft(hf_dir: Path, tmp_path: Path) -> None:
    good = write_gguf(hf_dir, tmp_path / "good.gguf")
    bad = write_gguf(hf_dir, tmp_path / "bad.gguf", architecture="gpt2")
    msg = refused(good, draft_model=str(bad), num_speculative_tokens=2)
    assert msg.startswith("draft_model: ") and "general.architecture" in msg


def test_without_the_gguf_package_the_error_names_the_extra(
    hf_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = write_gguf(hf_dir, tmp_path / "m.gguf")
    monkeypatch.setitem(sys.modules, "gguf", None)  # what an absent package does to import
    assert "pip install 'specbatch[gguf]'" in refused(file)


def test_the_cli_says_error_and_exits_2(hf_dir: Path, tmp_path: Path) -> None:
    file = write_gguf(hf_dir, tmp_path / "bad.gguf", metadata={"llama.block_count": None})
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    args = ["generate", "--model", str(file), "--prompts", str(prompts)]
    run = subprocess.run(
        [sys.executable, "-m", "specbatch.entrypoints.cli", *args, "--output", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert "error: --model: " in run.stderr and "llama.block_count" in run.stderr
    assert "Traceback" not in run.stderr
