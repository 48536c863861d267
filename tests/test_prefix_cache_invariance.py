"""With ``batch_invariant=True``, the prefix cache changes no bit: the built-in pair with its
EAGLE head returns the same tokens for seeded sampled requests, and proposes the same drafts
(the same acceptance counts, request by request), with the cache on and off, in a roomy pool and
in one so small that requests are preempted and cached blocks evicted. A request's K/V do not
depend on the batch that computed them, so a block computed for one request is bit for bit the
block any other would have computed; the drafts show that the EAGLE head's cache at block
boundaries is right (exactness alone would hide a wrong draft)."""

from __future__ import annotations

import random

import pytest

from specbatch import LLM, SamplingParams
from specbatch.kernels.cpu import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels do not build here")


def shared_prefix_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts on three prefixes (two full blocks and a part, one block, one block and a
    part), each with its own suffix; every fourth one repeats an earlier prompt whole."""
    from specbatch.bench.workload import heldout_token_stream
    from specbatch.model.model_pair import default_model_path
    from specbatch.tokenizer import load_tokenizer

    stream, _ = heldout_token_stream(load_tokenizer(default_model_path("target")))
    rng = random.Random(seed)
    prefixes = [stream[100:140], stream[900:916], stream[2000:2024]]
    out: list[list[int]] = []
    for i in range(n):
        if i % 4 == 3:
            out.append(list(out[rng.randrange(len(out))]))
            continue
        start = rng.randrange(len(stream) - 20)
        out.append(prefixes[i % 3] + stream[start : start + rng.randrange(1, 20)])
    return out


def run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    params = [
        SamplingParams(temperature=1.0, top_p=0.95, seed=500 + i, max_tokens=20, ignore_eos=True)
        for i in range(len(prompts))
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
    return [(list(o.outputs[0].token_ids), o.metrics.draft_tokens_accepted) for o in outs]


@pytest.mark.parametrize("num_kv_blocks", [None, 12], ids=["roomy", "small-pool"])
def test_seeded_outputs_and_drafts_are_the_same_with_the_cache_on_and_off(num_kv_blocks):
    prompts = shared_prefix_prompts(24)
    results = {}
    for caching in (False, True):
        llm = LLM(num_speculative_tokens=3, batch_invariant=True, max_model_len=128,
                  num_kv_blocks=num_kv_blocks, enable_prefix_caching=caching)  # fmt: skip
        first = run(llm, prompts[:12])  # the second call also hits the first one's outputs
        second = run(llm, prompts[12:] + [p + t for p, (t, _) in zip(prompts, first[:4])])
        results[caching] = first + second
        m = llm.engine.metrics
        assert (m.prefix_cache_hits > 300) == caching, m.prefix_cache_hits
        if num_kv_blocks:
            assert m.num_preemptions > 0
            assert (llm.engine.kv_cache.pool.num_evictions > 0) == caching
    assert results[True] == results[False]
