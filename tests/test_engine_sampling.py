"""Seeded sampling is reproducible whatever the batch; different seeds differ."""

from __future__ import annotations

import pytest

from specbatch import LLM, SamplingParams


@pytest.fixture(scope="module")
def models(make_checkpoint):
    target = make_checkpoint("llama", seed=0)
    draft = make_checkpoint(
        "llama",
        num_layers=1,
        hidden_size=32,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        seed=7,
    )
    return str(target), str(draft)


def run(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("speculative", [False, True])
def test_seeded_request_is_the_same_alone_and_in_a_mixed_batch(models, speculative):
    target, draft = models
    kw = dict(draft_model=draft, num_speculative_tokens=3) if speculative else {}
    llm = LLM(target, num_kv_blocks=256, block_size=4, max_model_len=128, **kw)
    mine = {"prompt_token_ids": [10, 20, 30, 40]}
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=30, seed=1234, ignore_eos=True)
    alone = run(llm, [mine], [params])[0]
    others = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 1, 40, 8)]
    other_params = [
        SamplingParams(temperature=t, top_k=k, max_tokens=m, ignore_eos=True)
        for t, k, m in ((0.0, 0, 5), (1.3, 5, 40), (0.5, 0, 12), (1.0, 0, 3), (0.8, 2, 25))
    ]
    for position in (0, 3, 5):
        batch = [*others[:position], mine, *others[position:]]
        ps = [*other_params[:position], params, *other_params[position:]]
        assert run(llm, batch, ps)[position] == alone
    different = SamplingParams(
        temperature=0.9, top_p=0.95, max_tokens=30, seed=4321, ignore_eos=True
    )
    assert run(llm, [mine], [different])[0] != alone


def test_unseeded_requests_differ_but_engine_seed_reproduces(models):
    target, _ = models
    params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    prompt = {"prompt_token_ids": [7, 8, 9]}
    first = LLM(target, num_kv_blocks=64, block_size=4, max_model_len=64, seed=5)
    a = run(first, [prompt, prompt], [params, params])
    assert a[0] != a[1]
    second = LLM(target, num_kv_blocks=64, block_size=4, max_model_len=64, seed=5)
    assert run(second, [prompt, prompt], [params, params]) == a
