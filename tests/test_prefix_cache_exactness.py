"""Sampling exactness when prompts start on cached blocks: the joint of the first three tokens
of requests whose whole prompt is cached is the target's, with a draft model (the last prompt
token recomputed in a copy of its block, for its logits) and with an EAGLE head (the same, and
the head's position there, whose cached K/V read another request's first output token,
recomputed from the target's feature with the request's own token).

The design is tests/test_exactness.py's: a 3-token vocabulary, N = 14,000 samples, a chi-square
goodness-of-fit test rejecting at p < ALPHA = 1e-3 (the false-alarm rate; seeds are fixed), and
each test first checks that it catches an error of total variation 0.03 in the joint with
probability >= 0.90 (``specbatch.stats.power`` at its degrees of freedom, less what its pooled
bin could hide). Every one of the N requests must have found its prompt's blocks cached.
"""

from __future__ import annotations

import pytest

from specbatch import LLM, SamplingParams
from specbatch.testing.eagle_heads import make_eagle_head
from tests.helpers import exact_joint, exactness_target, make_perturbed_draft
from tests.test_exactness import VOCAB, N, assert_matches

PROMPT = [1, 2, 0, 1]  # two full blocks of 2


@pytest.fixture(scope="module")
def models(make_checkpoint, tmp_path_factory):
    target = exactness_target(make_checkpoint, VOCAB)
    draft = make_perturbed_draft(target, tmp_path_factory.mktemp("draft"), noise=0.25, seed=1)
    head = make_eagle_head(tmp_path_factory.mktemp("head"), target, "eagle3", seed=5)
    return target, {"draft_model": draft, "eagle3": head}


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_requests_starting_on_cached_blocks_sample_the_targets_joint(models, method):
    target, drafters = models
    spec = {"method": method, "model": str(drafters[method]), "num_speculative_tokens": 3}
    llm = LLM(str(target), speculative_config=spec, block_size=2, num_kv_blocks=2048,
              max_num_seqs=256, max_model_len=32, seed=3)  # fmt: skip
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate({"prompt_token_ids": PROMPT}, warm, use_tqdm=False)  # publishes the blocks
    before = llm.engine.metrics.prefix_cache_hits
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N, params, use_tqdm=False)
    e = llm.engine
    assert e.metrics.prefix_cache_hits - before == N * 3  # two blocks, less one recomputed
    assert e.num_free_kv_blocks == e.num_kv_blocks
    spec_stats = e.metrics.spec
    assert spec_stats.proposed > N and 0.05 < spec_stats.acceptance_rate < 0.98
    samples = [tuple(o.outputs[0].token_ids[:3]) for o in outs]
    assert_matches(samples, exact_joint(target, PROMPT, 3))
