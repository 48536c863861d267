"""GGUF checkpoints: tiny files written by the gguf package's writer (float and quantized
matrices, tied and untied LM heads, Llama, Qwen2 and Qwen3) load through specbatch and give
transformers' own GGUF loading's greedy output token for token; a float32 file holds exactly
the weights of the checkpoint it was written from."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from specbatch import LLM, SamplingParams
from specbatch.distributed.parallel_state import SINGLE, TensorParallelGroup
from specbatch.model.loader import load_model
from specbatch.testing.gguf_files import write_gguf
from tests.helpers import hf_greedy

MAX_NEW = 16
TEXTS = ["The quick brown fox", "Speculative decoding drafts", "1, 2, 3, 4"]
K_SHAPE = dict(hidden_size=256, intermediate_size=512)  # K-quants pack rows of 256 values
CASES: dict[str, tuple[str, dict[str, Any], str, dict[str, str]]] = {
    # name: (arch, checkpoint arguments, matrix type, per-tensor types)
    "llama-f32": ("llama", {}, "F32", {}),
    "llama-f16-tied": ("llama", {"tie_word_embeddings": True}, "F16", {}),
    "llama-q8_0": ("llama", {}, "Q8_0", {"token_embd.weight": "Q4_1"}),
    "llama-q4_0-tied": (
        "llama",
        {"tie_word_embeddings": True},
        "Q4_0",
        {"token_embd.weight": "Q8_0"},
    ),
    "llama-k-quants": (
        "llama",
        K_SHAPE,
        "Q4_K",
        {"token_embd.weight": "Q6_K", "output.weight": "Q5_K", "blk.1.attn_v.weight": "Q5_1"},
    ),
    "qwen2-q5_0-tied": ("qwen2", {"tie_word_embeddings": True}, "Q5_0", {}),
    # transformers reads no head size from a Qwen3 file and takes its default, 128
    "qwen3-bf16": ("qwen3", {"head_dim": 128}, "BF16", {"output.weight": "Q8_0"}),
}


def file_maker(
    cases: dict[str, tuple[str, dict[str, Any], str, dict[str, str]]],
    make_checkpoint: Callable[..., Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str], Path]:
    """A case's GGUF file (``cases``: name -> arch, checkpoint arguments, matrix type,
    per-tensor types), written the first time it is asked for."""
    made: dict[str, Path] = {}

    def make(case: str) -> Path:
        if case not in made:
            arch, kwargs, matrix_type, types = cases[case]
            hf_dir = make_checkpoint(arch, with_tokenizer=True, **kwargs)
            out = tmp_path_factory.mktemp("gguf") / f"{case}.gguf"
            made[case] = write_gguf(hf_dir, out, matrix_type=matrix_type, types=types)
        return made[case]

    return make


@pytest.fixture(scope="module")
def gguf_file(
    make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    return file_maker(CASES, make_checkpoint, tmp_path_factory)


@torch.inference_mode()
def transformers_greedy(file: Path, texts: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    """Prompt ids and greedy continuations by transformers reading the GGUF file itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=torch.float32
    ).eval()
    prompts, outs = [], []
    for text in texts:
        ids = torch.tensor([tok.encode(text)])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_NEW,
            min_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        prompts.append(ids[0].tolist())
        outs.append(out[0, ids.shape[1] :].tolist())
    return prompts, outs


def assert_greedy_equals_transformers(file: Path, check: Callable[[LLM], None]) -> None:
    """specbatch's greedy output from ``file`` equal to transformers' reading it, prompts
    included; ``check`` sees the engine after its run."""
    want_prompts, want = transformers_greedy(file, TEXTS)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(str(file), dtype="float32", num_kv_blocks=32, max_model_len=128) as llm:
        outs = llm.generate(TEXTS, greedy, use_tqdm=False)
        check(llm)
    assert [o.prompt_token_ids for o in outs] == want_prompts
    assert [o.outputs[0].token_ids for o in outs] == want


def all_blocks_free(llm: LLM) -> None:
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_output_equals_transformers_reading_the_same_file(
    gguf_file: Callable[[str], Path], case: str
) -> None:
    assert_greedy_equals_transformers(gguf_file(case), all_blocks_free)


@pytest.mark.parametrize(
    ("arch", "kwargs"),
    [("llama", {}), ("llama", {"tie_word_embeddings": True}), ("qwen2", {}), ("qwen3", {})],
)
def test_a_float32_file_holds_the_checkpoints_weights_exactly(
    make_checkpoint: Callable[..., Path], tmp_path: Path, arch: str, kwargs: dict[str, Any]
) -> None:
    """Names, Llama's query/key row order, the tied head and each tensor-parallel rank's
    slices, checked against the Hugging Face checkpoint the file was written from, without
    transformers' GGUF code."""
    hf_dir = make_checkpoint(arch, **kwargs)
    file = write_gguf(hf_dir, tmp_path / "m.gguf", tokenizer=False)
    for tp in (SINGLE, TensorParallelGroup(0, 2), TensorParallelGroup(1, 2)):  # each rank's slice
        # the torch layers: the kernels' repacked weights leave the parameters empty
        want = load_model(hf_dir, torch.float32, "cpu", tp, use_cpu_kernels=False)
        got = dict(
            load_model(file, torch.float32, "cpu", tp, use_cpu_kernels=False).named_parameters()
        )
        assert got.keys() == dict(want.named_parameters()).keys()
        for name, p in want.named_parameters():
            assert p.numel() > 0 and torch.equal(got[name], p), (tp, name)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    ],
)
def test_rope_scaling_read_from_the_metadata(
    make_checkpoint: Callable[..., Path], tmp_path: Path, rope: dict[str, Any]
) -> None:
    """transformers' GGUF loading ignores these keys: the reference is the checkpoint the
    file was written from."""
    hf_dir = make_checkpoint("llama", rope_scaling=rope)
    file = write_gguf(hf_dir, tmp_path / "m.gguf", tokenizer=False)
    prompts = [list(range(3, 3 + n)) for n in (5, 60)]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(str(file), dtype="float32", num_kv_blocks=32, max_model_len=128) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf_dir, prompts, MAX_NEW)


def test_a_folder_holding_one_file_loads_it_and_chat_uses_its_template(
    gguf_file: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "m.gguf").symlink_to(gguf_file("llama-q8_0"))
    messages = [{"role": "user", "content": "The quick brown fox"}]
    with LLM(str(folder), dtype="float32", num_kv_blocks=32, max_model_len=128) as llm:
        assert llm.engine.config.target.path == str((folder / "m.gguf").resolve())
        tok = llm.get_tokenizer()
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text == "<|user|>The quick brown fox\n<|assistant|>"
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        chat = llm.chat(messages, params, use_tqdm=False)[0]
        ids = tok.encode(text, add_special_tokens=False)
        plain = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    assert chat.prompt_token_ids == plain.prompt_token_ids
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids


def test_tokenizer_flag_overrides_the_files_tokenizer(
    gguf_file: Callable[[str], Path], make_checkpoint: Callable[..., Path]
) -> None:
    hf_dir = make_checkpoint("llama", with_tokenizer=True)
    file = gguf_file("llama-f32")
    with LLM(str(file), tokenizer=str(hf_dir), num_kv_blocks=16, max_model_len=64) as llm:
        assert llm.engine.config.target.tokenizer_path == str(hf_dir)


def test_a_file_without_a_tokenizer_takes_token_id_prompts(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    file = write_gguf(make_checkpoint("llama"), tmp_path / "m.gguf", tokenizer=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(str(file), num_kv_blocks=16, max_model_len=64) as llm:
        assert llm.engine.config.target.tokenizer_path is None
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize(("case", "stored"), [("llama-f32", "float32"), ("llama-q8_0", "float16")])
def test_dtype_auto_follows_the_stored_matrices(
    gguf_file: Callable[[str], Path], case: str, stored: str
) -> None:
    """float32 files stay float32; quantized ones run as a 16-bit checkpoint would."""
    from specbatch.config import EngineArgs
    from specbatch.model.checkpoint import resolve_dtype

    config = EngineArgs(model=str(gguf_file(case)), device="cpu").create_engine_config()
    assert str(config.target.hf_config.dtype) in (stored, f"torch.{stored}")
    assert config.target.dtype == resolve_dtype("auto", config.target.hf_config, "cpu")
    if stored == "float32":
        assert config.target.dtype == torch.float32
