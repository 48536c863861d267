"""The rejection sampler of speculative decoding (THEORY.md, steps 3-4), batched and ragged.

Request b proposed `num_draft[b]` draft tokens (0..G). Walking its drafts in order, draft x at
position i is accepted iff `accept_u[b, i] * q_i(x) < p_i(x)`; the first rejection at position n
emits one token from the residual `max(0, p_n - q_n)`; if every draft is accepted, the bonus token
comes from `p` at position `num_draft[b]`. Every request therefore emits `num_accepted + 1` tokens,
distributed exactly as sampling from `p` token by token.

On a GPU everything is batched torch ops over [B, G] and [B, G+1, V]: no Python loop over
requests or positions, no host sync; on the CPU one kernel call (csrc/rejection.c) does the same
arithmetic request by request. No random draws either way: the uniforms come from each
request's own generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specbatch.kernels.cpu import cpu_kernels
from specbatch.worker.sampler import sample


@dataclass
class RejectionResult:
    """Outcome of one speculative round for B requests.

    The tokens emitted by request b are `token_ids[b, :num_emitted[b]]` (the accepted drafts, then
    the residual or bonus token); the rest of the row is padding 0.
    """

    token_ids: torch.Tensor  # int64 [B, G+1]
    num_accepted: torch.Tensor  # int64 [B], 0..num_draft[b]
    num_emitted: torch.Tensor  # int64 [B] = num_accepted + 1


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Unnormalised residual `max(0, p - q)` [B, V]; `sample` normalises it implicitly."""
    return torch.clamp(p - q, min=0.0)


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    accept_u: torch.Tensor,
    final_u: torch.Tensor,
) -> RejectionResult:
    """Accept a prefix of each request's drafts and emit one more token (residual or bonus).

    Args:
        draft_token_ids: int64 [B, G]; entries at positions >= num_draft[b] are ignored.
        num_draft: int64 [B], each in 0..G (the request's gamma for this round).
        draft_probs: [B, G, V], q: the distributions the draft actually sampled each token from;
            None: each q is the point mass on its draft token (an n-gram drafter), so a draft
            x is accepted with probability p(x) and the residual is p without x.
        target_probs: [B, G+1, V], p at each verified position; position num_draft[b] is the
            bonus position. Entries beyond num_draft[b] (drafts, q, p) are padding, may hold
            anything (even NaN) and are never read into the result.
        accept_u: [B, G] uniforms in [0, 1), one per draft position.
        final_u: [B] uniforms in [0, 1) for the residual or bonus token.
    """
    batch, gamma = draft_token_ids.shape
    if num_draft.shape != (batch,) or accept_u.shape != (batch, gamma) or final_u.shape != (batch,):
        raise ValueError(
            f"rejection_sample: shapes draft_token_ids {tuple(draft_token_ids.shape)}, "
            f"num_draft {tuple(num_draft.shape)}, accept_u {tuple(accept_u.shape)}, "
            f"final_u {tuple(final_u.shape)} do not agree"
        )
    if target_probs.shape[:2] != (batch, gamma + 1) or (
        draft_probs is not None and draft_probs.shape[:2] != (batch, gamma)
    ):
        q_shape = None if draft_probs is None else tuple(draft_probs.shape)
        raise ValueError(
            f"rejection_sample: draft_probs {q_shape} must be [B, G, V] and "
            f"target_probs {tuple(target_probs.shape)} [B, G+1, V] with B={batch}, G={gamma}"
        )
    kernels = cpu_kernels()
    if (
        kernels is not None
        and target_probs.device.type == "cpu"
        and target_probs.dtype == torch.float32
        and (draft_probs is None or draft_probs.dtype == torch.float32)
    ):
        tokens, accepted = kernels.rejection_sample(
            draft_token_ids, num_draft, draft_probs, target_probs, accept_u, final_u
        )
        return RejectionResult(token_ids=tokens, num_accepted=accepted, num_emitted=accepted + 1)
    return rejection_sample_reference(
        draft_token_ids, num_draft, draft_probs, target_probs, accept_u, final_u
    )


def rejection_sample_reference(
    draft_token_ids: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    accept_u: torch.Tensor,
    final_u: torch.Tensor,
) -> RejectionResult:
    """``rejection_sample`` in torch ops (what the CPU kernel computes, any device)."""
    batch, gamma = draft_token_ids.shape
    device = draft_token_ids.device
    if gamma == 0:  # nothing drafted: the token is p's
        token = sample(target_probs[:, 0], final_u)
        none = torch.zeros(batch, dtype=torch.int64, device=device)
        return RejectionResult(token_ids=token[:, None], num_accepted=none, num_emitted=none + 1)
    rows = torch.arange(batch, device=device)
    positions = torch.arange(gamma, device=device).unsqueeze(0)  # [1, G]
    valid = positions < num_draft.unsqueeze(1)  # [B, G]
    safe_ids = torch.where(valid, draft_token_ids, 0)

    # Accept test at every position at once; only the prefix before the first failure counts.
    p_draft = target_probs[:, :gamma].gather(2, safe_ids.unsqueeze(2)).squeeze(2)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, safe_ids.unsqueeze(2)).squeeze(2)
    accepted = valid & (accept_u * q_draft < p_draft)
    num_accepted = torch.cumprod(accepted.to(torch.int64), dim=1).sum(dim=1)  # [B]
    rejected = num_accepted < num_draft  # [B]

    # The extra token: from p at position n = num_accepted (the bonus position when all were
    # accepted), or from the residual of position n when the draft at n was rejected.
    p_n = target_probs[rows, num_accepted]  # [B, V]
    final_dist = p_n
    if gamma > 0:
        at = num_accepted.clamp(max=gamma - 1)
        if draft_probs is None:  # p minus the point mass: p with the rejected token removed
            residual = p_n.scatter(1, safe_ids[rows, at].unsqueeze(1), 0.0)
        else:
            residual = residual_distribution(p_n, draft_probs[rows, at])
        # p == q (numerically) leaves no residual mass: a rejection then had probability ~0,
        # and p itself is the right fallback (no division anywhere, so no NaN).
        use_residual = rejected & (residual.sum(dim=-1) > 0)
        final_dist = torch.where(use_residual.unsqueeze(1), residual, p_n)
    final_token = sample(final_dist, final_u)

    token_ids = torch.zeros(batch, gamma + 1, dtype=torch.int64, device=device)
    token_ids[:, :gamma] = torch.where(positions < num_accepted.unsqueeze(1), safe_ids, 0)
    token_ids.scatter_(1, num_accepted.unsqueeze(1), final_token.unsqueeze(1))
    return RejectionResult(
        token_ids=token_ids, num_accepted=num_accepted, num_emitted=num_accepted + 1
    )


def greedy_walk(
    drafts: list[list[int]], counts: list[int], argmax: list[int], first: list[int]
) -> tuple[list[list[int]], list[int]]:
    """The rule above when every p and q is one-hot (greedy), on host lists: request b's
    drafts are accepted while each equals the target's argmax at the row before it, and it
    emits them and the argmax at the first mismatch (or at the bonus row). ``argmax``: one per
    verified row; ``first[b]``: the row of b's root; ``drafts[b][:counts[b]]`` its drafts.
    Returns (emitted, accepted) per request."""
    emitted: list[list[int]] = []
    accepted: list[int] = []
    for toks, n, f in zip(drafts, counts, first, strict=True):
        a = 0
        while a < n and toks[a] == argmax[f + a]:
            a += 1
        emitted.append(argmax[f : f + a + 1])
        accepted.append(a)
    return emitted, accepted
