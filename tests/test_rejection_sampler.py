"""Exactness of the rejection sampler: whatever q is, emitted tokens are distributed as p.

Statistical design (all checks share it):
- False alarms: each test has a budget ALPHA = 1e-3, split evenly (Bonferroni) over its k
  statistical checks: a chi-square goodness-of-fit test passes when its p-value > ALPHA / k, a
  binomial check when its two-sided exact p-value (scipy) > ALPHA / k. So a correct sampler
  fails a given test with probability <= 1e-3 under a fresh seed. Seeds are fixed, so the suite
  is deterministic; SPECBATCH_TEST_SEED=<anything> re-runs the positive tests under other seeds.
- Sample size: N = 100,000 independent trials, all in the batch dimension of ONE call. Power: a
  sampler whose output is delta = 0.02 away from p in total variation has a chi-square distance
  sum_x (p'(x) - p(x))^2 / p(x) >= (2 delta)^2 = 0.0016 (Cauchy-Schwarz), i.e. noncentrality
  >= N * 0.0016 = 160. At ALPHA / 2 with at most 64 bins (dof <= 63, critical value 106.6) the
  test then rejects with probability >= 1 - 1e-6 (noncentral chi-square); <= 32 bins: 1 - 1e-9.
  Pooling bins of expected count < 5 moves at most 64 * 5 / N = 0.3% of mass, which does not
  change this. Checks on a later position (N_MULTI = 200,000 rounds) use the rounds that reach
  it; those still have >= 40,000 samples: noncentrality >= 64, power >= 0.99 at ALPHA / 7 for
  dof <= 15. `test_two_percent_error_is_detected` checks the power claim empirically.
- Draft tokens are sampled from q with torch.multinomial (independent of `sample`), uniforms from
  a seeded torch.Generator, as the draft and the engine would.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable

import pytest
import torch
from scipy.stats import binomtest

from specbatch.stats import chi_square_gof, total_variation
from specbatch.worker import rejection_sampler as rs_module
from specbatch.worker.rejection_sampler import greedy_walk, rejection_sample
from specbatch.worker.sampler import SamplingTensors, logits_to_probs, sample

ALPHA = 1e-3  # false-alarm budget per test
N = 100_000


def seeded(name: str, salted: bool = True) -> torch.Generator:
    """A generator per test; SPECBATCH_TEST_SEED re-runs the suite under other seeds."""
    salt = os.environ.get("SPECBATCH_TEST_SEED", "") if salted else ""
    return torch.Generator().manual_seed(zlib.crc32(f"{name}{salt}".encode()))


def draw(dist: torch.Tensor, gen: torch.Generator, n: int | None = None) -> torch.Tensor:
    """One token per row of `dist` ([n, V], or [V] broadcast to n rows)."""
    if dist.dim() == 1:
        dist = dist.expand(n, dist.shape[0])
    return torch.multinomial(dist, 1, replacement=True, generator=gen).squeeze(1)


def dirichlet(vocab: int, gen: torch.Generator, conc: float = 1.0) -> torch.Tensor:
    """Uniform on the simplex (Dirichlet(1, ..., 1)) for conc = 1; conc < 1 skews the weights
    towards a few tokens (a sparse-ish draw, not an exact Dirichlet(conc))."""
    e = -torch.log(torch.rand(vocab, generator=gen, dtype=torch.float64))
    w = e ** (1.0 / conc)
    return (w / w.sum()).float()


def transformed(vocab: int, gen: torch.Generator, **params: float) -> torch.Tensor:
    """A distribution as a request would see it: random logits through logits_to_probs."""
    logits = torch.randn(1, vocab, generator=gen) * 2.0
    st = SamplingTensors.from_lists(
        [params.get("temperature", 1.0)],
        [int(params.get("top_k", 0))],
        [params.get("top_p", 1.0)],
        [params.get("min_p", 0.0)],
        device="cpu",
    )
    return logits_to_probs(logits, st)[0]


def make_pair(kind: str, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "dirichlet":
        return dirichlet(vocab, gen), dirichlet(vocab, gen)
    if kind == "sparse_dirichlet":
        return dirichlet(vocab, gen, 0.3), dirichlet(vocab, gen, 0.3)
    if kind == "peaked":
        p = torch.softmax(torch.randn(vocab, generator=gen) * 4, -1)
        return p, torch.softmax(torch.randn(vocab, generator=gen) * 4, -1)
    if kind == "disjoint":
        p, q = torch.zeros(vocab), torch.zeros(vocab)
        p[: vocab // 2] = dirichlet(vocab // 2, gen)
        q[vocab // 2 :] = dirichlet(vocab - vocab // 2, gen)
        return p, q
    if kind == "overlapping_supports":
        p, q = torch.zeros(vocab), torch.zeros(vocab)
        p[: 2 * vocab // 3] = dirichlet(2 * vocab // 3, gen)
        q[vocab // 3 :] = dirichlet(vocab - vocab // 3, gen)
        return p, q
    if kind == "equal":
        p = dirichlet(vocab, gen)
        return p, p.clone()
    if kind == "nearly_equal":
        p = dirichlet(vocab, gen)
        q = p * (1 + 0.01 * torch.randn(vocab, generator=gen))
        return p, q / q.sum()
    if kind == "q_uniform":
        return torch.softmax(torch.randn(vocab, generator=gen) * 3, -1), torch.full(
            (vocab,), 1 / vocab
        )
    if kind == "p_uniform":
        return torch.full((vocab,), 1 / vocab), torch.softmax(
            torch.randn(vocab, generator=gen) * 3, -1
        )
    if kind == "q_tiny_masses":
        p = dirichlet(vocab, gen)
        q = torch.full((vocab,), 1e-6)
        q[0] = 1.0
        return p, q / q.sum()
    if kind == "top_k":
        return transformed(vocab, gen, top_k=5), transformed(vocab, gen, top_k=5)
    if kind == "top_p":
        return transformed(vocab, gen, top_p=0.8), transformed(vocab, gen, top_p=0.8)
    if kind == "temperature_min_p":
        p = transformed(vocab, gen, temperature=0.7, min_p=0.05)
        return p, transformed(vocab, gen, temperature=0.7, min_p=0.05)
    if kind == "top_k_top_p_mixed":
        p = transformed(vocab, gen, temperature=1.3, top_k=10, top_p=0.9)
        return p, transformed(vocab, gen, temperature=1.3, top_k=10, top_p=0.9)
    raise ValueError(kind)


CASES = [
    ("dirichlet", 8),
    ("dirichlet", 16),
    ("dirichlet", 32),
    ("sparse_dirichlet", 16),
    ("peaked", 16),
    ("disjoint", 16),
    ("overlapping_supports", 12),
    ("equal", 16),
    ("nearly_equal", 16),
    ("q_uniform", 16),
    ("p_uniform", 16),
    ("q_tiny_masses", 8),
    ("top_k", 16),
    ("top_p", 32),
    ("temperature_min_p", 16),
    ("top_k_top_p_mixed", 24),
]


def first_token_trial(
    p: torch.Tensor, q_sampled: torch.Tensor, gen: torch.Generator, q_passed: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """N one-draft rounds: the draft samples from `q_sampled`, the sampler is told `q_passed`."""
    vocab = p.shape[0]
    q_passed = q_sampled if q_passed is None else q_passed
    drafts = draw(q_sampled, gen, N).unsqueeze(1)
    bonus = torch.full((vocab,), 1 / vocab)
    result = rejection_sample(
        drafts,
        torch.ones(N, dtype=torch.int64),
        q_passed.expand(N, 1, vocab),
        torch.stack([p, bonus]).expand(N, 2, vocab),
        torch.rand(N, 1, generator=gen),
        torch.rand(N, generator=gen),
    )
    assert torch.equal(result.num_emitted, result.num_accepted + 1)
    return result.token_ids[:, 0], result.num_accepted


def first_token_p_value(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=p.shape[0])
    return chi_square_gof(counts.numpy(), p.double().numpy()).p_value


def assert_binomial(successes: int, trials: int, prob: float, alpha: float) -> None:
    """Two-sided exact binomial test at false-alarm rate alpha."""
    prob = min(max(prob, 0.0), 1.0)  # 1 - TV can leave [0, 1] by rounding
    p_value = binomtest(successes, trials, prob).pvalue
    assert p_value > alpha, (successes, trials, prob, p_value)


@pytest.mark.parametrize(("kind", "vocab"), CASES, ids=[f"{k}-{v}" for k, v in CASES])
def test_first_token_is_distributed_as_p(kind: str, vocab: int) -> None:
    gen = seeded(f"{kind}-{vocab}")
    p, q = make_pair(kind, vocab, gen)
    tokens, accepted = first_token_trial(p, q, gen, None)
    assert (p[tokens] > 0).all(), "emitted a token of target probability 0"
    # Two checks: the law of the token, and acceptance at position 0 w.p. 1 - TV(p, q).
    assert first_token_p_value(tokens, p) > ALPHA / 2
    alpha = 1.0 - total_variation(p.double(), q.double())
    assert_binomial(int(accepted.sum()), N, alpha, ALPHA / 2)


def test_two_percent_error_is_detected() -> None:
    """Power check of the design with the hardest 2% error: tokens from p' with TV(p, p') = 0.02
    and the smallest chi-square distance that allows (p scaled up on a half A of the mass, down on
    the other half B: distance = delta^2 (1/p(A) + 1/p(B)) ~ 4 delta^2) fail the same test."""
    gen = seeded("power")
    delta = 0.02
    for vocab in (8, 16, 32):
        p = dirichlet(vocab, gen).double()
        in_a = torch.zeros(vocab, dtype=torch.bool)
        mass_a = 0.0
        for t in torch.argsort(p, descending=True).tolist():  # greedy split into ~equal halves
            if mass_a + float(p[t]) <= 0.5 or mass_a == 0.0:
                in_a[t], mass_a = True, mass_a + float(p[t])
        mass_b = 1.0 - mass_a
        shifted = torch.where(in_a, p * (1 + delta / mass_a), p * (1 - delta / mass_b))
        assert total_variation(p, shifted) == pytest.approx(delta)
        chi2_distance = float(((shifted - p) ** 2 / p).sum())
        assert chi2_distance <= 1.25 * 4 * delta**2  # close to the worst case the design assumes
        tokens = draw(shifted.float(), gen, N)
        assert first_token_p_value(tokens, p.float()) < ALPHA / 2


# ---- multi-position rounds ---------------------------------------------------------------------

G = 3
N_MULTI = 200_000  # later positions are reached by a fraction of the rows: keep each >= 40k


def multi_position_round(
    ps: torch.Tensor,
    qs: torch.Tensor,
    gen: torch.Generator,
    num_draft: torch.Tensor,
    share_uniforms: bool = False,
    bonus_off_by_one: bool = False,
):
    """len(num_draft) rounds of up to G drafts where p_i, q_i do not depend on earlier tokens.

    ps: [G+1, V], qs: [G, V]. The two flags simulate engine bugs for the negative tests.
    """
    n, vocab = num_draft.shape[0], ps.shape[1]
    drafts = torch.stack([draw(qs[i], gen, n) for i in range(G)], dim=1)
    target = ps.expand(n, G + 1, vocab).clone()
    if bonus_off_by_one:  # bonus taken from position num_draft - 1
        rows = torch.arange(n)
        shifted = (num_draft - 1).clamp(min=0)
        target[rows, num_draft] = ps[shifted]
    accept_u = torch.rand(n, G, generator=gen)
    if share_uniforms:
        accept_u = accept_u[:, :1].expand(n, G)
    return rejection_sample(
        drafts, num_draft, qs.expand(n, G, vocab), target, accept_u, torch.rand(n, generator=gen)
    )


def position_p_values(result, ps: torch.Tensor) -> list[float]:
    """For each position j: chi-square p-value of the token emitted at j, among rows reaching j."""
    out = []
    for j in range(G + 1):
        reached = result.num_emitted > j
        assert int(reached.sum()) >= 40_000  # the sample size the power claim assumes
        out.append(first_token_p_value(result.token_ids[reached, j], ps[j]))
    return out


def multi_position_setup(name: str, vocab: int = 12, salted: bool = True):
    gen = seeded(name, salted)
    # Draft fairly close to the target so that later positions are reached often.
    ps = torch.stack([dirichlet(vocab, gen) for _ in range(G + 1)])
    noise = torch.stack([dirichlet(vocab, gen) for _ in range(G)])
    qs = 0.6 * ps[:G] + 0.4 * noise
    return gen, ps, qs


def test_every_position_is_distributed_as_p_with_mixed_num_draft() -> None:
    gen, ps, qs = multi_position_setup("multi")
    num_draft = torch.randint(0, G + 1, (N_MULTI,), generator=gen)
    num_draft[: N_MULTI // 2] = G  # half the rows run the full G, the rest 0..G
    result = multi_position_round(ps, qs, gen, num_draft)
    assert (result.num_accepted <= num_draft).all()
    checks = (G + 1) + G  # G + 1 positions, G acceptance depths
    assert all(pv > ALPHA / checks for pv in position_p_values(result, ps))
    # Among full-length rows, P(num_accepted >= j) = prod_{i<j} (1 - TV(p_i, q_i)).
    full = num_draft == G  # ~125k rounds
    alphas = [1.0 - total_variation(ps[i].double(), qs[i].double()) for i in range(G)]
    reach = 1.0
    for j in range(1, G + 1):
        reach *= alphas[j - 1]
        reached = int((result.num_accepted[full] >= j).sum())
        assert_binomial(reached, int(full.sum()), reach, ALPHA / checks)


# ---- deterministic behaviour -------------------------------------------------------------------


def one_hot_case(gen: torch.Generator, batch: int, vocab: int):
    """Greedy rounds: the target's tokens, drafts matching them 70% of the time, each request's
    number of drafts, and the one-hot p and q of both."""
    target_tok = torch.randint(0, vocab, (batch, G + 1), generator=gen)
    same = torch.rand(batch, G, generator=gen) < 0.7
    other = (target_tok[:, :G] + torch.randint(1, vocab, (batch, G), generator=gen)) % vocab
    drafts = torch.where(same, target_tok[:, :G], other)
    num_draft = torch.randint(0, G + 1, (batch,), generator=gen)
    p = torch.nn.functional.one_hot(target_tok, vocab).float()
    q = torch.nn.functional.one_hot(drafts, vocab).float()
    return target_tok, drafts, num_draft, p, q


def test_greedy_accepts_matching_prefix_and_emits_target_argmax() -> None:
    gen = seeded("greedy")
    batch, vocab = 512, 10
    target_tok, drafts, num_draft, p, q = one_hot_case(gen, batch, vocab)
    last_below_one = float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))
    for u in (0.0, 0.5, last_below_one, None):
        accept_u = torch.rand(batch, G, generator=gen) if u is None else torch.full((batch, G), u)
        final_u = torch.rand(batch, generator=gen) if u is None else torch.full((batch,), u)
        result = rejection_sample(drafts, num_draft, q, p, accept_u, final_u)
        for b in range(batch):
            m = 0
            while m < int(num_draft[b]) and drafts[b, m] == target_tok[b, m]:
                m += 1
            assert int(result.num_accepted[b]) == m
            emitted = result.token_ids[b, : m + 1]
            assert torch.equal(emitted, target_tok[b, : m + 1])
            assert (result.token_ids[b, m + 1 :] == 0).all()


def test_greedy_walk_is_the_rule_at_its_one_hot_limit() -> None:
    """The host-side walk over flat verified rows (each request's root then its drafts, ragged)
    emits what rejection sampling emits with one-hot p and q, whatever the uniforms."""
    gen = seeded("greedy walk")
    batch = 256
    target_tok, drafts, num_draft, p, q = one_hot_case(gen, batch, 6)
    u = torch.rand(batch, G + 1, generator=gen)
    result = rejection_sample(drafts, num_draft, q, p, u[:, :G], u[:, G])
    counts = num_draft.tolist()
    rows = [target_tok[b, : n + 1].tolist() for b, n in enumerate(counts)]
    first = [sum(n + 1 for n in counts[:b]) for b in range(batch)]
    flat = [t for row in rows for t in row]
    emitted, accepted = greedy_walk(drafts.tolist(), counts, flat, first)
    assert accepted == result.num_accepted.tolist()
    assert emitted == [result.token_ids[b, : a + 1].tolist() for b, a in enumerate(accepted)]
    assert 0 < sum(accepted) < sum(counts)  # both outcomes occur


def test_ragged_rows_ignore_padding_and_match_single_row_calls() -> None:
    gen = seeded("ragged")
    batch, vocab = 64, 9
    num_draft = torch.randint(0, G + 1, (batch,), generator=gen)
    num_draft[:4] = torch.tensor([0, G, 1, 0])
    p = torch.stack([dirichlet(vocab, gen) for _ in range(batch * (G + 1))]).view(
        batch, G + 1, vocab
    )
    q = torch.stack([dirichlet(vocab, gen) for _ in range(batch * G)]).view(batch, G, vocab)
    drafts = draw(q.reshape(-1, vocab), gen).view(batch, G)
    accept_u = torch.rand(batch, G, generator=gen)
    final_u = torch.rand(batch, generator=gen)

    # Garbage beyond each row's length: NaN probabilities and out-of-range token ids.
    pos = torch.arange(G)
    pad_q = pos.unsqueeze(0) >= num_draft.unsqueeze(1)
    pad_p = torch.arange(G + 1).unsqueeze(0) > num_draft.unsqueeze(1)
    q_pad, p_pad = q.clone(), p.clone()
    q_pad[pad_q] = float("nan")
    p_pad[pad_p] = float("nan")
    drafts_pad = drafts.masked_fill(pad_q, -1)

    batched = rejection_sample(drafts_pad, num_draft, q_pad, p_pad, accept_u, final_u)
    clean = rejection_sample(drafts, num_draft, q, p, accept_u, final_u)
    assert torch.equal(batched.token_ids, clean.token_ids)
    assert torch.equal(batched.num_accepted, clean.num_accepted)
    for b in range(batch):
        g = int(num_draft[b])
        alone = rejection_sample(
            drafts[b : b + 1, :g],
            num_draft[b : b + 1],
            q[b : b + 1, :g],
            p[b : b + 1, : g + 1],
            accept_u[b : b + 1, :g],
            final_u[b : b + 1],
        )
        n_emit = int(alone.num_emitted[0])
        assert int(batched.num_emitted[b]) == n_emit
        assert torch.equal(batched.token_ids[b, :n_emit], alone.token_ids[0, :n_emit])
        assert (batched.token_ids[b, n_emit:] == 0).all()


def test_zero_draft_tokens_is_plain_sampling() -> None:
    gen = seeded("g0")
    batch, vocab = 32, 7
    p = torch.softmax(torch.randn(batch, 1, vocab, generator=gen), -1)
    u = torch.rand(batch, generator=gen)
    empty = torch.zeros(batch, 0, dtype=torch.int64)
    result = rejection_sample(
        empty, torch.zeros(batch, dtype=torch.int64), torch.zeros(batch, 0, vocab), p,
        torch.zeros(batch, 0), u,
    )  # fmt: skip
    assert result.token_ids.shape == (batch, 1)
    assert torch.equal(result.token_ids[:, 0], sample(p[:, 0], u))
    assert (result.num_accepted == 0).all() and (result.num_emitted == 1).all()
    # num_draft = 0 inside a G > 0 batch is the same thing.
    padded = rejection_sample(
        torch.zeros(batch, 2, dtype=torch.int64), torch.zeros(batch, dtype=torch.int64),
        torch.full((batch, 2, vocab), float("nan")), torch.cat([p, p, p], 1),
        torch.rand(batch, 2, generator=gen), u,
    )  # fmt: skip
    assert torch.equal(padded.token_ids[:, 0], result.token_ids[:, 0])


def test_zero_residual_falls_back_to_p_without_nan() -> None:
    """p <= q everywhere (p == q up to rounding): a rejection leaves no residual mass."""
    vocab, batch = 6, 8
    q = torch.tensor([0.3, 0.2, 0.2, 0.1, 0.1, 0.1])
    p = q * (1 - 1e-6)  # sums to slightly below 1: residual max(0, p - q) is exactly 0
    drafts = torch.arange(batch).remainder(vocab).unsqueeze(1)
    last_below_one = float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))
    result = rejection_sample(
        drafts,
        torch.ones(batch, dtype=torch.int64),
        q.expand(batch, 1, vocab),
        p.expand(batch, 2, vocab),
        torch.full((batch, 1), last_below_one),  # u * q(x) >= p(x): rejected
        torch.linspace(0, 0.999, batch),
    )
    assert (result.num_accepted == 0).all()
    assert torch.equal(
        result.token_ids[:, 0], sample(p.expand(batch, vocab), torch.linspace(0, 0.999, batch))
    )
    # And exactly equal p, q: always accepted (u < 1), never a NaN.
    result = rejection_sample(
        drafts, torch.ones(batch, dtype=torch.int64), q.expand(batch, 1, vocab),
        q.expand(batch, 2, vocab), torch.full((batch, 1), last_below_one), torch.rand(batch),
    )  # fmt: skip
    assert (result.num_accepted == 1).all()


def test_zero_probability_draft_is_never_accepted() -> None:
    # p(x) = 0 is rejected even at u = 0 (strict comparison).
    p = torch.tensor([[[0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]]])
    q = torch.tensor([[[1.0, 0.0, 0.0]]])
    result = rejection_sample(
        torch.tensor([[0]]), torch.tensor([1]), q, p, torch.zeros(1, 1), torch.zeros(1)
    )
    assert int(result.num_accepted[0]) == 0 and int(result.token_ids[0, 0]) == 1


def test_shape_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError):
        rejection_sample(
            torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
            torch.zeros(2, 3, 5), torch.zeros(2, 3, 5), torch.zeros(2, 3), torch.zeros(2),
        )  # fmt: skip


# ---- the same tests catch wrong samplers ---------------------------------------------------------
# Each bug is set up (with fixed distributions and seeds, not salted by SPECBATCH_TEST_SEED) so that
# its exact output distribution, computed below, is >= 0.04 away from p in total variation: twice
# the design threshold, so detection does not hang on a lucky seed.


def accept_prob(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P(accept | draft token x) under the rule u * q(x) < p(x), u ~ U[0, 1)."""
    return torch.where(q > 0, (p / q).clamp(max=1.0), (p > 0).to(p.dtype))


def exact_first_token(
    p: torch.Tensor,
    q_sampled: torch.Tensor,
    q_told: torch.Tensor,
    residual: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Exact law of the first emitted token of a one-draft round (possibly a buggy one)."""
    accepted = q_sampled * accept_prob(p, q_told)
    r = residual(p, q_told)
    r = r / r.sum() if r.sum() > 0 else p
    return accepted + (1.0 - accepted.sum()) * r


def exact_second_token_shared_u(ps: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Exact law of the token at position 1, given it is reached, when positions 0 and 1 reuse
    one uniform: reaching 1 means u < a_0(x_0), which makes acceptance at 1 likelier."""
    a0, a1 = accept_prob(ps[0], qs[0]), accept_prob(ps[1], qs[1])
    r1 = (ps[1] - qs[1]).clamp(min=0)
    r1 = r1 / r1.sum()
    weights = qs[0] * a0 / (qs[0] * a0).sum()  # law of x_0 given it was accepted
    out = torch.zeros_like(ps[1])
    for x0 in torch.nonzero(weights > 0).flatten().tolist():
        accepted = qs[1] * torch.minimum(a1, a0[x0]) / a0[x0]  # P(u < a1(x1) | u < a0(x0))
        out += weights[x0] * (accepted + (1.0 - accepted.sum()) * r1)
    return out


def far_pair(vocab: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.softmax(torch.linspace(2.0, -2.0, vocab), -1)
    return p, torch.softmax(torch.linspace(-1.0, 1.5, vocab), -1)


def clamped(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (p - q).clamp(min=0)


def test_exact_law_helpers_agree_with_theory() -> None:
    p, q = far_pair()
    assert total_variation(exact_first_token(p, q, q, clamped), p) < 1e-6


@pytest.mark.parametrize(
    "bug",
    [lambda p, q: p, lambda p, q: (p - q).abs(), lambda p, q: q],
    ids=["residual_is_p", "residual_unclamped", "residual_is_q"],
)
def test_wrong_residual_is_detected(monkeypatch: pytest.MonkeyPatch, bug: Callable) -> None:
    p, q = far_pair()
    assert total_variation(exact_first_token(p, q, q, bug), p) >= 0.04
    monkeypatch.setattr(rs_module, "residual_distribution", bug)
    monkeypatch.setattr(rs_module, "cpu_kernels", lambda: None)  # the torch rule
    gen = torch.Generator().manual_seed(11)
    tokens, _ = first_token_trial(p, q, gen, None)
    assert first_token_p_value(tokens, p) < ALPHA / 2


def test_q_without_top_p_is_detected() -> None:
    """The draft samples from its top-p distribution, the sampler is given q before top-p."""
    plain = SamplingTensors.from_lists([1.0], [0], [1.0], [0.0], "cpu")
    nucleus = SamplingTensors.from_lists([1.0], [0], [0.7], [0.0], "cpu")
    logits_q = torch.tensor([[3.0, 2.5, 2.0, 1.5, 1.0, 1.0, 1.0, 1.0] + [0.0] * 8])
    logits_p = torch.tensor([[1.5, 2.0, 2.5, 3.0, 2.5, 1.0, 1.0, 0.5] + [0.0] * 8])
    q_full = logits_to_probs(logits_q, plain)[0]
    q_top_p = logits_to_probs(logits_q, nucleus)[0]
    p = logits_to_probs(logits_p, nucleus)[0]
    assert total_variation(exact_first_token(p, q_top_p, q_full, clamped), p) >= 0.04
    gen = torch.Generator().manual_seed(12)
    good, _ = first_token_trial(p, q_top_p, gen, None)
    assert first_token_p_value(good, p) > ALPHA
    bad, _ = first_token_trial(p, q_top_p, gen, q_full)
    assert first_token_p_value(bad, p) < ALPHA


def test_shared_uniform_across_positions_is_detected() -> None:
    vocab = 8
    uniform = torch.full((vocab,), 1 / vocab)
    ps = torch.stack(
        [torch.tensor([0.3] + [0.1] * 7), torch.tensor([0.1] * 4 + [0.15] * 4), uniform, uniform]
    )
    qs = torch.stack(
        [torch.tensor([0.86] + [0.02] * 7), torch.tensor([0.2] * 4 + [0.05] * 4), uniform]
    )
    assert total_variation(exact_second_token_shared_u(ps.double(), qs.double()), ps[1]) >= 0.04
    gen = torch.Generator().manual_seed(13)
    num_draft = torch.full((N_MULTI,), G, dtype=torch.int64)
    good = position_p_values(multi_position_round(ps, qs, gen, num_draft), ps)
    assert all(pv > ALPHA / (G + 1) for pv in good)
    bad = position_p_values(multi_position_round(ps, qs, gen, num_draft, share_uniforms=True), ps)
    assert bad[1] < ALPHA / (G + 1)


def test_bonus_from_wrong_position_is_detected() -> None:
    """Rows reaching position j as a bonus (num_draft = j) get p_{j-1}: a fraction f_j of the
    rows reaching j, so the error there is f_j * TV(p_j, p_{j-1})."""
    gen, ps, qs = multi_position_setup("wrong-bonus", salted=False)
    num_draft = torch.randint(1, G + 1, (N_MULTI,), generator=gen)
    num_draft[: N_MULTI // 2] = G
    assert min(total_variation(ps[j], ps[j - 1]) for j in range(1, G + 1)) >= 0.2
    bad = position_p_values(multi_position_round(ps, qs, gen, num_draft, bonus_off_by_one=True), ps)
    assert max(bad[1:]) < ALPHA / (G + 1)


# ---- whole sequences over several rounds ---------------------------------------------------------


def generate_markov(
    target: torch.Tensor,
    draft: torch.Tensor,
    length: int,
    gen: torch.Generator,
) -> torch.Tensor:
    """N sequences of `length` tokens from the Markov chain `target` ([V, V], row = previous
    token; start token 0), decoded speculatively with `draft` and a random gamma (0..G) per row
    and round. Returns int64 [N, length]."""
    out = torch.zeros(N, length + G + 1, dtype=torch.int64)
    filled = torch.zeros(N, dtype=torch.int64)
    last = torch.zeros(N, dtype=torch.int64)
    rows = torch.arange(N)
    while bool((filled < length).any()):
        num_draft = torch.randint(0, G + 1, (N,), generator=gen)
        prev, drafts, qs = last, [], []
        for _ in range(G):
            qs.append(draft[prev])
            prev = draw(qs[-1], gen)
            drafts.append(prev)
        draft_ids = torch.stack(drafts, 1)
        context = torch.cat([last.unsqueeze(1), draft_ids], 1)  # p_i conditions on token i - 1
        result = rejection_sample(
            draft_ids,
            num_draft,
            torch.stack(qs, 1),
            target[context],
            torch.rand(N, G, generator=gen),
            torch.rand(N, generator=gen),
        )
        active = filled < length
        j = torch.arange(G + 1).unsqueeze(0)
        write = (j < result.num_emitted.unsqueeze(1)) & active.unsqueeze(1)
        cols = filled.unsqueeze(1) + j
        out[rows.unsqueeze(1).expand_as(write)[write], cols[write]] = result.token_ids[write]
        last = torch.where(active, result.token_ids[rows, result.num_emitted - 1], last)
        filled = torch.where(active, filled + result.num_emitted, filled)
    return out[:, :length]


def sequence_p_value(seqs: torch.Tensor, target: torch.Tensor) -> float:
    vocab, length = target.shape[0], seqs.shape[1]
    probs = torch.ones(1, dtype=torch.float64)
    prev = torch.zeros(1, dtype=torch.int64)
    for _ in range(length):  # enumerate all V^length sequences in base-V order
        probs = (probs.unsqueeze(1) * target[prev].double()).reshape(-1)
        prev = torch.arange(vocab).repeat(probs.shape[0] // vocab)
    codes = (seqs * vocab ** torch.arange(length - 1, -1, -1)).sum(1)
    counts = torch.bincount(codes, minlength=vocab**length)
    return chi_square_gof(counts.numpy(), probs.numpy()).p_value


def markov_setup(
    name: str, salted: bool = True
) -> tuple[torch.Generator, torch.Tensor, torch.Tensor]:
    gen = seeded(name, salted)
    vocab = 4
    st = SamplingTensors.from_lists([0.8] * vocab, [3] * vocab, [1.0] * vocab, [0.0] * vocab, "cpu")
    target = logits_to_probs(torch.randn(vocab, vocab, generator=gen) * 1.5, st)
    draft = logits_to_probs(torch.randn(vocab, vocab, generator=gen) * 1.5, st)
    return gen, target, draft


def test_whole_sequences_match_plain_sampling() -> None:
    """3-token sequences (64 categories) from a top-k Markov target, drafted by another chain."""
    gen, target, draft = markov_setup("markov")
    seqs = generate_markov(target, draft, 3, gen)
    assert sequence_p_value(seqs, target) > ALPHA


def test_whole_sequences_catch_a_wrong_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rs_module, "residual_distribution", lambda p, q: p)
    monkeypatch.setattr(rs_module, "cpu_kernels", lambda: None)  # the torch rule
    gen, target, draft = markov_setup("markov", salted=False)
    seqs = generate_markov(target, draft, 3, gen)
    assert sequence_p_value(seqs, target) < ALPHA
