"""logits_to_probs against a slow per-row reference, and inverse-CDF `sample`."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specbatch.errors import InvalidInputError
from specbatch.stats import chi_square_gof
from specbatch.worker.sampler import SamplingTensors, logits_to_probs, sample

# Per-test false-alarm rate of the statistical checks below.
ALPHA = 1e-3


def reference_probs(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> np.ndarray:
    """Slow, obvious float64 version of the contract, one row at a time."""
    z = np.asarray(logits, dtype=np.float64)
    vocab = z.size
    if temperature == 0.0:
        out = np.zeros(vocab)
        out[int(np.argmax(z))] = 1.0
        return out
    z = z / temperature
    order = sorted(range(vocab), key=lambda i: (-z[i], i))  # ties: lower id ranks first
    kept = order[:top_k] if 0 < top_k < vocab else order
    weights = np.exp(z[kept] - z[kept].max())
    probs = weights / weights.sum()
    if top_p < 1.0:
        cum, n = 0.0, 0
        for prob in probs:
            n += 1
            cum += prob
            if cum >= top_p:
                break
        kept, probs = kept[:n], probs[:n] / probs[:n].sum()
    if min_p > 0.0:
        ok = probs >= min_p * probs.max()
        kept = [t for t, keep in zip(kept, ok, strict=True) if keep]
        probs = probs[ok] / probs[ok].sum()
    out = np.zeros(vocab)
    out[kept] = probs
    return out


def make_st(rows: list[tuple[float, int, float, float]]) -> SamplingTensors:
    t, k, p, m = (list(col) for col in zip(*rows, strict=True))
    return SamplingTensors.from_lists(t, k, p, m, device="cpu")


def check_against_reference(logits: torch.Tensor, rows: list[tuple[float, int, float, float]]):
    probs = logits_to_probs(logits, make_st(rows))
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    for i, (t, k, p, m) in enumerate(rows):
        ref = reference_probs(logits[i].tolist(), t, k, p, m)
        got = probs[i].double().numpy()
        np.testing.assert_array_equal(got > 0, ref > 0, err_msg=f"row {i} mask {rows[i]}")
        np.testing.assert_allclose(got, ref, atol=2e-6, rtol=1e-5, err_msg=f"row {i} {rows[i]}")
        assert got.sum() == pytest.approx(1.0, abs=1e-5)


def test_temperature_zero_is_exact_one_hot_first_index_on_ties() -> None:
    logits = torch.tensor(
        [
            [0.1, 2.0, 2.0, -1.0],  # tie -> index 1
            [5.0, 5.0, 5.0, 5.0],  # all tied -> index 0
            [-3.0, -2.0, -1.0, -1.0],
            [0.0, 1.0, 3.0, 2.0],
        ]
    )
    # Other knobs set on greedy rows must not change anything.
    st = make_st([(0.0, 0, 1.0, 0.0), (0.0, 2, 0.5, 0.3), (0.0, 1, 0.1, 0.9), (0.0, 0, 1.0, 0.0)])
    probs = logits_to_probs(logits, st)
    expected = torch.zeros(4, 4)
    expected[torch.arange(4), torch.tensor([1, 0, 2, 2])] = 1.0
    assert torch.equal(probs, expected)
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))


def test_plain_temperature_matches_softmax() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen) * 3
    temps = [1.0, 0.5, 2.0, 0.05, 1.3, 10.0]
    probs = logits_to_probs(logits, make_st([(t, 0, 1.0, 0.0) for t in temps]))
    ref = torch.softmax(logits / torch.tensor(temps).unsqueeze(1), dim=-1)
    torch.testing.assert_close(probs, ref)


@pytest.mark.parametrize(
    "params",
    [
        (1.0, 5, 1.0, 0.0),
        (0.7, 1, 1.0, 0.0),
        (1.0, 31, 1.0, 0.0),
        (1.0, 32, 1.0, 0.0),  # k == vocab: off
        (1.0, 100, 1.0, 0.0),  # k > vocab: off
        (1.0, 0, 0.9, 0.0),
        (0.5, 0, 0.5, 0.0),
        (1.5, 0, 1e-6, 0.0),  # top token always kept
        (1.0, 0, 0.999, 0.0),
        (1.0, 0, 1.0, 0.1),
        (2.0, 0, 1.0, 0.5),
        (1.0, 0, 1.0, 1.0),  # only the max (and exact ties) survive
        (1.0, 8, 0.8, 0.0),  # top-p on the renormalised top-k distribution
        (0.8, 10, 0.95, 0.05),
    ],
)
def test_masks_match_reference(params: tuple[float, int, float, float]) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 32, generator=gen) * 2
    check_against_reference(logits, [params] * 16)


def test_mixed_rows_in_one_batch() -> None:
    gen = torch.Generator().manual_seed(2)
    rows = [
        (0.0, 0, 1.0, 0.0),
        (1.0, 0, 1.0, 0.0),
        (0.7, 4, 1.0, 0.0),
        (1.2, 0, 0.6, 0.0),
        (1.0, 0, 1.0, 0.2),
        (0.9, 6, 0.8, 0.05),
        (0.0, 3, 0.5, 0.5),
        (1.0, 0, 1.0, 0.0),
    ]
    logits = torch.randn(len(rows), 40, generator=gen) * 2.5
    check_against_reference(logits, rows)
    # Each row is computed as if alone in the batch, bit for bit (batch invariance).
    together = logits_to_probs(logits, make_st(rows))
    for i, row in enumerate(rows):
        alone = logits_to_probs(logits[i : i + 1], make_st([row]))
        assert torch.equal(together[i : i + 1], alone), f"row {i} differs alone"


def test_top_k_ties_keep_lower_ids() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0]])
    probs = logits_to_probs(logits, make_st([(1.0, 2, 1.0, 0.0)]))
    assert torch.equal(probs > 0, torch.tensor([[False, True, True, False, False]]))
    torch.testing.assert_close(probs[0, 1:3], torch.tensor([0.5, 0.5]))


def test_top_p_boundary() -> None:
    # probs 0.5, 0.25, 0.125, 0.125: top_p = 0.75 is reached exactly with two tokens.
    logits = torch.tensor([[math.log(0.5), math.log(0.25), math.log(0.125), math.log(0.125)]])
    probs = logits_to_probs(logits, make_st([(1.0, 0, 0.75, 0.0)]))
    torch.testing.assert_close(probs, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    probs = logits_to_probs(logits, make_st([(1.0, 0, 0.76, 0.0)]))
    assert int((probs > 0).sum()) == 3


def test_masked_vocab_entries_stay_zero() -> None:
    logits = torch.tensor([[float("-inf"), 1.0, 0.5, float("-inf")]])
    for row in [(1.0, 0, 1.0, 0.0), (1.0, 3, 0.99, 0.01), (0.0, 0, 1.0, 0.0)]:
        probs = logits_to_probs(logits, make_st([row]))
        assert probs[0, 0] == 0 and probs[0, 3] == 0 and not torch.isnan(probs).any()


def test_sampling_tensors_flags_and_repeat() -> None:
    st = SamplingTensors.from_lists([0.0, 1.0, 0.5], [0, 5, 0], [1.0, 1.0, 0.9], [0, 0, 0], "cpu")
    assert (st.any_greedy, st.any_top_k, st.any_top_p, st.any_min_p) == (True, True, True, False)
    plain = SamplingTensors.from_lists([1.0], [0], [1.0], [0.0], "cpu")
    assert not (plain.any_greedy or plain.any_top_k or plain.any_top_p or plain.any_min_p)
    assert st.temperature.dtype == torch.float32 and st.top_k.dtype == torch.int64

    rep = st.repeat_interleave([2, 0, 3])
    assert rep.temperature.tolist() == [0.0, 0.0, 0.5, 0.5, 0.5]
    assert rep.top_k.tolist() == [0, 0, 0, 0, 0]
    assert rep.top_p.tolist() == pytest.approx([1.0, 1.0, 0.9, 0.9, 0.9])
    rep_t = st.repeat_interleave(torch.tensor([1, 2, 1]), total=4)
    assert rep_t.top_k.tolist() == [0, 5, 5, 0]
    assert rep_t.any_top_k


@pytest.mark.parametrize(
    "bad",
    [
        ([1.0, 1.0], [0], [1.0], [0.0]),
        ([1.0], [0], [1.0, 1.0], [0.0]),
    ],
)
def test_sampling_tensors_reject_bad_values(bad) -> None:
    with pytest.raises(InvalidInputError):
        SamplingTensors.from_lists(*bad, device="cpu")


def test_sample_never_returns_zero_probability_tokens() -> None:
    probs = torch.tensor(
        [
            [0.0, 0.0, 0.3, 0.0, 0.7, 0.0, 0.0],
            [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5],
            [1e-30, 0.0, 0.0, 0.0, 0.0, 1.0, 1e-30],  # a tail token lost in float64 rounding
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
        ]
    )
    one = torch.tensor(1.0, dtype=torch.float64)
    u_values = [
        0.0,
        float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))),  # largest float32 < 1
        float(torch.nextafter(one, torch.tensor(0.0, dtype=torch.float64))),  # largest float64 < 1
        1.0,  # out of contract, but still no zero-probability token
        0.3,
        0.5,
    ]
    for u in u_values:
        tokens = sample(probs, torch.full((5,), u, dtype=torch.float64))
        assert tokens.dtype == torch.int64
        picked = probs[torch.arange(5), tokens]
        assert (picked > 0).all(), (u, tokens)
    # u = 0 picks the first token with mass, u -> 1 the last one that registers in the CDF.
    assert sample(probs, torch.zeros(5)).tolist() == [2, 1, 0, 0, 6]
    assert sample(probs, torch.full((5,), 1.0 - 1e-7)).tolist() == [4, 1, 6, 5, 6]


def test_sample_is_deterministic_and_ignores_normalisation() -> None:
    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(64, 20, generator=gen), dim=-1)
    u = torch.rand(64, generator=gen)
    kept = probs.clone(), u.clone()
    tokens = sample(probs, u)
    assert torch.equal(probs, kept[0]) and torch.equal(u, kept[1])  # its inputs are left as given
    assert torch.equal(tokens, sample(probs * 3.5, u))
    # Inverse CDF: the token is the first one whose cumulative mass exceeds u.
    cdf = probs.double().cumsum(-1)
    expected = (cdf <= u.double().unsqueeze(1)).sum(-1)
    assert torch.equal(sample(probs, u), expected)


@pytest.mark.parametrize("kind", ["dirichlet", "peaked", "sparse"])
def test_sample_frequencies_match_probs(kind: str) -> None:
    """N = 200k draws, chi-square at false-alarm rate ALPHA."""
    gen = torch.Generator().manual_seed(4)
    vocab = 24
    if kind == "dirichlet":
        p = -torch.log(torch.rand(vocab, generator=gen))  # Dirichlet(1, ..., 1)
        p = p / p.sum()
    elif kind == "peaked":
        p = torch.softmax(torch.randn(vocab, generator=gen) * 4, dim=-1)
    else:
        p = torch.zeros(vocab)
        p[[1, 5, 6, 23]] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 200_000
    tokens = sample(p.expand(n, vocab), torch.rand(n, generator=gen))
    counts = torch.bincount(tokens, minlength=vocab)
    assert chi_square_gof(counts.numpy(), p.double().numpy()).p_value > ALPHA


def test_sample_frequencies_catch_a_skewed_sampler() -> None:
    """The same check rejects samples from a distribution 2% (TV) away."""
    gen = torch.Generator().manual_seed(5)
    p = torch.full((16,), 1 / 16)
    skew = p.clone()
    skew[0] += 0.02
    skew[1] -= 0.02
    n = 200_000
    tokens = sample(skew.expand(n, 16), torch.rand(n, generator=gen))
    counts = torch.bincount(tokens, minlength=16)
    assert chi_square_gof(counts.numpy(), p.numpy()).p_value < ALPHA
