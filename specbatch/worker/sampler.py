"""Turning logits into the distribution a request samples from, and sampling from it.

The same two functions serve the draft and the target: the draft samples its proposals with
`sample(logits_to_probs(...), u)` and must hand exactly those probabilities to the rejection
sampler as `q`; the target's verified probabilities `p` come from `logits_to_probs` with the same
per-request parameters. Greedy (temperature 0) is a one-hot distribution, so it needs no special
path anywhere else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from specbatch.errors import InvalidInputError
from specbatch.kernels.cpu import cpu_kernels
from specbatch.sampling_params import SamplingParams


@dataclass
class SamplingTensors:
    """Per-row sampling parameters for N rows (one row = one position of one request).

    The host flags are computed once, when the tensors are built, so that `logits_to_probs` can
    skip the sort (top-k/top-p) or the min-p pass without reading the tensors back from the device.
    A flag may be conservatively True (e.g. after `repeat_interleave` drops rows); never False when
    some row uses the transform.
    """

    temperature: torch.Tensor  # float32 [N]; 0 means greedy
    top_k: torch.Tensor  # int64 [N]; 0 (or >= vocab) means off
    top_p: torch.Tensor  # float32 [N]; 1.0 means off
    min_p: torch.Tensor  # float32 [N]; 0.0 means off
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_greedy: bool
    unit_temperature: bool = False  # every row's temperature is 1 or 0: no scaling to do

    @classmethod
    def from_lists(
        cls,
        temperature: list[float],
        top_k: list[int],
        top_p: list[float],
        min_p: list[float],
        device: torch.device | str | None = None,
    ) -> SamplingTensors:
        """Build the tensors (one host-to-device copy each) and the host flags, from values
        ``SamplingParams`` checked."""
        n = len(temperature)
        for name, values in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
            if len(values) != n:
                raise InvalidInputError(
                    f"SamplingTensors: {name} has {len(values)} rows, temperature has {n}"
                )
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            min_p=torch.tensor(min_p, dtype=torch.float32, device=device),
            any_top_k=any(k > 0 for k in top_k),
            any_top_p=any(p < 1.0 for p in top_p),
            any_min_p=any(m > 0.0 for m in min_p),
            any_greedy=any(t == 0.0 for t in temperature),
            unit_temperature=all(t in (0.0, 1.0) for t in temperature),
        )

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        device: torch.device | str | None = None,
        repeats: list[int] | None = None,
    ) -> SamplingTensors:
        """One row per request, or ``repeats[b]`` rows of request b."""
        if repeats is not None:
            params = [p for p, n in zip(params, repeats, strict=True) for _ in range(n)]
        return cls.from_lists(
            [p.temperature for p in params],
            [p.top_k for p in params],
            [p.top_p for p in params],
            [p.min_p for p in params],
            device=device,
        )

    def take(self, index: torch.Tensor) -> SamplingTensors:
        """The rows ``index`` (int64, on the tensors' device); the flags stay as they were."""
        return dataclasses.replace(
            self,
            temperature=self.temperature.index_select(0, index),
            top_k=self.top_k.index_select(0, index),
            top_p=self.top_p.index_select(0, index),
            min_p=self.min_p.index_select(0, index),
        )

    def repeat_interleave(
        self, counts: torch.Tensor | list[int], total: int | None = None
    ) -> SamplingTensors:
        """Row b repeated counts[b] times (e.g. once per verified position of request b).

        With a device tensor for `counts`, pass `total` (= sum of counts) to avoid a host sync.
        """
        if isinstance(counts, list):
            total = sum(counts)
            counts = torch.tensor(counts, dtype=torch.int64, device=self.temperature.device)

        def rep(t: torch.Tensor) -> torch.Tensor:
            return torch.repeat_interleave(t, counts, output_size=total)

        return SamplingTensors(
            temperature=rep(self.temperature),
            top_k=rep(self.top_k),
            top_p=rep(self.top_p),
            min_p=rep(self.min_p),
            any_top_k=self.any_top_k,
            any_top_p=self.any_top_p,
            any_min_p=self.any_min_p,
            any_greedy=self.any_greedy,
            unit_temperature=self.unit_temperature,
        )


def _apply_top_k_top_p(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Mask (to -inf) the tokens outside top-k, then outside top-p of the top-k distribution.

    Ties in the ranking are broken towards the lower token id (stable sort), so the kept set is
    deterministic.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if st.any_top_k:
        k = torch.where(st.top_k > 0, st.top_k, vocab).clamp(max=vocab)
        drop |= rank.unsqueeze(0) >= k.unsqueeze(1)
    if st.any_top_p:
        masked = sorted_logits.masked_fill(drop, float("-inf"))
        sorted_probs = torch.softmax(masked, dim=-1)
        # Mass of the strictly better-ranked tokens: keep a token while that is below top_p, i.e.
        # the smallest prefix whose mass reaches top_p. Rank 0 is always kept (its prefix is 0).
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        top_p_on = (st.top_p < 1.0).unsqueeze(1)
        drop |= top_p_on & (mass_before >= st.top_p.unsqueeze(1)) & (rank.unsqueeze(0) > 0)
    keep_mask = torch.empty_like(drop).scatter_(1, order, ~drop)
    return logits.masked_fill(~keep_mask, float("-inf"))


def logits_to_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The distribution each row actually samples from: float32 [N, V], rows sum to 1.

    Order: temperature, top-k, top-p (on the top-k distribution), min-p (p >= min_p * max p),
    renormalised. Temperature-0 rows are exactly one-hot at `argmax(logits)` (first index on
    ties), whatever the other parameters say.
    """
    logits = logits.float()
    greedy = st.temperature == 0.0 if st.any_greedy else None
    scaled = logits
    if not st.unit_temperature:
        temperature = st.temperature
        if greedy is not None:
            temperature = torch.where(greedy, torch.ones_like(temperature), temperature)
        scaled = logits / temperature.unsqueeze(1)
    if st.any_top_k or st.any_top_p:
        scaled = _apply_top_k_top_p(scaled, st)
    probs = torch.softmax(scaled, dim=-1)
    if st.any_min_p:  # rows without min-p are left as they are, bit for bit
        threshold = st.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        cut = probs.masked_fill(probs < threshold, 0.0)
        cut = cut / cut.sum(dim=-1, keepdim=True)
        probs = torch.where((st.min_p > 0.0).unsqueeze(1), cut, probs)
    if greedy is not None:
        top = torch.argmax(logits, dim=-1, keepdim=True)
        one_hot = torch.zeros_like(probs).scatter_(1, top, 1.0)
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return probs


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling, one uniform per row: int64 [N].

    Returns the first token whose cumulative mass (float64) exceeds `u * total`, so rows need not
    be normalised and a token of probability 0 is never returned: not at u = 0, and not when
    rounding pushes `u * total` to the end (clamped to the last token with positive mass).
    Deterministic given `u`. A row with no positive mass at all returns token 0, and a row
    holding NaN a token inside the vocabulary.
    """
    kernels = cpu_kernels()
    if (
        kernels is not None
        and probs.device.type == "cpu"
        and probs.dim() == 2
        and (probs.dtype == u.dtype == torch.float32)
    ):
        return kernels.sample_rows(probs, u)
    return sample_reference(probs, u)


def sample_reference(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``sample`` in torch ops (what the CPU kernel computes, any device)."""
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)
    target = u.to(torch.float64) * cdf[:, -1]
    idx = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    # Adding 0 is exact, so a zero-mass token never raises the CDF: the first index where the CDF
    # reaches the total is a token with positive mass (the last one that still counts).
    last_positive = torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False).squeeze(1)
    return torch.minimum(idx, last_positive).clamp_(max=probs.shape[-1] - 1)
