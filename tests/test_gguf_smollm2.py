"""A real pretrained model: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched by
scripts/fetch_smollm2.py and cached. Its greedy chat replies equal transformers' (reading the
same file, dequantized to float32) token for token, with and without n-gram speculation and
with its EAGLE-3 head, and ``LLM.chat`` answers through the file's own chat template.

The file comes from PyPI; if it cannot be fetched this test fails (it never skips), so a machine
without the model is noticed. The EAGLE head is trained on the machine
(scripts/train_smollm2_eagle.py, about 90 minutes); its test skips where it has not been."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scripts.fetch_smollm2 import eagle_head_dir, fetch_smollm2
from specbatch import LLM, SamplingParams

MAX_NEW = 32
EOS = 2  # <|im_end|>

# one worker (pytest-xdist) runs the module: the file is fetched and ``replies`` generated once
pytestmark = pytest.mark.xdist_group("smollm2")

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that returns the square of a number."}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Repeat this sentence: the cat sat on the mat."},
    ],
]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return fetch_smollm2()


@pytest.fixture(scope="module")
def replies(smollm2: Path) -> list:
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    with LLM(str(smollm2), dtype="float32", max_model_len=512, num_kv_blocks=64) as llm:
        return llm.chat(CONVERSATIONS, greedy, use_tqdm=False)


@torch.inference_mode()
def test_greedy_chat_equals_transformers_token_for_token(smollm2: Path, replies: list) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = dict(pretrained_model_name_or_path=str(smollm2.parent), gguf_file=smollm2.name)
    tok = AutoTokenizer.from_pretrained(**where)
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
    for conversation, reply in zip(CONVERSATIONS, replies, strict=True):
        text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        assert reply.prompt_token_ids == ids
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=EOS,
        )
        assert reply.outputs[0].token_ids == out[0, len(ids) :].tolist()


def test_chat_answers_through_the_files_template(replies: list) -> None:
    first = replies[0]
    assert first.prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant")
    assert first.prompt.endswith("<|im_start|>assistant\n")
    assert "Paris" in first.outputs[0].text
    assert first.outputs[0].finish_reason == "stop"


def assert_speculation_keeps_the_greedy_replies(smollm2: Path, replies: list, spec: dict) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    with LLM(
        str(smollm2), dtype="float32", max_model_len=512, num_kv_blocks=64, speculative_config=spec
    ) as llm:
        outs = llm.chat(CONVERSATIONS, greedy, use_tqdm=False)
        summary = llm.engine.metrics.summary()
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in replies]
    assert summary["draft_tokens_accepted"] > 0


def test_ngram_speculation_keeps_the_greedy_replies(smollm2: Path, replies: list) -> None:
    # the repeated sentence is found in the prompt
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    assert_speculation_keeps_the_greedy_replies(smollm2, replies, spec)


def test_eagle_head_keeps_the_greedy_replies(smollm2: Path, replies: list) -> None:
    head = eagle_head_dir()
    if not (head / "config.json").is_file():
        pytest.skip(f"no EAGLE head at {head} (python scripts/train_smollm2_eagle.py)")
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    assert_speculation_keeps_the_greedy_replies(smollm2, replies, spec)
