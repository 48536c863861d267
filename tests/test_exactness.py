"""End-to-end exactness: speculative sampling through the whole engine is plain target sampling.

For one prompt we sample N independent continuations (each request has its own generator) and
compare the empirical joint distribution of the FIRST THREE generated tokens with the exact joint
computed from the target's conditional probabilities (tests/helpers.py, via transformers), by a
chi-square goodness-of-fit test (cells expected fewer than 5 times pooled into one bin).

False alarms: each test rejects at p < ALPHA = 1e-3; seeds are fixed, so a run is reproducible.
Power: the target's vocabulary has 3 tokens, so the joint has at most 27 cells, and N = 14,000.
Any error of total variation TV = 0.03 in the joint is then caught with probability >= 0.90
(``specbatch.stats.power``, the noncentral chi-square bound for the hardest alternative at that
distance: 0.93 at the 26 degrees of freedom of a full joint, more with fewer; validated by
simulation in tests/test_stats.py). Each test computes the bound from its own degrees of
freedom, less what its pooled bin could hide, and fails if it is below 0.90.
``test_the_test_catches_a_broken_residual`` shows it catching a real bug (the residual replaced
by p, which moves the joint by a total variation of about 0.2).

Requests generate ``gamma + 2`` tokens so that the first round after the prompt drafts its full
gamma (drafting stops at max_tokens), while only the first three tokens are tested.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specbatch import LLM, SamplingParams
from specbatch.draft_shape import DraftShape
from specbatch.scheduler.row_costs import RowCosts
from specbatch.scheduler.speculation import FixedDraft
from specbatch.stats import chi_square_gof, power
from specbatch.worker import rejection_sampler
from specbatch.worker.penalties import Penalties
from specbatch.worker.sampler import sample
from tests.helpers import exact_joint, exactness_target, make_perturbed_draft

ALPHA = 1e-3
N = 14_000
TV, POWER = 0.03, 0.90  # the error every test must catch, and with what probability
PROMPT = [1, 2, 0]
VOCAB = 3


@pytest.fixture(scope="module")
def pair(make_checkpoint, tmp_path_factory):
    target = exactness_target(make_checkpoint, VOCAB)
    draft = make_perturbed_draft(target, tmp_path_factory.mktemp("draft"), noise=0.25, seed=1)
    return target, draft


def sample_sequences(llm: LLM, params: list[SamplingParams]) -> list[tuple[int, ...]]:
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(params), params, use_tqdm=False)
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
    return [tuple(o.outputs[0].token_ids[:3]) for o in outs]


def assert_matches(
    samples: list[tuple[int, ...]],
    exact: dict[tuple[int, ...], float],
    tv: float | None = TV,
) -> None:
    """The chi-square test at ALPHA; first, unless ``tv`` is None, the check that it catches a
    total-variation error of ``tv`` with probability POWER."""
    keys = sorted(set(exact) | set(samples))
    counts = Counter(samples)
    observed = [counts.get(k, 0) for k in keys]
    expected = [exact.get(k, 0.0) for k in keys]
    res = chi_square_gof(observed, expected)
    guaranteed = 1.0 if tv is None else power(len(samples), res.dof, tv - res.pooled_mass, ALPHA)
    assert guaranteed >= POWER, (
        f"the test is too weak: {res.dof} dof, pooled mass {res.pooled_mass:.4f}, "
        f"catches a TV error of {tv} with probability {guaranteed:.3f} only"
    )
    assert res.p_value >= ALPHA, (
        f"chi-square {res.statistic:.1f} on {res.dof} dof, p={res.p_value:.2e}"
    )


def engine(pair, gamma: int, seed: int = 0, **kw) -> LLM:
    target, draft = pair
    args = dict(max_num_seqs=256, num_kv_blocks=512, block_size=4, seed=seed, max_model_len=64)
    args.update(kw)
    if gamma:
        return LLM(str(target), draft_model=str(draft), num_speculative_tokens=gamma, **args)
    return LLM(str(target), **args)


# gamma 6 at temperature 0.7 only: the temperature is applied row by row (sampler.py, the same
# for a chain of any length), and temperature 1 (no scaling) runs at gammas 1 and 3
@pytest.mark.parametrize(
    ("gamma", "temperature", "top_p"),
    [(1, 1.0, 1.0), (3, 1.0, 1.0), (3, 0.7, 1.0), (6, 0.7, 1.0), (3, 1.0, 0.9)],
)
def test_joint_of_first_three_tokens_is_the_targets(pair, gamma, temperature, top_p):
    llm = engine(pair, gamma, seed=gamma)
    params = [
        SamplingParams(temperature=temperature, top_p=top_p, max_tokens=gamma + 2, ignore_eos=True)
    ] * N
    samples = sample_sequences(llm, params)
    spec = llm.engine.metrics.spec
    assert spec.proposed > 0 and 0.05 < spec.acceptance_rate < 0.98  # every path is exercised
    assert len(spec.reached_by_position) == gamma
    assert_matches(samples, exact_joint(pair[0], PROMPT, 3, temperature, top_p))


class PerRequestGamma(FixedDraft):
    """A policy giving each request its own draft length (by request id), as an adaptive
    policy would: the batch mixes gammas 0, 2 and 5 in the same steps."""

    def __init__(self) -> None:
        super().__init__(5)

    def draft_shapes(self, requests, prompt_rows=0, plain=0):
        return [DraftShape.chain((0, 2, 5)[int(r.request_id) % 3]) for r in requests]


def test_mixed_batch_of_temperatures_and_draft_lengths(pair):
    llm = engine(pair, 5, seed=11)
    llm.engine.scheduler.policy = PerRequestGamma()
    temps = (1.0, 0.7)
    params = [
        SamplingParams(temperature=temps[i % 2], max_tokens=7, ignore_eos=True)
        for i in range(2 * N)
    ]
    samples = sample_sequences(llm, params)
    for t_index, temperature in enumerate(temps):
        group = [s for i, s in enumerate(samples) if i % 2 == t_index]
        assert_matches(group, exact_joint(pair[0], PROMPT, 3, temperature))


@pytest.mark.parametrize("temps", [(1.0,), (1.0, 0.7)])
def test_joint_of_first_three_tokens_is_the_targets_with_auto(pair, temps):
    """``auto`` picks each step's draft lengths from earlier rounds: sweeps and (with two
    sampling classes) plans where one class drafts and the other not."""
    llm = engine(pair, "auto", seed=21, max_draft_length=4)
    policy = llm.engine.scheduler.policy
    # forget the start-up timing: at 256 requests it stops drafts at once; learning prices
    # from scratch, the controller tries several lengths before it settles
    for curve in ("target", "catch_up", "depth", "rest_plain", "rest_drafting"):
        setattr(policy, curve, RowCosts())
    params = [
        SamplingParams(temperature=temps[i % len(temps)], max_tokens=8, ignore_eos=True)
        for i in range(len(temps) * N)
    ]
    samples = sample_sequences(llm, params)
    counts = llm.engine.metrics.draft_length_counts
    assert llm.engine.metrics.spec.proposed > 0
    assert len(counts) >= 3  # several gammas were granted, 0 included
    for t_index, temperature in enumerate(temps):
        group = [s for i, s in enumerate(samples) if i % len(temps) == t_index]
        assert_matches(group, exact_joint(pair[0], PROMPT, 3, temperature))


def test_preemption_mid_request_keeps_the_distribution(pair):
    # 96 blocks of 4 slots for 64 requests of up to 19 slots: preempted again and again
    llm = engine(pair, 3, seed=5, num_kv_blocks=96, max_model_len=32, max_num_seqs=64)
    params = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)] * N
    samples = sample_sequences(llm, params)
    assert llm.engine.metrics.num_preemptions > 500
    assert_matches(samples, exact_joint(pair[0], PROMPT, 3))


def test_the_test_catches_a_broken_residual(pair, monkeypatch):
    """Drawing the correction token from p instead of max(0, p - q) must be detected."""
    monkeypatch.setattr(
        "specbatch.worker.worker.rejection_sample",
        _correction_from_p(rejection_sampler.rejection_sample),
    )
    llm = engine(pair, 3, seed=3)
    params = [SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)] * N
    samples = sample_sequences(llm, params)
    with pytest.raises(AssertionError, match="p="):  # the p-value, not the power check
        assert_matches(samples, exact_joint(pair[0], PROMPT, 3))


# strong enough to move the joint far from the unpenalised one, mild enough that every
# possible cell is expected more than 5 times in N samples (nothing pooled)
PENALTIES = dict(presence=0.6, frequency=-0.3, repetition=1.3, min_tokens=2, banned=(2,))


def penalised_params(gamma: int, temperature: float) -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=temperature,
            max_tokens=gamma + 2,
            ignore_eos=True,
            presence_penalty=PENALTIES["presence"],
            frequency_penalty=PENALTIES["frequency"],
            repetition_penalty=PENALTIES["repetition"],
            min_tokens=PENALTIES["min_tokens"],
            stop_token_ids=[2],
        )
    ] * N


# each gamma and each temperature, not every pair: the temperature scales the penalised logits
# row by row, whatever the number of drafts before the row
@pytest.mark.parametrize(("gamma", "temperature"), [(1, 1.0), (4, 0.7)])
def test_penalties_and_min_tokens_keep_the_penalised_distribution(pair, gamma, temperature):
    """Penalties and min_tokens under speculation: every verified position is penalised with
    the drafts before it, so the joint is that of plain penalised sampling (written out
    independently in tests/helpers.py); token 2 is a stop token banned for two tokens."""
    llm = engine(pair, gamma, seed=40 + gamma)
    samples = sample_sequences(llm, penalised_params(gamma, temperature))
    assert all(2 not in s[:2] for s in samples)
    spec = llm.engine.metrics.spec
    assert spec.proposed > 0 and 0.05 < spec.acceptance_rate < 0.98
    exact = exact_joint(pair[0], PROMPT, 3, temperature, penalties=PENALTIES)
    assert_matches(samples, exact)


def test_the_test_catches_penalties_blind_to_the_drafts(pair, monkeypatch):
    """Penalising every verified position with the history alone (not the drafts before it)
    must be detected."""
    real = Penalties.apply

    def blind(self, logits, rows, drafts=None, num_before=None):
        return real(self, logits, rows)

    monkeypatch.setattr(Penalties, "apply", blind)
    llm = engine(pair, 4, seed=44)
    samples = sample_sequences(llm, penalised_params(4, 1.0))
    with pytest.raises(AssertionError, match="p="):
        assert_matches(samples, exact_joint(pair[0], PROMPT, 3, penalties=PENALTIES))


LONG_PROMPT = [1, 2, 0, 0, 1, 2, 2, 1, 0, 1]  # two full blocks of 4 for the forks to share


def test_n_completions_sharing_the_prompt_blocks_keep_the_distribution(pair):
    """n = 4 completions of a prompt fork its filled blocks: each completion is a sample of
    the target, independent of its siblings (pairs of them are tested as one joint)."""
    llm = engine(pair, 3, seed=9)
    n = 4
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, n=n)
    outs = llm.generate([{"prompt_token_ids": LONG_PROMPT}] * (N // n), params, use_tqdm=False)
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
    assert all(len(o.outputs) == n for o in outs)
    samples = [tuple(c.token_ids[:3]) for o in outs for c in o.outputs]
    assert_matches(samples, exact_joint(pair[0], LONG_PROMPT, 3))
    firsts = [(o.outputs[0].token_ids[0], o.outputs[1].token_ids[0]) for o in outs]
    marginal = exact_joint(pair[0], LONG_PROMPT, 1)
    pairs = {(a, b): marginal[(a,)] * marginal[(b,)] for (a,) in marginal for (b,) in marginal}
    assert_matches(firsts, pairs, tv=None)


def _correction_from_p(real):
    """The real sampler, except that after a rejection the emitted token is drawn from p."""

    def wrong(draft_token_ids, num_draft, draft_probs, target_probs, accept_u, final_u):
        out = real(draft_token_ids, num_draft, draft_probs, target_probs, accept_u, final_u)
        rows = torch.arange(len(num_draft))
        n = out.num_accepted
        rejected = n < num_draft
        redrawn = sample(target_probs[rows, n], final_u)
        out.token_ids[rows[rejected], n[rejected]] = redrawn[rejected]
        return out

    return wrong
