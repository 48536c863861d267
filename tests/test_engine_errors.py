"""Bad input gets a clear InvalidInputError naming the field and the limit, and loses no work."""

from __future__ import annotations

import json

import pytest

from specbatch import LLM, InvalidInputError, SamplingParams


@pytest.fixture(scope="module")
def llm(make_checkpoint):
    return LLM(str(make_checkpoint("llama")), num_kv_blocks=32, block_size=4, max_model_len=64)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_tokens=0), "max_tokens must be >= 1"),
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(top_p=0.0), "top_p must be in (0, 1]"),
        (dict(top_p=1.5), "top_p must be in (0, 1]"),
        (dict(top_k=-3), "top_k"),
        (dict(min_p=2.0), "min_p must be in [0, 1]"),
        (dict(temperature="hot"), "temperature must be a number"),
        (dict(stop=[""]), "stop strings must not be empty"),
        (dict(n=0), "n must be in [1, 128]"),
        (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
        (dict(frequency_penalty=-3), "frequency_penalty must be in [-2, 2]"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
        (dict(min_tokens=-1), "min_tokens must be >= 0"),
        (dict(min_tokens=5, max_tokens=3), "must be at most max_tokens"),
        (dict(logprobs=21), "logprobs must be in [0, 20]"),
        (dict(prompt_logprobs=-1), "prompt_logprobs must be in [0, 20]"),
        (dict(seed=2**70), "seed must be in"),
        (dict(temperature=float("inf")), "temperature must be a finite number"),
        (dict(temperature=float("nan")), "temperature must be a finite number"),
        (dict(temperature=10**400), "temperature must be a finite number"),
        (dict(top_p=float("nan")), "top_p must be a finite number"),
        (dict(min_p=float("-inf")), "min_p must be a finite number"),
    ],
)
def test_bad_sampling_parameters(kwargs, message):
    with pytest.raises(InvalidInputError, match=message.replace("(", r"\(").replace("[", r"\[")):
        SamplingParams(**kwargs)


def test_empty_and_over_long_prompts_name_the_prompt_and_the_limit(llm):
    with pytest.raises(InvalidInputError, match=r"prompts\[1\]: the prompt is empty"):
        llm.generate([{"prompt_token_ids": [1]}, {"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(
        InvalidInputError, match=r"prompts\[0\]: 64 tokens, more than the limit of 63"
    ):
        llm.generate({"prompt_token_ids": [5] * 64}, use_tqdm=False)
    with pytest.raises(InvalidInputError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [5, 999]}, use_tqdm=False)
    # nothing was left behind by the rejected calls, and the engine still works
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
    out = llm.generate({"prompt_token_ids": [5] * 63}, SamplingParams(max_tokens=4), use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "length" and len(out[0].outputs[0].token_ids) == 1


def test_text_prompt_without_a_tokenizer(llm):
    with pytest.raises(InvalidInputError, match="no tokenizer"):
        llm.generate("hello", use_tqdm=False)
    # stop strings need a tokenizer too; the valid prompt before it is not left queued
    params = [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, stop=["x"])]
    with pytest.raises(InvalidInputError, match="stop strings need a tokenizer"):
        llm.generate([{"prompt_token_ids": [5]}] * 2, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_model_paths(tmp_path, make_checkpoint):
    with pytest.raises(InvalidInputError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(InvalidInputError, match=r"no config\.json"):
        LLM(str(tmp_path))
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(InvalidInputError, match="supported"):
        LLM(str(bad))
    target = str(make_checkpoint("llama"))
    with pytest.raises(InvalidInputError, match=r"draft_model: path .* does not exist"):
        LLM(target, draft_model=str(tmp_path / "nope"), num_speculative_tokens=2)


def test_draft_with_another_vocabulary(make_checkpoint):
    target = str(make_checkpoint("llama", vocab_size=256))
    draft = str(make_checkpoint("llama", vocab_size=128))
    with pytest.raises(InvalidInputError, match="draft_model: vocab_size 128 differs"):
        LLM(target, draft_model=draft, num_speculative_tokens=2)


def test_kv_budget_too_small_for_one_request(make_checkpoint):
    target = str(make_checkpoint("llama"))
    with pytest.raises(InvalidInputError, match=r"KV cache too small.*max_model_len=512"):
        LLM(target, kv_cache_memory="64KiB")
    with pytest.raises(InvalidInputError, match="cannot read 'lots' as a size"):
        LLM(target, kv_cache_memory="lots")


def test_bad_engine_arguments(make_checkpoint):
    target = str(make_checkpoint("llama"))
    with pytest.raises(InvalidInputError, match="dtype must be one of"):
        LLM(target, dtype="float8")
    with pytest.raises(InvalidInputError, match="max_model_len=4096 exceeds"):
        LLM(target, max_model_len=4096)
    with pytest.raises(InvalidInputError, match="needs a draft model"):
        LLM(target, num_speculative_tokens=3)
    with pytest.raises(InvalidInputError, match="tensor_parallel_size=3 does not divide"):
        LLM(target, tensor_parallel_size=3)


def test_a_text_prompt_longer_than_any_within_the_limit_is_refused_unread(
    make_checkpoint, monkeypatch
):
    llm = LLM(
        str(make_checkpoint("llama", with_tokenizer=True)), num_kv_blocks=32, max_model_len=64
    )
    engine = llm.engine
    longest = max(len(t) for t in engine.tokenizer.get_vocab())
    assert engine.max_prompt_chars == 63 * longest  # no 63 tokens cover more characters
    calls = []
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: calls.append(a) or [5])
    with pytest.raises(InvalidInputError, match=r"prompts\[0\]: \d+ characters, more than the"):
        llm.generate("a" * (engine.max_prompt_chars + 1), use_tqdm=False)
    assert calls == []  # refused before any tokenization
    llm.generate("a" * engine.max_prompt_chars, SamplingParams(max_tokens=1), use_tqdm=False)
    assert len(calls) == 1
