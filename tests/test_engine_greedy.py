"""Greedy outputs equal transformers' greedy generate, token for token, through every path:
plain decoding, speculative decoding, and a KV pool so small that preemption happens."""

from __future__ import annotations

import random

import pytest

from specbatch import LLM, SamplingParams
from tests.helpers import hf_greedy, make_perturbed_draft

MAX_NEW = 24
ARCH_CASES = {
    "llama": dict(arch="llama"),
    "llama-tied": dict(arch="llama", tie_word_embeddings=True),
    "llama3-rope": dict(
        arch="llama",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": dict(arch="mistral"),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3", head_dim=32),
}


def prompts(seed: int = 0, n: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(1, 40))] for _ in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def generate(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks, "leaked KV blocks"
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def draft(make_checkpoint):
    """One small draft for every architecture: only the vocabulary has to match."""
    return make_checkpoint(
        "llama",
        num_layers=1,
        hidden_size=32,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        seed=7,
    )


@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_greedy_matches_transformers(make_checkpoint, draft, case):
    kwargs = dict(ARCH_CASES[case])
    arch = kwargs.pop("arch")
    target = make_checkpoint(arch, **kwargs)
    batch = prompts()
    expected = hf_greedy(target, batch, MAX_NEW)
    common = dict(block_size=4, max_model_len=128, seed=0)
    plain = LLM(str(target), num_kv_blocks=256, **common)
    assert generate(plain, batch) == expected
    spec = LLM(
        str(target), draft_model=str(draft), num_speculative_tokens=3, num_kv_blocks=256, **common
    )
    assert generate(spec, batch) == expected
    assert spec.engine.metrics.spec.proposed > 0


def test_greedy_with_preemption_and_a_good_draft(make_checkpoint, tmp_path):
    target = make_checkpoint("llama")
    good_draft = make_perturbed_draft(target, tmp_path / "draft", noise=0.1)
    batch = prompts(seed=1, n=12)
    expected = hf_greedy(target, batch, MAX_NEW)
    # 24 blocks of 4 = 96 slots: far fewer than 12 requests need at once
    for kw in ({}, dict(draft_model=str(good_draft), num_speculative_tokens=4)):
        llm = LLM(str(target), num_kv_blocks=24, block_size=4, max_model_len=96, **kw)
        assert generate(llm, batch) == expected
        assert llm.engine.metrics.num_preemptions > 0
        if kw:
            assert llm.engine.metrics.spec.accepted > 0


def test_chunked_prefill_and_tight_token_budget(make_checkpoint, draft):
    target = make_checkpoint("qwen2")
    batch = prompts(seed=2, n=6)
    expected = hf_greedy(target, batch, MAX_NEW)
    llm = LLM(
        str(target),
        draft_model=str(draft),
        num_speculative_tokens=2,
        num_kv_blocks=128,
        block_size=8,
        max_model_len=128,
        max_num_batched_tokens=7,
        max_num_seqs=3,
    )
    assert generate(llm, batch) == expected
