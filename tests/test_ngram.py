"""The n-gram drafter and ``speculative_config``: the lookup on its own, the point-mass rule,
greedy output equal to transformers', and the sampled joint equal to the target's."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specbatch import LLM, InvalidInputError, SamplingParams
from specbatch.config import EngineArgs
from specbatch.stats import chi_square_gof
from specbatch.worker.ngram_proposer import NgramIndex
from specbatch.worker.rejection_sampler import rejection_sample
from tests.helpers import exact_joint, hf_greedy

# --- the lookup -----------------------------------------------------------------------------


def index(tokens: list[int], n_min: int = 1, n_max: int = 3) -> NgramIndex:
    ix = NgramIndex(n_min, n_max)
    ix.extend(tokens)
    return ix


def test_longest_suffix_wins() -> None:
    # suffix [1, 2]: as a 2-gram it was followed by 7; the 1-gram [2] more recently by 9
    assert index([1, 2, 7, 5, 2, 9, 1, 2]).propose(3) == [7, 5, 2]
    assert index([1, 2, 7, 5, 2, 9, 1, 2], n_max=1).propose(2) == [9, 1]


def test_most_recent_occurrence_wins() -> None:
    assert index([4, 5, 1, 4, 5, 2, 4, 5]).propose(1) == [2]


def test_no_match_and_too_short() -> None:
    assert index([1, 2, 3, 4]).propose(3) == []
    assert index([7]).propose(3) == []
    assert index([1, 2, 3, 1, 2], n_min=3).propose(3) == []  # only a 2-gram matches


def test_match_near_the_end_proposes_fewer() -> None:
    assert index([3, 4, 3]).propose(5) == [4, 3]


def test_match_across_the_prompt_output_boundary() -> None:
    ix = NgramIndex(2, 2)
    ix.sync(0, [5, 6, 7])  # the prompt
    ix.sync(3, [8])  # an emitted token
    ix.sync(4, [5, 6])  # two more: the suffix [5, 6] last appeared at the prompt's start
    assert ix.propose(3) == [7, 8, 5]
    ix.sync(0, [5, 6, 7, 8, 5, 6])  # resent after a preemption: nothing changes
    assert ix.tokens == [5, 6, 7, 8, 5, 6] and ix.propose(2) == [7, 8]


# --- the rule with point masses ---------------------------------------------------------------


def test_point_mass_rule_gives_p_exactly() -> None:
    """One draft x with q = point mass: accept with probability p(x), else sample p without x.
    Over a fine lattice of the two uniforms the emitted token's frequencies are p's."""
    p = torch.tensor([0.1, 0.5, 0.15, 0.25])
    grid = (torch.arange(400, dtype=torch.float32) + 0.5) / 400
    ua, uf = (t.reshape(-1) for t in torch.meshgrid(grid, grid, indexing="ij"))
    n = ua.numel()
    for x in range(4):
        out = rejection_sample(
            torch.full((n, 1), x),
            torch.ones(n, dtype=torch.int64),
            None,
            p.expand(n, 2, 4).contiguous(),
            ua.unsqueeze(1),
            uf,
        )
        first = out.token_ids[:, 0]
        freq = torch.bincount(first, minlength=4).float() / n
        torch.testing.assert_close(freq, p, atol=3e-3, rtol=0)  # lattice: <= 1/400 each
        assert ((out.num_accepted == 1) == (first == x)).all()  # x only by acceptance


# --- speculative_config -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "eagle9"}, "speculative_config.method must be one of"),
        ({"method": "ngram", "lookahead": 3}, "unknown key.*'lookahead'"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "at most"),
        ({"method": "ngram", "prompt_lookup_max": 0}, "prompt_lookup_max must be an integer >= 1"),
        ({"method": "ngram", "num_speculative_tokens": -1}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": "lots"}, "num_speculative_tokens must"),
        ({"method": "ngram", "model": "x"}, "the ngram method takes no model"),
        ({"method": "draft_model"}, "the draft_model method needs a model"),
        ({"method": "eagle"}, "the eagle method needs a model"),
        ("{not json", "not valid JSON"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_speculative_config(tiny_llama_checkpoint, config, message) -> None:
    with pytest.raises(InvalidInputError, match=message):
        EngineArgs(str(tiny_llama_checkpoint), speculative_config=config).create_engine_config()


def test_speculative_config_and_shorthands(tiny_llama_checkpoint, make_checkpoint) -> None:
    target = str(tiny_llama_checkpoint)
    cfg = EngineArgs(target, speculative_config={"method": "ngram"}).create_engine_config()
    spec = cfg.speculative_config
    assert (spec.method, spec.depth, cfg.draft) == ("ngram", 4, None)
    assert spec.auto  # no length given: the controller chooses, up to 4
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (2, 4) and spec.speculative
    draft = str(make_checkpoint("llama", num_layers=1, seed=9))
    as_json = f'{{"model": "{draft}", "num_speculative_tokens": "auto", "max_draft_length": 6}}'
    cfg = EngineArgs(target, speculative_config=as_json).create_engine_config()
    spec = cfg.speculative_config
    assert spec.method == "draft_model" and cfg.draft is not None
    assert spec.auto and spec.depth == 6
    short = EngineArgs(target, draft_model=draft, num_speculative_tokens=2).create_engine_config()
    assert short.draft is not None and short.speculative_config.num_speculative_tokens == 2
    with pytest.raises(InvalidInputError, match="speculative_config and draft_model were both"):
        EngineArgs(target, draft_model=draft, speculative_config={"method": "ngram"})\
            .create_engine_config()  # fmt: skip


# --- end to end ---------------------------------------------------------------------------

REPEATS = [3, 4, 5, 6, 7] * 4  # a prompt whose suffix keeps matching itself
VOCAB = 16


@pytest.fixture(scope="module")
def target(make_checkpoint):
    return make_checkpoint(
        "llama", vocab_size=VOCAB, hidden_size=32, num_heads=2, num_kv_heads=1,
        intermediate_size=64, seed=5, max_position_embeddings=128,
    )  # fmt: skip


def ngram_llm(path, k: int = 3, **kw) -> LLM:
    args = dict(max_num_seqs=256, num_kv_blocks=1024, block_size=4, max_model_len=128)
    args.update(kw)
    config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1}
    return LLM(str(path), speculative_config=config, **args)


def test_greedy_equals_transformers(make_checkpoint) -> None:
    path = make_checkpoint("llama", seed=2)
    prompts = [REPEATS, [9, 10, 11, 9, 10], [20, 21, 22, 23]]
    expected = hf_greedy(path, prompts, 30)
    llm = ngram_llm(path, k=4)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == expected
    spec = llm.engine.metrics.spec
    assert spec.proposed > 0 and spec.accepted > 0
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks


N = 8000
ALPHA = 1e-3  # false-alarm rate of each test


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_joint_of_first_three_tokens_is_the_targets(target, temperature, top_p) -> None:
    llm = ngram_llm(target, seed=int(temperature * 10))
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": REPEATS}] * N, params, use_tqdm=False)
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
    spec = llm.engine.metrics.spec
    assert spec.proposed > N and 0.05 < spec.acceptance_rate < 0.98  # drafts really tested
    samples = Counter(tuple(o.outputs[0].token_ids[:3]) for o in outs)
    exact = exact_joint(target, REPEATS, 3, temperature, top_p)
    keys = sorted(set(exact) | set(samples))
    res = chi_square_gof([samples.get(k, 0) for k in keys], [exact.get(k, 0.0) for k in keys])
    assert res.p_value >= ALPHA, f"chi-square {res.statistic:.1f} on {res.dof} dof"


def test_the_test_catches_a_residual_that_keeps_the_draft(target, monkeypatch) -> None:
    """Taking the residual as p itself (the rejected draft not removed) must be detected."""
    import specbatch.worker.worker as worker_module

    def broken(draft_tokens, counts, q, p, accept_u, final_u):
        out = rejection_sample(draft_tokens, counts, q, p, accept_u, final_u)
        return out if q is not None else _residual_is_p(draft_tokens, counts, p, accept_u, final_u)

    monkeypatch.setattr(worker_module, "rejection_sample", broken)
    llm = ngram_llm(target, seed=1)
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": REPEATS}] * N, params, use_tqdm=False)
    samples = Counter(tuple(o.outputs[0].token_ids[:3]) for o in outs)
    exact = exact_joint(target, REPEATS, 3)
    keys = sorted(set(exact) | set(samples))
    res = chi_square_gof([samples.get(k, 0) for k in keys], [exact.get(k, 0.0) for k in keys])
    assert res.p_value < ALPHA


def _residual_is_p(draft_tokens, counts, p, accept_u, final_u):
    """The point-mass rule with the bug: after a rejection, sample p (x may come back)."""
    from specbatch.worker.sampler import sample

    b, g = draft_tokens.shape
    p_draft = p[:, :g].gather(2, draft_tokens.unsqueeze(2)).squeeze(2)
    valid = torch.arange(g).unsqueeze(0) < counts.unsqueeze(1)
    acc = torch.cumprod((valid & (accept_u < p_draft)).long(), 1).sum(1)
    final = sample(p[torch.arange(b), acc], final_u)
    tokens = torch.where(torch.arange(g + 1).unsqueeze(0) < acc.unsqueeze(1),
                         torch.cat([draft_tokens, acc.unsqueeze(1) * 0], 1), 0)  # fmt: skip
    tokens.scatter_(1, acc.unsqueeze(1), final.unsqueeze(1))
    from specbatch.worker.rejection_sampler import RejectionResult

    return RejectionResult(tokens, acc, acc + 1)


def test_cli_takes_speculative_config(target, tmp_path) -> None:
    import json
    import subprocess
    import sys

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": REPEATS}) + "\n" for _ in range(3)))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "specbatch.entrypoints.cli", "generate", "--model", str(target),
           "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
           "--prompts", str(prompts), "--output", str(out), "--max-tokens", "8",
           "--temperature", "0", "--no-progress", "--ignore-eos"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and all(len(r["token_ids"]) == 8 for r in rows)
    bad = subprocess.run(
        [*cmd[:7], '{"method": "ngrams"}', *cmd[8:]], capture_output=True, text=True, timeout=300
    )
    assert bad.returncode == 2 and "speculative_config.method" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_auto_with_ngram_equals_transformers_greedy(make_checkpoint) -> None:
    path = make_checkpoint("llama", seed=2)
    prompts = [REPEATS, [9, 10, 11, 9, 10], [20, 21, 22, 23]]
    llm = LLM(str(path), speculative_config={"method": "ngram", "num_speculative_tokens": "auto",
              "prompt_lookup_min": 1}, max_num_seqs=1, num_kv_blocks=256, block_size=4,
              max_model_len=128)  # fmt: skip
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 30)
    assert llm.engine.metrics.spec.proposed > 0
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
