"""EOS ends a request where transformers' greedy ``generate`` stops, with finish_reason "stop":
after a plain decode step, and inside a run of accepted drafts (the tokens after it dropped).

A random model has no end-of-sequence habit, so each test takes a token that greedy decoding
emits at a chosen position for the first time and declares it the checkpoint's EOS.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from specbatch import LLM, SamplingParams
from tests.helpers import hf_greedy, hf_model

PROMPTS = [[3, 4, 5, 6], [9, 30, 7], [100, 101], [50, 60, 70, 80, 90]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


@pytest.fixture(scope="module")
def base(make_checkpoint) -> Path:
    return make_checkpoint("llama", seed=5)


def with_eos(model: Path, out: Path, eos: int) -> Path:
    """A copy of ``model`` whose config (and generation config) name ``eos`` as EOS."""
    shutil.copytree(model, out)
    for name in ("config.json", "generation_config.json"):
        path = out / name
        if path.exists():
            config = json.loads(path.read_text())
            config["eos_token_id"] = eos
            path.write_text(json.dumps(config))
    return out


def first_time_at(model: Path, positions: range) -> tuple[list[int], int, int]:
    """A prompt, a position k in ``positions`` and the token greedy decoding emits there for
    the first time."""
    greedy = hf_greedy(model, PROMPTS, 12)
    for prompt, tokens in zip(PROMPTS, greedy):
        for k in positions:
            if tokens[k] not in tokens[:k]:
                return prompt, k, tokens[k]
    raise AssertionError("no token appears first at the wanted positions; change PROMPTS")


@torch.inference_mode()
def hf_until_eos(model: Path, prompt: list[int], eos: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model(model).generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=20,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def test_eos_after_a_plain_step_stops_where_transformers_stops(base: Path, tmp_path: Path) -> None:
    prompt, k, eos = first_time_at(base, range(3, 10))
    model = with_eos(base, tmp_path / "m", eos)
    expected = hf_until_eos(model, prompt, eos)
    assert expected[-1] == eos and len(expected) == k + 1
    with LLM(str(model), num_kv_blocks=32, block_size=4, max_model_len=64) as llm:
        (out,) = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == expected
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason is None
        assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks


def test_eos_inside_accepted_drafts_drops_the_rest(base: Path, tmp_path: Path) -> None:
    # The draft is the target itself: every draft is accepted. The prompt pass emits token 0;
    # the first round drafts tokens 1-4 and adds a bonus token 5, so EOS at 2 or 3 falls inside
    # the accepted run, with accepted tokens after it.
    prompt, k, eos = first_time_at(base, range(2, 4))
    model = with_eos(base, tmp_path / "m", eos)
    expected = hf_until_eos(model, prompt, eos)
    assert len(expected) == k + 1
    with LLM(
        str(model),
        draft_model=str(model),
        num_speculative_tokens=4,
        num_kv_blocks=32,
        block_size=4,
        max_model_len=64,
    ) as llm:
        (out,) = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == expected
        assert out.outputs[0].finish_reason == "stop"
        assert out.metrics.spec_rounds == 1 and out.metrics.draft_tokens_accepted == 4
        assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
        # ignore_eos keeps going past it, as transformers does without an EOS
        keep = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        (more,) = llm.generate({"prompt_token_ids": prompt}, keep, use_tqdm=False)
        assert more.outputs[0].token_ids == hf_greedy(model, [prompt], 12)[0]
        assert more.outputs[0].finish_reason == "length"
