"""Suffix decoding (``method: suffix``): the suffix tree against a brute-force recount (every
substring's count, the longest match, the most frequent continuation, the cuts by probability,
spec factor and depth, trees), the global cache bounded under a flood of requests and holding
nothing of an evicted request (a planted stale node is caught), the settings' errors, greedy
output equal to plain greedy (chains, trees, auto) and sampled output distributed as the
target's (chi-square as in tests/test_exactness.py), and the agentic bench workload.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from specbatch import LLM, InvalidInputError, SamplingParams
from specbatch.config import EngineArgs
from specbatch.worker import suffix_tree
from specbatch.worker.suffix_tree import Draft, SuffixCache, SuffixTree
from tests.helpers import exact_joint, exactness_target, greedy_token_ids
from tests.test_exactness import ALPHA, PROMPT, assert_matches

# --- the tree -----------------------------------------------------------------------------


def tree(depth: int, *seqs: list[int]) -> SuffixTree:
    t = SuffixTree(depth)
    for i, s in enumerate(seqs):
        t.extend(i, s)
    return t


def substring_counts(seqs: list[list[int]], depth: int) -> Counter[tuple[int, ...]]:
    out: Counter[tuple[int, ...]] = Counter()
    for s in seqs:
        for p in range(len(s)):
            for m in range(1, min(depth, len(s) - p) + 1):
                out[tuple(s[p : p + m])] += 1
    return out


def reference_chain(
    seqs: list[list[int]], depth: int, context: list[int], nodes: int, factor: float, least: float
) -> Draft | None:
    """The chain arctic-inference's rule gives, from substring counts alone: for each length m
    of the context's suffixes that occur, the most frequent continuation, token by token (its
    probability among the continuations, times the last), at most min(nodes, m * factor)
    tokens and depth - m; the best score, ties to the longer match. None: a tie of counts
    (the rule leaves their order to the implementation)."""
    counts = substring_counts(seqs, depth)
    best = Draft()
    for m in range(1, min(len(context), depth) + 1):
        path = tuple(context[len(context) - m :])
        if not counts[path]:
            break
        draft, prob = Draft(match_len=m), 1.0
        cap = min(nodes, int(m * factor + 1e-6))
        while len(draft.tokens) < cap and len(path) < depth:
            follow = {
                k[-1]: c for k, c in counts.items() if len(k) == len(path) + 1 and k[:-1] == path
            }
            if not follow:
                break
            most = max(follow.values())
            if list(follow.values()).count(most) > 1:
                return None
            if prob * most / sum(follow.values()) < least:
                break
            prob *= most / sum(follow.values())
            tok = next(t for t, c in follow.items() if c == most)
            draft.tokens.append(tok)
            draft.probs.append(prob)
            path = (*path, tok)
        if draft.tokens and draft.score >= best.score - 1e-12:
            best = draft
    return best


def test_every_substring_is_counted_once_as_it_occurs() -> None:
    rng = random.Random(0)
    for _ in range(300):
        depth, vocab = rng.randint(1, 6), rng.randint(1, 4)
        t, closed = SuffixTree(depth), set()
        for _ in range(rng.randint(1, 30)):
            sid = rng.randrange(5)
            if sid in closed:
                continue
            if rng.random() < 0.15 and sid in t.seqs:
                t.remove(sid) if rng.random() < 0.5 else t.close(sid)
                closed.add(sid)
            else:
                t.extend(sid, [rng.randrange(vocab) for _ in range(rng.randint(1, 4))])
            t.check()  # every count recounted from the sequences held, nothing else held
    assert tree(3, [5, 5, 5, 5]).count([5, 5]) == 3
    assert tree(3, [5, 5, 5, 5]).count([5, 5, 5, 5]) == 0  # deeper than the tree


def test_chains_follow_the_rule_on_random_sequences() -> None:
    rng = random.Random(1)
    checked = 0
    for _ in range(1500):
        depth, vocab = rng.randint(2, 7), rng.randint(2, 4)
        seqs = [[rng.randrange(vocab) for _ in range(rng.randint(1, 15))] for _ in range(3)]
        context = [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
        nodes, factor = rng.randint(1, 6), rng.choice([0.5, 1.0, 2.0])
        least = rng.choice([0.0, 0.1, 0.4])
        want = reference_chain(seqs, depth, context, nodes, factor, least)
        if want is None:
            continue
        got = tree(depth, *seqs).speculate(context, nodes, factor, least)
        assert (got.tokens, got.match_len if got.tokens else 0) == (want.tokens, want.match_len)
        assert got.score == pytest.approx(want.score)
        checked += 1
    assert checked > 900


def test_the_longest_match_wins_over_a_more_frequent_shorter_one() -> None:
    # [2, 3] is followed by 7 three times and by 9 once, after [1]: the context ends 1 2 3
    t = tree(24, [1, 2, 3, 9, 8, 6], [2, 3, 7], [0, 2, 3, 7], [5, 2, 3, 7])
    d = t.speculate([4, 1, 2, 3], nodes=8, spec_factor=1.0, min_prob=0.1)
    assert (d.tokens, d.match_len, d.probs) == ([9, 8, 6], 3, [1.0, 1.0, 1.0])
    d = t.speculate([4, 0, 2, 3], nodes=8, spec_factor=1.0, min_prob=0.1)
    assert (d.tokens, d.match_len) == ([7], 3)  # [0, 2, 3] occurred once, followed by 7


def test_the_most_frequent_continuation_and_its_probability() -> None:
    t = tree(24, [1, 2, 5], [1, 2, 6, 7], [1, 2, 6, 8])
    d = t.speculate([1, 2], nodes=2, spec_factor=1.0, min_prob=0.1)
    assert d.tokens == [6, 7] and d.probs == pytest.approx([2 / 3, 1 / 3])
    # an occurrence with nothing after it (the context's own) is not a continuation
    own = tree(24, [1, 2, 6, 1, 2])
    assert own.speculate([1, 2], 4, 1.0, 0.1).tokens == [6, 1]


def test_min_token_prob_cuts_where_the_paths_probability_falls_below_it() -> None:
    t = tree(24, [1, 2, 3, 4, 0], [1, 2, 3, 5, 0], [1, 2, 6, 0], [1, 2, 3, 4, 9])
    # after [1, 2]: 3 with 3/4; after [1, 2, 3]: 4 with 2/3, so the path 1/2; then 0 or 9: 1/4
    assert t.speculate([1, 2], 3, 2.0, 0.0).probs == pytest.approx([3 / 4, 1 / 2, 1 / 4])
    assert t.speculate([1, 2], 3, 2.0, 0.3).tokens == [3, 4]
    assert t.speculate([1, 2], 3, 2.0, 0.6).tokens == [3]
    assert t.speculate([1, 2], 3, 2.0, 0.8).tokens == []


def test_the_draft_follows_the_match_length_and_stops_at_the_trees_depth() -> None:
    seq = list(range(20))
    t = tree(24, seq)
    assert t.speculate([9, 1, 2], 10, 1.0, 0.1).tokens == [3, 4]  # a match of 2: 2 tokens
    assert t.speculate([9, 1, 2], 10, 2.0, 0.1).tokens == [3, 4, 5, 6]
    assert t.speculate([9, 1, 2], 10, 0.5, 0.1).tokens == [3]
    assert t.speculate([9, 1, 2], 10, 0.0, 0.1).tokens == []
    assert t.speculate([0, 1, 2, 3, 4, 5], 3, 1.0, 0.1).tokens == [6, 7, 8]  # nodes cap it
    shallow = tree(4, seq)  # a match and its draft together hold at most 4 tokens
    d = shallow.speculate([0, 1, 2], 10, 5.0, 0.1)
    assert (d.tokens, d.match_len) == ([3, 4, 5], 1)  # m = 3 would leave room for one token
    assert shallow.speculate([0, 1, 2], 10, 0.5, 0.1).tokens == [3]  # m = 2 and 3: 1 token
    assert max(map(len, substring_counts([seq], 4))) == 4
    shallow.check()


def test_trees_take_the_topk_most_frequent_continuations_best_first() -> None:
    t = tree(24, [1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4], [1, 2, 6, 7])
    d = t.speculate([1, 2], nodes=4, spec_factor=2.0, min_prob=0.1, depth=3, topk=2)
    # 3 (3/4) then its children 4 (1/2) and 5 (1/4); 6 (1/4) after 4 by probability
    assert d.tokens == [3, 4, 6, 5] and d.parents == [0, 1, 0, 1]
    assert d.probs == pytest.approx([3 / 4, 1 / 2, 1 / 4, 1 / 4])
    chain = t.speculate([1, 2], nodes=4, spec_factor=2.0, min_prob=0.1, depth=3, topk=1)
    assert (chain.tokens, chain.parents) == ([3, 4], [0, 1])
    narrow = t.speculate([1, 2], nodes=4, spec_factor=2.0, min_prob=0.3, depth=1, topk=2)
    assert narrow.tokens == [3]  # 6 is below 0.3; one level deep


# --- the cache ----------------------------------------------------------------------------


def test_a_requests_draft_is_the_better_of_its_own_trees_and_the_global_ones() -> None:
    rng = random.Random(2)
    for _ in range(300):
        depth, vocab = rng.randint(2, 8), rng.randint(2, 4)
        cache = SuffixCache(depth, rng.randint(0, 3))
        for r in range(rng.randint(1, 5)):
            seq = [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
            cache.start(f"r{r}", seq)
            for _ in range(rng.randint(0, 5)):
                out = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
                cache.extend(f"r{r}", out)
                seq += out
                nodes = rng.randint(1, 6)
                got = cache.speculate(f"r{r}", seq, nodes, 1.0, 0.1)
                own = cache.local[f"r{r}"].speculate(seq[-depth:], nodes, 1.0, 0.1)
                other = Draft()
                if cache.cached:
                    other = cache.global_tree.speculate(seq[-depth:], nodes, 1.0, 0.1)
                want = own if own.score >= other.score else other
                assert (got.tokens, got.score) == (want.tokens, pytest.approx(want.score))
            if rng.random() < 0.7:
                cache.stop(f"r{r}")
            cache.global_tree.check()


def test_the_global_cache_stays_bounded_under_a_flood_of_requests() -> None:
    depth, most = 6, 5
    cache = SuffixCache(depth, most)
    rng = random.Random(3)
    for r in range(400):
        rid = f"req-{r % 150}"  # ids come back too, as a server's may
        if rid in cache.local:
            cache.stop(rid)
        cache.start(rid, [rng.randrange(6) for _ in range(rng.randint(1, 20))])
        for _ in range(rng.randint(1, 6)):
            cache.extend(rid, [rng.randrange(6) for _ in range(rng.randint(1, 8))])
            cache.speculate(rid, [0, 1, 2], 4, 1.0, 0.1)
        if rng.random() < 0.9:
            cache.stop(rid)
        held = cache.global_tree.seqs
        tokens = sum(map(len, held.values()))
        assert len(cache.cached) <= most and set(held) <= set(cache.cached.values())
        assert cache.global_tree.num_nodes <= depth * tokens  # a node per token and depth
        assert len(cache.local) <= 150
        if r % 50 == 0:
            cache.global_tree.check()
    cache.global_tree.check()
    for rid in list(cache.local):
        cache.stop(rid)
    while cache.cached:
        cache.evict(next(iter(cache.cached)))
    assert cache.global_tree.num_nodes == 0 and not cache.global_tree.root.children


A_OUTPUT = list(range(100, 116))  # what request A wrote: no other request holds these tokens


def evicted_request_scenario() -> tuple[Draft, Draft, SuffixCache]:
    """A writes A_OUTPUT; a request whose context ends in its first tokens drafts from it;
    then two more requests start, the cache holding two: A is evicted, and the same context
    must find nothing. Returns the drafts before and after, and the cache."""
    cache = SuffixCache(depth=8, max_cached=2)
    cache.start("A", [1, 2, 3])
    cache.extend("A", A_OUTPUT)
    cache.stop("A")
    cache.start("D", [7, 7, 100, 101, 102])
    before = cache.speculate("D", [7, 7, 100, 101, 102], 4, 1.0, 0.1)
    cache.stop("D")
    for rid in ("B", "C"):
        cache.start(rid, [4, 5, 6])
        cache.extend(rid, [8, 9, 4, 5])
        cache.stop(rid)
    assert "A" not in cache.cached
    cache.start("E", [7, 7, 100, 101, 102])
    after = cache.speculate("E", [7, 7, 100, 101, 102], 4, 1.0, 0.1)
    return before, after, cache


def assert_nothing_of_an_evicted_request(before: Draft, after: Draft, cache: SuffixCache) -> None:
    assert before.tokens == [103, 104, 105]  # from A's output: a match of 3, 3 tokens
    assert not set(after.tokens) & set(A_OUTPUT), f"drafted {after.tokens} from evicted A"
    cache.global_tree.check()


def test_no_draft_comes_from_an_evicted_request() -> None:
    assert_nothing_of_an_evicted_request(*evicted_request_scenario())


def stale_removals():
    """Planted bugs: an eviction that forgets the sequence's places and leaves its nodes and
    tails in the tree; one that takes its counts out but leaves its tails (and the tokens
    they read)."""

    def forgets_only(self: SuffixTree, seq_id: int) -> None:
        self._open.pop(seq_id, None)

    def keeps_tails(self: SuffixTree, seq_id: int) -> None:
        seq = self.seqs.get(seq_id, [])
        for p in range(len(seq)):
            node = self.root
            for d in range(min(self.depth, len(seq) - p)):
                child = node.children[seq[p + d]]
                if not isinstance(child, suffix_tree._Node):
                    break  # the bug: its own tail stays
                child.count -= 1
                if child.count == 0:
                    del node.children[seq[p + d]]
                    break
                node = child
        self._open.pop(seq_id, None)

    return [forgets_only, keeps_tails]


@pytest.mark.parametrize("bug", stale_removals(), ids=lambda f: f.__name__)
def test_the_test_catches_a_stale_node_after_eviction(monkeypatch, bug) -> None:
    monkeypatch.setattr(SuffixTree, "remove", bug)
    with pytest.raises(AssertionError, match="from evicted A"):
        assert_nothing_of_an_evicted_request(*evicted_request_scenario())


# --- speculative_config -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"suffix_decoding_max_tree_depth": 0},
         r"^speculative_config.suffix_decoding_max_tree_depth must be in \[1, 256\], got 0"),
        ({"suffix_decoding_max_tree_depth": 300}, r"max_tree_depth must be .*\[1, 256\], got 300"),
        ({"suffix_decoding_max_spec_factor": -1.0}, r"max_spec_factor must be .*>= 0, got -1.0"),
        ({"suffix_decoding_min_token_prob": 1.5}, r"min_token_prob must be .*\[0, 1\], got 1.5"),
        ({"suffix_decoding_max_cached_requests": -1}, r"max_cached_requests must be .*>= 0"),
        ({"suffix_decoding_max_tree_depth": "deep"}, "max_tree_depth must be an integer"),
        ({"suffix_decoding_max_depth": 8}, "unknown key.*'suffix_decoding_max_depth'"),
        ({"method": "ngram", "suffix_decoding_min_token_prob": 0.5},
         "speculative_config.suffix_decoding_min_token_prob: only suffix reads it, not ngram"),
        ({"model": "x"}, "the suffix method takes no model"),
    ],
)  # fmt: skip
def test_bad_suffix_settings_name_the_key_and_the_limit(spec, message) -> None:
    with pytest.raises(InvalidInputError, match=message):
        EngineArgs(speculative_config={"method": "suffix", **spec})


def test_the_settings_reach_the_drafter(tiny_llama_checkpoint) -> None:
    spec = {"method": "suffix", "num_speculative_tokens": 5, "suffix_decoding_max_tree_depth": 9,
            "suffix_decoding_max_spec_factor": 1.5, "suffix_decoding_min_token_prob": 0.25,
            "suffix_decoding_max_cached_requests": 7}  # fmt: skip
    llm = LLM(str(tiny_llama_checkpoint), speculative_config=spec, num_kv_blocks=32)
    drafter = llm.engine.executor.worker.drafter
    assert (drafter.cache.depth, drafter.cache.max_cached) == (9, 7)
    assert (drafter.spec_factor, drafter.min_prob) == (1.5, 0.25)
    assert llm.engine.scheduler.draft_input == "none"
    default = EngineArgs(str(tiny_llama_checkpoint), speculative_config={"method": "suffix"})
    assert default.create_engine_config().speculative_config.auto  # auto, as every drafter


# --- end to end ---------------------------------------------------------------------------

REPEATING = [[5, 6, 7, 8, 5, 6, 7, 9, 5, 6], [1, 2, 3] * 5, [100, 200, 30, 40, 100, 200]]


def engine(path, max_num_seqs: int = 256, **spec) -> LLM:
    config = {"method": "suffix", "num_speculative_tokens": 4, **spec}
    return LLM(str(path), speculative_config=config, max_num_seqs=max_num_seqs,
               num_kv_blocks=1024, block_size=4, max_model_len=64, seed=3)  # fmt: skip


@pytest.mark.parametrize(
    "spec",
    [{}, {"topk": 2, "num_draft_tokens": 6}, {"num_speculative_tokens": "auto"},
     {"suffix_decoding_max_cached_requests": 0}],
    ids=["chain", "tree", "auto", "no-global-tree"],
)  # fmt: skip
def test_greedy_with_suffix_drafts_equals_plain_greedy(make_checkpoint, spec) -> None:
    """Two requests at a time, the prompts three times over: later requests find what earlier
    ones wrote in the global tree (a random model's output rarely repeats its prompt)."""
    path = make_checkpoint("llama", seed=2)
    prompts = REPEATING * 3
    plain = LLM(str(path), num_speculative_tokens=0, num_kv_blocks=1024, block_size=4,
                max_model_len=64)  # fmt: skip
    llm = engine(path, max_num_seqs=2, **spec)
    assert greedy_token_ids(llm, prompts, 40) == greedy_token_ids(plain, prompts, 40)
    metrics = llm.engine.metrics.spec
    assert metrics.proposed > 0 and metrics.accepted > 0
    drafter = llm.engine.executor.worker.drafter
    # finished requests are forgotten (the last ones once the next step tells the worker)
    assert set(drafter.tokens) == set(drafter.cache.local) and len(drafter.tokens) <= 2


N = 14_000


@pytest.fixture(scope="module")
def target(make_checkpoint):
    return exactness_target(make_checkpoint, 3)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_sampling_at_temperature_one_is_the_targets_law(target, shape) -> None:
    """Every request drafts from what the earlier ones sampled (the global tree), and from
    its own prompt; the first three tokens of five are the target's joint."""
    tree_spec = {"topk": 2, "num_draft_tokens": 5, "num_speculative_tokens": 3}
    llm = engine(target, **(tree_spec if shape == "tree" else {"num_speculative_tokens": 3}))
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N, params, use_tqdm=False)
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
    spec = llm.engine.metrics.spec
    assert spec.proposed > N and 0.05 < spec.acceptance_rate < 0.99
    assert_matches(
        [tuple(o.outputs[0].token_ids[:3]) for o in outs], exact_joint(target, PROMPT, 3)
    )
    assert ALPHA == 1e-3


# --- the agentic workload -----------------------------------------------------------------


def test_the_agentic_workload_is_sessions_whose_turns_extend_each_other() -> None:
    from specbatch.bench.agentic_workload import SESSIONS_AT_ONCE, agentic_prompts
    from specbatch.model.model_pair import default_model_path
    from specbatch.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path("target"))
    prompts, source = agentic_prompts(tok, 1024, 64, 40, seed=1)
    assert len(prompts) == 40 and source.startswith("agentic:")
    assert all(len(p) <= 1024 for p in prompts)
    assert prompts == agentic_prompts(tok, 1024, 64, 40, seed=1)[0]  # seeded
    first = prompts[:SESSIONS_AT_ONCE]  # each session's first turn, then each one's second
    second = prompts[SESSIONS_AT_ONCE : 2 * SESSIONS_AT_ONCE]
    for a, b in zip(first, second, strict=True):
        assert b[: len(a)] == a and len(b) > len(a) + 64  # the file as written, re-quoted
    text = tok.decode(second[0])
    assert text.count("```python") >= 3 and "[run_tests]" in text and "[read_file]" in text
    with pytest.raises(InvalidInputError, match="input_len"):
        agentic_prompts(tok, 100, 64, 4)


def test_the_bench_runs_the_agentic_workload_with_suffix_drafts() -> None:
    from specbatch.bench.bench_config import BenchConfig
    from specbatch.bench.offline import run_bench

    cfg = BenchConfig(  # the built-in target, drafting with suffix decoding
        batch_sizes=[2],
        draft_lengths=[0, 4],
        workload="agentic",
        input_len=480,  # within the built-in target's context
        output_len=16,
        output_len_spread=0.0,
        num_requests=4,
        speculative_config={"method": "suffix"},
        engine_kwargs={"device": "cpu"},
    )
    result = run_bench(cfg, progress=False)
    assert result.workload_source.startswith("agentic")
    plain, suffix = result.cells
    assert suffix.output_tokens == plain.output_tokens == 4 * 16
    assert suffix.spec_rounds > 0 and suffix.draft_tokens_accepted > 0
