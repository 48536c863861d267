"""Prefix caching through the engine, on tiny random checkpoints: greedy outputs of requests that
start on cached blocks equal transformers' greedy generate with every drafter (chains, trees,
``auto``), also when the drafter lags (its requests drafting nothing), when the cached blocks
were written beside rolled-back drafts, when the pool is smaller than the distinct prefixes
(eviction), for ``n > 1`` with the cache on and off; and a planted bug that publishes a block
before its last slot holds a verified token's K/V is caught."""

from __future__ import annotations

import random

import pytest

from specbatch import LLM, SamplingParams
from specbatch.draft_shape import DraftShape
from specbatch.kv_cache.kv_cache_manager import KVCacheManager
from specbatch.request import Request
from specbatch.scheduler.drafter_lag import DrafterLag
from specbatch.scheduler.speculation import FixedDraft
from specbatch.testing.eagle_heads import make_eagle_head
from tests.helpers import hf_greedy, make_perturbed_draft

BS = 4
MAX_NEW = 16
TREE = {"num_speculative_tokens": 3, "topk": 2, "num_draft_tokens": 5}
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
SPEC = {
    "plain": None,
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    "eagle3": {"method": "eagle3", "num_speculative_tokens": 3},
    "eagle3-auto": {"method": "eagle3", "num_speculative_tokens": "auto"},
    "draft_model-tree": {"method": "draft_model", **TREE},
    "eagle3-tree": {"method": "eagle3", **TREE},
    "ngram-tree": {"method": "ngram", **TREE, "prompt_lookup_min": 1},
}


@pytest.fixture(scope="module")
def models(make_checkpoint, tmp_path_factory):
    target = make_checkpoint("llama", max_position_embeddings=256)
    draft = make_perturbed_draft(target, tmp_path_factory.mktemp("draft"), noise=0.5, seed=3)
    head = make_eagle_head(tmp_path_factory.mktemp("eagle3"), target, "eagle3", seed=3)
    return target, draft, head


def engine(models, method: str, **kw) -> LLM:
    target, draft, head = models
    spec = SPEC[method]
    if spec is not None and spec["method"] in ("draft_model", "eagle3"):
        spec = {**spec, "model": str(draft if spec["method"] == "draft_model" else head)}
    args = dict(num_kv_blocks=256, block_size=BS, max_model_len=200, seed=0)
    args.update(kw)
    return LLM(str(target), speculative_config=spec, **args)


def generate(llm: LLM, batch: list[list[int]], params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks, "a block was lost"
    return [list(o.outputs[0].token_ids) for o in outs]


def family(seed: int) -> tuple[list[int], list[list[int]]]:
    """A base prompt and prompts that share its first tokens: the whole of it, its full blocks
    exactly (a wholly cached prompt), its blocks then another token, a divergence inside a
    block, its first block only."""
    rng = random.Random(seed)
    base = [rng.randrange(3, 256) for _ in range(23)]
    new = [rng.randrange(3, 256) for _ in range(8)]
    return base, [base, base[:16], base[:16] + new, base[:18] + new, base[:4] + new]


@pytest.mark.parametrize("method", list(SPEC))
def test_greedy_with_hits_equals_transformers(models, method):
    llm = engine(models, method)
    base, variants = family(0)
    (first,) = generate(llm, [base])
    continued = base + first[:10] + [7]  # its blocks hold the first request's output too
    batch = [*variants, continued]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert [first, *got] == hf_greedy(models[0], [base, *batch], MAX_NEW)
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
    # every prompt found its full blocks of the base cached (a boundary token recomputed)
    cached = [o.num_cached_tokens for o in outs]
    eagle = method.startswith("eagle3")
    assert cached[:5] == ([20, 15, 15, 16, 3] if eagle else [20, 15, 16, 16, 4])
    # each variant's full blocks in the base were cached (less a recomputed last token)
    assert llm.engine.metrics.prefix_cache_hits >= 20 + 15 + 15 + 16 + 4 + 32 - 2


class DraftsNow(FixedDraft):
    """The engine's fixed drafts in one step of three, none in the others: its drafter lags
    in between, as under ``auto``."""

    def __init__(self, shape: DraftShape) -> None:
        super().__init__(shape)
        self.steps = 0

    def draft_shapes(
        self, requests: list[Request], prompt_rows: int = 0, plain: int = 0
    ) -> list[DraftShape]:
        self.steps += 1
        return [self.shape if self.steps % 3 == 0 else DraftShape()] * len(requests)


@pytest.mark.parametrize("method", ["draft_model", "eagle3", "eagle3-tree"])
def test_greedy_with_hits_while_the_drafter_lags(models, method):
    """Requests that draft in one step of three: their drafter catches up on every full block
    all the same, so the prompt and the output of the first are cached for the next ones."""
    llm = engine(models, method)
    sched = llm.engine.scheduler
    sched.policy = DraftsNow(llm.engine.config.speculative_config.shape)
    base, _ = family(4)
    (first,) = generate(llm, [base])
    batch = [base + first[:n] + [7] for n in (4, 9, 13)]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert [first, *got] == hf_greedy(models[0], [base, *batch], MAX_NEW)
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
    m = llm.engine.metrics
    assert m.spec.rounds > 0 and m.draft_length_counts[0] > m.spec.rounds  # mostly lagging
    # every full block the first request published (with an EAGLE head, less the position
    # whose K/V read the first request's next token rather than 7)
    eagle = method.startswith("eagle3")
    assert [o.num_cached_tokens for o in outs] == ([24, 31, 35] if eagle else [24, 32, 36])


def test_a_hit_on_blocks_whose_neighbours_were_rolled_back(models):
    """A draft that is often rejected: the first request's blocks were written beside drafts
    that were rolled back (and the slots rewritten); requests whose prompts run through its
    output start on those blocks and still generate transformers' tokens."""
    llm = engine(models, "draft_model")
    rng = random.Random(5)
    base = [rng.randrange(3, 256) for _ in range(9)]
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    (out,) = generate(llm, [base], long)
    spec = llm.engine.metrics.spec
    assert spec.rejections >= 5, "the draft should be rejected often"
    full = base + out
    batch = [[*full[:n], 5, 6] for n in (21, 32, 45, 60)]
    got = generate(llm, batch)
    assert got == hf_greedy(models[0], batch, MAX_NEW)
    assert llm.engine.metrics.prefix_cache_hits >= 20 + 32 + 44 + 60 - 4


def test_eviction_under_a_pool_smaller_than_the_prefixes(models):
    """Eight prefixes of 28 tokens (7 blocks each, 56 in all) through a pool of 24 blocks, two
    requests at a time, each prefix twice in a row with another suffix, three rounds: blocks
    are evicted and reused, the second request of a prefix finds it cached while its blocks
    last, every output stays right, and every block ends free or cached."""
    llm = engine(models, "eagle3", num_kv_blocks=24, max_num_seqs=2, max_model_len=64)
    rng = random.Random(1)
    prefixes = [[rng.randrange(3, 256) for _ in range(28)] for _ in range(8)]
    suffixes = [[rng.randrange(3, 256) for _ in range(3)] for _ in range(2)]
    batch = [
        prefixes[i + j] + s for i in range(0, 8, 2) for s in suffixes for j in (0, 1)
    ]  # p0+a, p1+a, p0+b, p1+b, p2+a, ...
    expected = hf_greedy(models[0], batch, MAX_NEW)
    for _ in range(3):
        assert generate(llm, batch) == expected
    pool = llm.engine.kv_cache.pool
    # each second request: its prefix, less the last token the EAGLE head reads again
    assert pool.num_evictions > 100 and llm.engine.metrics.prefix_cache_hits == 3 * 8 * 27
    assert pool.num_free == pool.num_blocks


@pytest.mark.parametrize("caching", [True, False], ids=["cache", "no-cache"])
def test_n_completions_with_the_cache_on_and_off(models, caching):
    llm = engine(models, "eagle3", enable_prefix_caching=caching)
    base, _ = family(2)
    params = SamplingParams(temperature=1.0, max_tokens=MAX_NEW, ignore_eos=True, n=3, seed=4)
    out = llm.generate({"prompt_token_ids": base}, params, use_tqdm=False)[0]
    got = [c.token_ids for c in out.outputs]
    assert len({tuple(t) for t in got}) == 3
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
    alone = SamplingParams(temperature=1.0, max_tokens=MAX_NEW, ignore_eos=True, seed=4)
    assert generate(llm, [base], alone)[0] == got[0]
    hits = llm.engine.metrics.prefix_cache_hits
    assert (hits >= 2 * 20 + 20) if caching else hits == 0


def test_reset_prefix_cache_forgets_every_block(models):
    llm = engine(models, "plain")
    base, _ = family(3)
    generate(llm, [base])
    assert llm.engine.kv_cache.num_cached_blocks > 0
    assert llm.reset_prefix_cache() is True
    assert llm.engine.kv_cache.num_cached_blocks == 0
    generate(llm, [base])
    assert llm.engine.metrics.prefix_cache_hits == 0


def publish_the_bonus_slot(monkeypatch) -> None:
    """The planted bug: a block is published once the last emitted token is known, before the
    target writes that token's K/V (its slot holds a rejected draft's, or nothing)."""
    monkeypatch.setattr(
        DrafterLag,
        "filled",
        lambda self, r: min(r.num_computed + 1, self.kv.num_slots(r.request_id)),
    )


def test_a_planted_bug_publishing_a_draft_slot_is_caught(models, monkeypatch):
    """The rollback guard refuses it; with the guard taken out too, the outputs of requests
    that start on such a block differ from transformers'."""
    rng = random.Random(7)
    bases = [[rng.randrange(3, 256) for _ in range(8)] for _ in range(6)]  # 8 + 16: 6 blocks
    publish_the_bonus_slot(monkeypatch)
    with pytest.raises(RuntimeError, match="published blocks"):
        generate(engine(models, "draft_model"), bases)

    def unguarded(self, request_id, num_slots):
        self._published[request_id] = 0
        guarded(self, request_id, num_slots)

    guarded = KVCacheManager.truncate
    monkeypatch.setattr(KVCacheManager, "truncate", unguarded)
    llm = engine(models, "draft_model")
    outs = generate(llm, bases)
    batch = [b + o + [5, 6] for b, o in zip(bases, outs)]
    got = generate(llm, batch)
    assert llm.engine.metrics.prefix_cache_hits >= 6 * 24 - 6
    assert got != hf_greedy(models[0], batch, MAX_NEW)
