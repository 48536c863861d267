"""Exactness of tree verification: whole multi-token outputs of rounds over draft trees are
distributed as sampling the target token by token.

A synthetic target and drafter over a vocabulary of 5: the distribution after any prefix is a
fixed random one (seeded by the prefix), q a different one, so every context has its own p and
q. Each trial runs rounds, each verifying a tree drawn from q (top-k children for the walk,
children sampled without replacement for recursive rejection sampling), until it has emitted
3 tokens; the 125 possible outputs are compared with the exact law by a chi-square test.
False alarms: ALPHA = 1e-3 per test. Power: N = 20,000 trials catch a total-variation error of
0.05 with probability >= POWER (checked by ``stats.power`` before the test runs).
"""

from __future__ import annotations

import functools
import itertools
import random
import zlib
from collections import Counter

import pytest
import torch

from specbatch.stats import chi_square_gof, power
from specbatch.worker import tree_verify
from specbatch.worker.tree_topology import Topology
from specbatch.worker.tree_verify import rrs_draws, verify_tree, walk_draws

VOCAB = 5
LENGTH = 3
N = 20_000
ALPHA = 1e-3
POWER = 0.9
TV = 0.05


@functools.cache
def dist(prefix: tuple[int, ...], salt: str, temperature: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{salt}{prefix}".encode()))
    return torch.softmax(torch.randn(VOCAB, generator=gen) * 1.5 / temperature, dim=0)


def p_of(prefix):
    return dist(prefix, "p")


def q_of(prefix):
    return dist(prefix, "q", temperature=0.7)


def exact_law() -> dict[tuple[int, ...], float]:
    law = {}
    for seq in itertools.product(range(VOCAB), repeat=LENGTH):
        prob = 1.0
        for i, t in enumerate(seq):
            prob *= float(p_of(seq[:i])[t])
        law[seq] = prob
    return law


@functools.cache
def q_list(prefix: tuple[int, ...]) -> tuple[float, ...]:
    return tuple(q_of(prefix).tolist())


def grow(prefix, depth, topk, sampled, rng):
    """A full tree: every node to ``depth`` gets ``topk`` children (fewer where q runs out)."""
    tokens, parents, q_nodes = [], [], {0: prefix}
    frontier = [(0, prefix)]
    for _ in range(depth):
        nxt = []
        for node, ctx in frontier:
            q_nodes[node] = ctx
            q = q_list(ctx)
            if sampled:  # without replacement, in drawing order
                left, kids = list(q), []
                for _ in range(topk):
                    total = sum(left)
                    if total <= 0:
                        break
                    x, acc, target = 0, 0.0, rng.random() * total
                    for x, w in enumerate(left):  # noqa: B007 (x is the draw)
                        acc += w
                        if acc > target and w > 0:
                            break
                    kids.append(x)
                    left[x] = 0.0
            else:
                kids = sorted(range(VOCAB), key=lambda t: -q[t])[:topk]
            for x in kids:
                tokens.append(x)
                parents.append(node)
                nxt.append((len(tokens), (*ctx, x)))
        frontier = nxt
    return tokens, parents, q_nodes


def run_trials(sampled: bool, depth: int = 2, topk: int = 2, seed: int = 0) -> list[tuple]:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    outputs: list[tuple[int, ...]] = [()] * N
    while any(len(o) < LENGTH for o in outputs):
        todo = [i for i, o in enumerate(outputs) if len(o) < LENGTH]
        trees = [grow(outputs[i], depth, topk, sampled, rng) for i in todo]
        width = max(len(t[0]) for t in trees)
        b = len(todo)
        tokens = torch.zeros(b, width, dtype=torch.int64)
        parents = torch.zeros(b, width, dtype=torch.int64)
        counts = torch.tensor([len(t[0]) for t in trees])
        q = torch.zeros(b, max(width, 1), VOCAB)
        p_rows, first = [], []
        for r, (i, (toks, pars, q_rows)) in enumerate(zip(todo, trees, strict=True)):
            tokens[r, : len(toks)] = torch.tensor(toks)
            parents[r, : len(pars)] = torch.tensor(pars)
            for node, ctx in q_rows.items():
                if node < width:
                    q[r, node] = q_of(ctx)
            ctxs = [outputs[i]]
            for x, par in zip(toks, pars, strict=True):
                ctxs.append((*ctxs[par], x))
            first.append(len(p_rows))
            p_rows.extend(p_of(c) for c in ctxs)
        topo = Topology.of(parents, counts)
        draws = rrs_draws(depth, topk) if sampled else walk_draws(depth)
        u = torch.rand(b, draws)
        verdict = verify_tree(
            tokens,
            topo,
            torch.stack(p_rows),
            torch.tensor(first),
            u,
            q=q if sampled else None,
            rrs=torch.full((b,), sampled),
            topk=topk,
        )
        emitted = verdict.token_ids.tolist()
        for r, i in enumerate(todo):
            n = int(verdict.num_accepted[r]) + 1
            outputs[i] = (*outputs[i], *emitted[r][:n])[:LENGTH]
    return outputs


def assert_exact(samples: list[tuple[int, ...]]) -> None:
    law = exact_law()
    keys = sorted(law)
    counts = Counter(samples)
    res = chi_square_gof([counts.get(k, 0) for k in keys], [law[k] for k in keys])
    assert power(len(samples), res.dof, TV - res.pooled_mass, ALPHA) >= POWER
    assert res.p_value >= ALPHA, f"chi-square {res.statistic:.1f} on {res.dof} dof"


@pytest.mark.parametrize("sampled", [False, True], ids=["walk", "rrs"])
def test_tree_rounds_emit_the_targets_law(sampled: bool) -> None:
    assert_exact(run_trials(sampled, depth=2, topk=2, seed=1))


def test_a_deeper_narrow_and_a_wide_tree() -> None:
    assert_exact(run_trials(True, depth=3, topk=1, seed=2))  # a chain: THEORY.md's rule
    assert_exact(run_trials(True, depth=1, topk=4, seed=3))


def test_a_sibling_left_out_of_the_residual_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Verifying the second child against q unchanged (as if the first had not been drawn)
    must be detected."""
    real = tree_verify._rrs_level

    def forgetful(p, q, kids, kid_tokens, u, level, topk):
        # draw every candidate against the original q: Q_{i+1} never drops x_i
        batch, width = kids.shape
        base = level * (topk + 1)
        done = torch.zeros(batch, dtype=torch.bool)
        chosen = torch.zeros(batch, dtype=torch.int64)
        for k in range(width):
            exists = (kids[:, k] >= 0) & ~done
            x = kid_tokens[:, k].clamp(min=0)[:, None]
            accept = exists & (u[:, base + k] * q.gather(1, x)[:, 0] < p.gather(1, x)[:, 0])
            chosen = torch.where(accept, kids[:, k], chosen)
            done |= accept
            residual = torch.clamp(p - q, min=0.0)
            mass = residual.sum(dim=1, keepdim=True)
            rej = (exists & ~accept)[:, None] & (mass > 0)
            p = torch.where(rej, residual / mass.clamp(min=1e-30), p)
        return chosen, done, tree_verify.sample(p, u[:, base + topk])

    assert real is not forgetful
    monkeypatch.setattr(tree_verify, "_rrs_level", forgetful)
    with pytest.raises(AssertionError, match="chi-square"):
        assert_exact(run_trials(True, depth=2, topk=2, seed=4))
