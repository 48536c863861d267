"""A mixed offline load on a small KV pool, through ``LLM.generate``: ``n > 1`` groups, logprobs,
penalties, ``min_tokens``, stops, seeds and temperatures together, with speculation and
preemption. Every request finishes and every block returns to the pool."""

import random

import pytest

from specbatch import LLM, SamplingParams
from specbatch.testing.eagle_heads import make_eagle_head


def mixed_params(rng: random.Random) -> SamplingParams:
    max_tokens = rng.randint(1, 24)
    return SamplingParams(
        n=rng.choice([1, 1, 3]),
        temperature=rng.choice([0.0, 0.7, 1.0, 1.5]),
        top_p=rng.choice([1.0, 0.9]),
        logprobs=rng.choice([None, None, 2]),
        presence_penalty=rng.choice([0.0, 0.5]),
        repetition_penalty=rng.choice([1.0, 1.1]),
        min_tokens=rng.choice([0, min(3, max_tokens)]),
        stop_token_ids=rng.choice([None, [7]]),
        seed=rng.choice([None, rng.randrange(1000)]),
        max_tokens=max_tokens,
    )


@pytest.mark.parametrize("method", ["draft_model", "eagle", "ngram"])
def test_a_mixed_load_on_a_small_pool_finishes(make_checkpoint, tmp_path, method):
    target = make_checkpoint("llama", max_position_embeddings=128)
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": 3}}.get(method)
    if method == "draft_model":
        draft = make_checkpoint("llama", hidden_size=32, num_layers=1, seed=5)
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    elif method == "eagle":
        head = make_eagle_head(tmp_path / "e3", target, "eagle3", seed=3)
        spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    # 32 blocks of 4 = 128 slots: one request of max_model_len fits, an n = 3 group of long
    # prompts does not, so groups serialise and requests are preempted
    llm = LLM(target, speculative_config=spec, num_kv_blocks=32, block_size=4, max_num_seqs=16)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 256) for _ in range(rng.randint(1, 100))] for _ in range(60)]
    params = [mixed_params(rng) for _ in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [sp.n for sp in params]
    for out, sp in zip(outs, params):
        for c in out.outputs:
            assert c.finish_reason in ("stop", "length")
            assert sp.min_tokens <= len(c.token_ids) <= sp.max_tokens
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
