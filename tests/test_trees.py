"""Draft trees through the whole engine: greedy output equal to transformers', sampled output
distributed as the target's, the target's cache after a tree round equal to a chain's, every
block back in the pool.

Statistics as in tests/test_exactness.py (same pair, same N, same ALPHA and power bound): the
joint law of the first three generated tokens against the exact one, by chi-square, each test
checking first that it would catch a total-variation error of 0.03 with probability 0.9.
"""

from __future__ import annotations

import pytest
import torch

from specbatch import LLM, SamplingParams
from specbatch.testing.eagle_heads import make_eagle_head
from tests.helpers import (
    exact_joint,
    exactness_target,
    greedy_token_ids,
    hf_greedy,
    make_perturbed_draft,
)
from tests.test_exactness import PROMPT, VOCAB, assert_matches, sample_sequences

N = 14_000
TREE = {"num_speculative_tokens": 3, "topk": 2, "num_draft_tokens": 5}
BACKENDS = ["auto", "torch"]  # specbatch's CPU kernel where it builds, and the torch reference


@pytest.fixture(scope="module")
def pair(make_checkpoint, tmp_path_factory):
    target = exactness_target(make_checkpoint, VOCAB)
    root = tmp_path_factory.mktemp("tree_pair")
    draft = make_perturbed_draft(target, root / "draft", noise=0.25, seed=1)
    head = make_eagle_head(root / "head", target, "eagle3", seed=2, scale=0.5)
    return target, draft, head


def drafter(pair, method: str) -> dict:
    _, draft, head = pair
    model = draft if method == "draft_model" else head
    return {"method": method, "model": str(model)}


def engine(pair, method: str, seed: int = 0, backend: str = "auto", **spec) -> LLM:
    config = {**drafter(pair, method), **TREE, **spec}
    return LLM(
        str(pair[0]),
        speculative_config=config,
        attention_backend=backend,
        max_num_seqs=256,
        num_kv_blocks=1024,
        block_size=4,
        seed=seed,
        max_model_len=64,
    )


# Each (temperature, top_p) with both ways of choosing children, and each drafter with both
# settings and both ways, but not every drafter with every combination: in a tree a drafter
# gives only the roots' logits and each depth's pass (draft_loop.grow); q (temperature, top-p),
# the children and the verification rule are TreeGrower's and the worker's, one code for both.
@pytest.mark.parametrize(
    ("temperature", "top_p", "children", "method"),
    [
        (1.0, 1.0, "sampled", "draft_model"),
        (1.0, 1.0, "top", "eagle3"),
        (0.7, 0.9, "sampled", "eagle3"),
        (0.7, 0.9, "top", "draft_model"),
    ],
)
def test_tree_sampling_is_the_targets_law(pair, method, children, temperature, top_p):
    llm = engine(pair, method, seed=3, tree_children=children)
    params = [
        SamplingParams(temperature=temperature, top_p=top_p, max_tokens=5, ignore_eos=True)
    ] * N
    samples = sample_sequences(llm, params)
    spec = llm.engine.metrics.spec
    assert spec.proposed > 0 and 0.05 < spec.acceptance_rate < 0.98
    assert max(len(o) for o in [spec.reached_by_position]) >= 2  # paths deeper than one node
    assert_matches(samples, exact_joint(pair[0], PROMPT, 3, temperature, top_p))


PENALTIES = dict(presence=0.6, frequency=-0.3, repetition=1.3, min_tokens=2, banned=(2,))


def test_tree_sampling_with_penalties(pair):
    """Each node's p is penalised with its own path (not the other branches' drafts)."""
    llm = engine(pair, "draft_model", seed=5)
    params = [
        SamplingParams(
            temperature=1.0,
            max_tokens=5,
            ignore_eos=True,
            presence_penalty=PENALTIES["presence"],
            frequency_penalty=PENALTIES["frequency"],
            repetition_penalty=PENALTIES["repetition"],
            min_tokens=PENALTIES["min_tokens"],
            stop_token_ids=[2],
        )
    ] * N
    samples = sample_sequences(llm, params)
    assert_matches(samples, exact_joint(pair[0], PROMPT, 3, 1.0, penalties=PENALTIES))


def test_a_node_attending_to_a_non_ancestor_is_caught(pair, monkeypatch):
    """Every node seeing every earlier node (the causal rule instead of the tree's) must be
    detected."""
    from specbatch.model.layers import attention

    real = attention.tree_visibility

    def causal(first, bits, keys, valid):
        return real(first, torch.full_like(bits, -1), keys, valid)

    monkeypatch.setattr(attention, "tree_visibility", causal)
    llm = engine(pair, "draft_model", seed=6, backend="torch")
    params = [SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)] * N
    samples = sample_sequences(llm, params)
    with pytest.raises(AssertionError, match="p="):
        assert_matches(samples, exact_joint(pair[0], PROMPT, 3))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_greedy_tree_output_equals_transformers(make_checkpoint, tmp_path, arch, method, backend):
    target = make_checkpoint(arch, seed=11)
    draft = make_perturbed_draft(target, tmp_path / "d", noise=0.05, seed=2)
    head = make_eagle_head(tmp_path / "h", target, "eagle3", seed=4)
    model = draft if method == "draft_model" else head
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3] * 5, [100, 200, 30, 40]]
    ref = hf_greedy(target, prompts, 24)
    for shape in ({"topk": 2, "num_draft_tokens": 6}, {"topk": 4, "num_draft_tokens": 12}):
        spec = {"method": method, "model": str(model), "num_speculative_tokens": 4, **shape}
        llm = LLM(str(target), speculative_config=spec, attention_backend=backend,
                  num_kv_blocks=64, block_size=4, max_model_len=128)  # fmt: skip
        assert greedy_token_ids(llm, prompts, 24) == ref
        if method == "draft_model":
            assert llm.engine.metrics.spec.mean_tokens_per_round > 2.0


def cache_rows(llm: LLM, table: list[int], n: int, runner=None) -> list[torch.Tensor]:
    """Keys and values of positions 0..n-1 of a request, layer by layer: in the target's cache,
    or in ``runner``'s (an EAGLE proposer's: its head's)."""
    runner = runner or llm.engine.executor.worker.target
    backend = runner.head.attention_backend if hasattr(runner, "head") else runner.backend
    bs = llm.engine.config.block_size
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)], dtype=torch.int64)
    out = []
    for k, v in runner.kv_caches:
        kernels = getattr(backend, "kernels", None)
        if kernels is not None:  # the CPU kernel's own layout
            keys, values = kernels.slot_elements(k, v)
            out += [k.view(-1)[keys(slots)].clone(), v.view(-1)[values(slots)].clone()]
        else:
            out += [k.view(-1, *k.shape[2:])[slots].clone(), v.view(-1, *v.shape[2:])[slots]]
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_after_tree_rounds_the_cache_holds_the_accepted_path(pair, backend):
    """The target's cache after greedy tree rounds equals the cache of plain decoding of the
    same tokens, slot by slot: accepted nodes were moved next to their roots."""
    prompt = [0, 1, 2, 2, 1]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seen = {}
    for name, spec in (("tree", {**drafter(pair, "draft_model"), **TREE}), ("plain", None)):
        llm = LLM(str(pair[0]), speculative_config=spec, attention_backend=backend,
                  num_kv_blocks=64, block_size=4)  # fmt: skip
        e = llm.engine
        e.add_request({"prompt_token_ids": prompt}, params, request_id="r")
        while e.has_unfinished_requests():
            outs = e.step()
            req = e.scheduler.requests.get("r")
            if req is not None:
                table = list(e.kv_cache.block_table("r"))
                n = req.num_computed
                seen[name] = (list(req.prompt_token_ids + req.output_token_ids)[:n],
                              cache_rows(llm, table, n))  # fmt: skip
        if name == "tree":
            assert e.metrics.spec.accepted > 0 and outs
    (tokens_t, rows_t), (tokens_p, rows_p) = seen["tree"], seen["plain"]
    n = min(len(tokens_t), len(tokens_p))
    assert tokens_t[:n] == tokens_p[:n] and n > len(prompt) + 4
    for a, b in zip(rows_t, rows_p, strict=True):
        torch.testing.assert_close(a[:n], b[:n], atol=1e-5, rtol=1e-5)


def head_states(llm: LLM, prompt: list[int], monkeypatch) -> tuple[dict, list, int]:
    """Greedy decoding of one request, step by step: the target features the EAGLE head keeps
    for each position, the head's cache of the positions it has read, and how many accepted
    nodes were moved into place (a path other than the first child's)."""
    e, proposer = llm.engine, llm.engine.executor.worker.drafter
    moved = [0]
    target = e.executor.worker.target
    real_move = target.move_kv

    def move_kv(src, dst):
        moved[0] += len(src)
        return real_move(src, dst)

    monkeypatch.setattr(target, "move_kv", move_kv)
    features: dict[int, torch.Tensor] = {}
    head_cache: list = []
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    e.add_request({"prompt_token_ids": prompt}, params, request_id="r")
    while e.has_unfinished_requests():
        e.step()
        kept = proposer.pending.get("r")
        if kept is None or not kept.chunks or "r" not in e.scheduler.requests:
            continue
        rows = torch.cat(kept.chunks)
        features.update({kept.start + i: rows[i].clone() for i in range(rows.shape[0])})
        head_cache = cache_rows(llm, list(e.kv_cache.block_table("r")), kept.start, proposer)
    return features, head_cache, moved[0]


def test_after_tree_rounds_the_heads_state_is_a_chains(pair, monkeypatch):
    """The EAGLE head keeps the target's features of the accepted path's nodes (not of the
    nodes that sat first in the tree) and reads them into its cache: the same features and the
    same cache as a chain run that accepted the same tokens."""
    runs = {}
    for name, spec in (("tree", TREE), ("chain", {"num_speculative_tokens": 3})):
        llm = LLM(str(pair[0]), speculative_config={**drafter(pair, "eagle3"), **spec},
                  num_kv_blocks=64, block_size=4, attention_backend="torch")  # fmt: skip
        runs[name] = head_states(llm, [0, 1, 2, 2, 1], monkeypatch)
    (feat_t, cache_t, moved), (feat_c, cache_c, _) = runs["tree"], runs["chain"]
    assert moved > 0  # some round accepted a path off the first children
    common = sorted(set(feat_t) & set(feat_c))
    assert len(common) > 20
    for p in common:
        torch.testing.assert_close(feat_t[p], feat_c[p], atol=1e-5, rtol=1e-5)
    n = min(cache_t[0].shape[0], cache_c[0].shape[0])
    assert n > 0
    for a, b in zip(cache_t, cache_c, strict=True):
        torch.testing.assert_close(a[:n], b[:n], atol=1e-5, rtol=1e-5)


def test_ngram_trie_of_several_matches():
    from specbatch.worker.ngram_proposer import NgramIndex

    ix = NgramIndex(1, 2)
    ix.extend([7, 1, 2, 3, 9, 1, 2, 4, 5, 1, 2, 3, 6, 1, 2])
    # the suffix [1, 2] was followed by 3 6, 4 5, 3 9 (latest first); [2] by the same
    tokens, parents = ix.propose_tree(depth=2, topk=2, nodes=5)
    assert tokens == [3, 6, 4, 5, 9] and parents == [0, 1, 0, 3, 1]
    assert ix.propose_tree(depth=2, topk=1, nodes=5) == ([3, 6], [0, 1])  # a chain
    assert ix.propose_tree(depth=1, topk=4, nodes=8) == ([3, 4], [0, 0])


def ngram(pair, **spec) -> LLM:
    config = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 2, **TREE, **spec}
    return LLM(str(pair[0]), speculative_config=config, max_num_seqs=256, num_kv_blocks=1024,
               block_size=4, seed=8, max_model_len=64)  # fmt: skip


def test_ngram_trees_sample_the_targets_law(pair):
    llm = ngram(pair)
    params = [SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)] * N
    samples = sample_sequences(llm, params)
    spec = llm.engine.metrics.spec
    assert spec.proposed > 0 and spec.accepted > 0
    assert_matches(samples, exact_joint(pair[0], PROMPT, 3))


def test_greedy_ngram_trees_equal_transformers(make_checkpoint):
    target = make_checkpoint("llama", seed=11)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 9, 5, 6], [1, 2, 3] * 5, [100, 200, 30, 40, 100, 200]]
    ref = hf_greedy(target, prompts, 24)
    for backend in BACKENDS:
        spec = {"method": "ngram", "num_speculative_tokens": 4, "topk": 3, "num_draft_tokens": 8}
        llm = LLM(str(target), speculative_config=spec, attention_backend=backend,
                  num_kv_blocks=64, block_size=4, max_model_len=128)  # fmt: skip
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            use_tqdm=False,
        )
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
