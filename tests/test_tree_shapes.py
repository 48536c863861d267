"""Draft trees of every shape through the whole engine: narrow and deep ones (fewer nodes than
``topk x (depth - 1)``), nuclei narrower than ``topk``, tiny vocabularies, many rounds.

Each round's verified tree is checked against its shape (no node with more than ``topk``
children, none deeper than ``depth``, at most ``nodes`` of them); the lookahead the scheduler
reserves is checked against what the drafter's passes and the target really write; the law of
whole outputs by chi-square as in tests/test_exactness.py (false alarm 1e-3 a test, power
checked against a total-variation error of 0.03).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from specbatch import LLM, SamplingParams
from specbatch.draft_shape import DraftShape
from specbatch.testing.eagle_heads import make_eagle_head
from specbatch.worker import draft_tree, worker
from tests.helpers import (
    exact_joint,
    exactness_target,
    greedy_token_ids,
    hf_greedy,
    make_perturbed_draft,
)
from tests.test_exactness import assert_matches

VERIFY_TREE = worker.verify_tree
BEAM_INPUTS = draft_tree.beam_inputs
NARROW = [DraftShape(4, 2, 3), DraftShape(5, 3, 2), DraftShape(3, 4, 1), DraftShape(4, 2, 8)]


def spec_of(shape: DraftShape, method: str, model) -> dict:
    return {
        "method": method,
        "model": str(model),
        "num_speculative_tokens": shape.depth,
        "topk": shape.topk,
        "num_draft_tokens": shape.nodes,
    }


class TreeSpy:
    """Wraps the worker's ``verify_tree``: every verified tree within ``shape``."""

    def __init__(self, monkeypatch, shape: DraftShape) -> None:
        self.shape, self.rounds = shape, 0

        def spy(tokens, topo, *args, **kwargs):
            counts = (topo.children >= 0).sum(dim=2)
            assert int(counts.max()) <= shape.topk, f"a node with {int(counts.max())} children"
            assert int(topo.depth.max()) <= shape.depth, f"a node at depth {int(topo.depth.max())}"
            assert tokens.shape[1] <= shape.nodes
            self.rounds += 1
            return VERIFY_TREE(tokens, topo, *args, **kwargs)

        monkeypatch.setattr(worker, "verify_tree", spy)


@pytest.fixture(scope="module")
def small_vocab(make_checkpoint, tmp_path_factory):
    """A target of 10 tokens and a noisy copy of it as its draft model."""
    target = exactness_target(make_checkpoint, 10)
    draft = make_perturbed_draft(target, tmp_path_factory.mktemp("d10"), noise=0.25, seed=1)
    return target, draft


def test_a_top_p_tree_of_many_rounds_keeps_the_targets_law(small_vocab, monkeypatch):
    """Top-p leaves fewer tokens than ``topk`` in many nuclei: candidates of probability 0,
    and last siblings whose children tie or outrank them in the pruning order."""
    target, draft = small_vocab
    shape = DraftShape(4, 2, 8)
    spy = TreeSpy(monkeypatch, shape)
    llm = LLM(str(target), speculative_config=spec_of(shape, "draft_model", draft),
              max_num_seqs=256, num_kv_blocks=2048, block_size=4, seed=0)  # fmt: skip
    prompt, n = [2, 8, 5, 1], 20_000
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
    assert spy.rounds > 100 and llm.engine.metrics.spec.accepted > 0
    samples = [tuple(o.outputs[0].token_ids[:4]) for o in outs]
    assert_matches(samples, exact_joint(target, prompt, 4, 0.7, 0.9, min_mass=1e-7))


def random_case(rng: random.Random) -> tuple[DraftShape, SamplingParams, str]:
    depth, topk = rng.randint(2, 5), rng.randint(2, 4)
    nodes = rng.randint(1, topk * depth)
    narrow = rng.choice([{"top_p": rng.uniform(0.3, 0.9)}, {"top_k": rng.randint(1, topk - 1)},
                         {"min_p": rng.uniform(0.1, 0.5)}, {}])  # fmt: skip
    params = SamplingParams(temperature=rng.choice([0.0, 0.5, 1.0]), max_tokens=rng.randint(4, 20),
                            ignore_eos=True, seed=rng.randrange(1000), **narrow)  # fmt: skip
    return DraftShape(depth, topk, nodes), params, rng.choice(["sampled", "top"])


@pytest.mark.parametrize("seed", range(6))
def test_random_tree_shapes_and_narrow_nuclei_finish_within_their_shape(
    small_vocab, monkeypatch, seed
):
    target, draft = small_vocab
    rng = random.Random(seed)
    for _ in range(4):
        shape, params, children = random_case(rng)
        spy = TreeSpy(monkeypatch, shape)
        spec = {**spec_of(shape, "draft_model", draft), "tree_children": children}
        llm = LLM(str(target), speculative_config=spec, max_num_seqs=64, num_kv_blocks=96,
                  block_size=rng.choice([1, 2, 4]), seed=seed, max_model_len=64)  # fmt: skip
        prompts = [[rng.randrange(10) for _ in range(rng.randint(1, 12))] for _ in range(300)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outs), (shape, params)
        assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
        assert spy.rounds > 0


@pytest.fixture(scope="module")
def llama(make_checkpoint, tmp_path_factory):
    target = make_checkpoint("llama", seed=11)
    root = tmp_path_factory.mktemp("narrow")
    draft = make_perturbed_draft(target, root / "d", noise=0.05, seed=2)
    head = make_eagle_head(root / "h", target, "eagle3", seed=4)
    return target, draft, head


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_narrow_deep_trees_equal_transformers_within_the_slots_they_reserve(
    llama, monkeypatch, method
):
    """Greedy output equal to transformers' for trees with fewer nodes than the drafter's
    passes expand; the scheduler's lookahead counted independently: the largest key index a
    drafter pass writes past the last known token, and the nodes the target verifies."""
    target, draft, head = llama
    model = draft if method == "draft_model" else head
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3] * 5, [100, 200, 30, 40]]
    ref = hf_greedy(target, prompts, 24)
    written: list[int] = []

    def spy(base, tables, d, k, *args, **kwargs):
        written.append((d - 1) * k + k)  # key indices base + (d - 1) k + j, j < k
        return BEAM_INPUTS(base, tables, d, k, *args, **kwargs)

    for shape in NARROW:
        written.clear()

        monkeypatch.setattr(draft_tree, "beam_inputs", spy)
        verified = TreeSpy(monkeypatch, shape)
        llm = LLM(str(target), speculative_config=spec_of(shape, method, model),
                  num_kv_blocks=64, block_size=2, max_model_len=128)  # fmt: skip
        assert greedy_token_ids(llm, prompts, 24) == ref, shape
        assert verified.rounds > 0
        assert shape.lookahead == max(*written, shape.nodes), shape


def test_the_lookahead_of_every_shape_covers_the_passes_and_the_nodes():
    """Against a count of the slots themselves: the drafter expands the ``topk`` best nodes of
    each depth but the last into one slot each, the target verifies ``nodes``."""
    for depth in range(1, 7):
        for topk in range(1, 5):
            for nodes in range(1, topk * depth + 1):
                shape = DraftShape(depth, topk, nodes) if topk > 1 else DraftShape.chain(depth)
                slots = set(range(shape.nodes))
                if topk > 1:
                    slots |= {(d - 1) * topk + j for d in range(1, depth) for j in range(topk)}
                assert shape.lookahead == max(slots) + 1, shape
    assert Counter(s.lookahead for s in NARROW) == Counter([6, 12, 8, 8])
