"""Self-speculation over a sparse view of the target's KV cache (``method: self_sparse``).

The view's attention against a reference that reads every visible key position by position;
whole outputs distributed as the target's (chi-square as in tests/test_exactness.py: false alarm
1e-3 a test, power against a total-variation error of 0.03 checked) with prompts longer than the
window, so the drafter's view differs from the target's; greedy output equal to transformers';
the draft passes touching no slot of the target's cache outside each round's lookahead; no KV
block spent on drafting.
"""

from __future__ import annotations

import pytest
import torch

from specbatch import LLM, SamplingParams
from specbatch.errors import InvalidInputError
from specbatch.model.layers.attention import TorchAttentionBackend
from specbatch.model.layers.cpu_attention import CpuAttentionBackend
from specbatch.worker.sparse_view import sparse_view
from tests.helpers import (
    exact_joint,
    exactness_target,
    greedy_token_ids,
    hf_greedy,
    random_paged_batch,
)
from tests.test_cpu_attention import to_cpu_layout
from tests.test_exactness import ALPHA, assert_matches

SINKS, WINDOW, BS = 4, 8, 4
SPARSE = {"method": "self_sparse", "sinks": SINKS, "window": WINDOW}
TREE = {"num_speculative_tokens": 3, "topk": 2, "num_draft_tokens": 5}
N = 16_000
# 26 tokens: past the 4 sinks and the 8-token window, so every draft pass leaves keys out
PROMPT = [1, 2, 0, 0, 2, 1, 1, 0, 2, 2, 0, 1, 2, 1, 0, 0, 1, 2, 2, 0, 1, 1, 2, 0, 2, 1]


def visible_keys(seq_len: int, q_len: int, i: int) -> list[int]:
    """The key positions query row ``i`` of a sequence sees through the view: causal, and in
    the sink blocks or from the window's first block on."""
    end = seq_len - q_len + i + 1
    sink_end = -(-SINKS // BS) * BS
    window_start = max(sink_end, (seq_len - WINDOW) // BS * BS)
    return [p for p in range(end) if p < sink_end or p >= window_start]


def reference(q, k_cache, v_cache, query_lens, seq_lens, tables, scale):
    bs, hkv, hq = k_cache.shape[1], k_cache.shape[2], q.shape[1]
    out = torch.empty_like(q)
    row = 0
    for q_len, s_len, table in zip(query_lens, seq_lens, tables, strict=True):
        for i in range(q_len):
            keys = visible_keys(s_len, q_len, i)
            kk = torch.stack([k_cache[table[p // bs], p % bs] for p in keys]).double()
            vv = torch.stack([v_cache[table[p // bs], p % bs] for p in keys]).double()
            for h in range(hq):
                w = torch.softmax(kk[:, h // (hq // hkv)] @ q[row + i, h].double() * scale, 0)
                out[row + i, h] = (w @ vv[:, h // (hq // hkv)]).to(q.dtype)
        row += q_len
    return out


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_the_view_attends_to_the_sinks_and_the_window_only(backend, kern):
    # decoding rows deep past the window, a chain's verification, a short context (no view)
    query_lens, seq_lens = [1, 4, 1, 1, 2], [41, 37, 9, 64, 13]
    q, k, v, k_cache, v_cache, meta, tables = random_paged_batch(
        query_lens, seq_lens, BS, 4, 2, 32, seed=3
    )
    scale = 32**-0.5
    view = sparse_view(meta, SINKS, WINDOW, BS)
    assert view.seq_lens_cpu == [13, 13, 9, 12, 13]  # 4 sinks + the window's whole blocks
    if backend == "torch":
        out = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, view, scale)
    else:
        kc, vc = to_cpu_layout(k_cache, v_cache)
        out = CpuAttentionBackend(kern).forward(q, k, v, kc, vc, view, scale)
    # the new rows' keys and values, as the forward wrote them
    for t, slot in enumerate(meta.slot_mapping.tolist()):
        k_cache[slot // BS, slot % BS], v_cache[slot // BS, slot % BS] = k[t], v[t]
    ref = reference(q, k_cache, v_cache, query_lens, seq_lens, tables, scale)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.fixture(scope="module")
def target(make_checkpoint):
    return exactness_target(make_checkpoint, 3)


def engine(target, seed: int = 0, backend: str = "auto", **spec) -> LLM:
    return LLM(str(target), speculative_config={**SPARSE, "num_speculative_tokens": 3, **spec},
               attention_backend=backend, max_num_seqs=256, num_kv_blocks=2048, block_size=BS,
               seed=seed)  # fmt: skip


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_sampling_past_the_window_is_the_targets_law(target, shape, temperature, top_p):
    llm = engine(target, seed=4, **(TREE if shape == "tree" else {}))
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N, params, use_tqdm=False)
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
    spec = llm.engine.metrics.spec
    assert spec.proposed > 0 and 0.05 < spec.acceptance_rate < 0.99  # the view is not the target
    samples = [tuple(o.outputs[0].token_ids[:3]) for o in outs]
    assert_matches(samples, exact_joint(target, PROMPT, 3, temperature, top_p))
    assert ALPHA == 1e-3


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_greedy_past_the_window_equals_transformers(make_checkpoint, backend, shape):
    """A model whose logits depend on the whole context: drafts from the view are often
    wrong, and the output is still the target's."""
    target = make_checkpoint("llama", seed=11, max_position_embeddings=256)
    prompts = [[(i * 7 + j * 3) % 256 for j in range(n)] for i, n in enumerate([60, 23, 90])]
    ref = hf_greedy(target, prompts, 30)
    spec = {**SPARSE, "num_speculative_tokens": 3, **(TREE if shape == "tree" else {})}
    llm = LLM(str(target), speculative_config=spec, attention_backend=backend,
              num_kv_blocks=128, block_size=BS, max_model_len=256)  # fmt: skip
    assert greedy_token_ids(llm, prompts, 30) == ref
    assert llm.engine.metrics.spec.proposed > 0


def slot_rows(runner) -> torch.Tensor:
    """Every slot's keys and values in every layer, a row a slot (the torch backend's
    ``[block, slot, head, d]`` layout)."""
    return torch.cat(
        [c.reshape(c.shape[0] * c.shape[1], -1) for pair in runner.kv_caches for c in pair], 1
    )


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_draft_passes_write_only_the_rounds_lookahead_slots(target, shape, monkeypatch):
    llm = engine(target, backend="torch", **(TREE if shape == "tree" else {}))
    worker = llm.engine.executor.worker
    drafter, runner = worker.drafter, worker.target
    real = drafter.propose
    seen = {"rounds": 0, "written": 0}

    def propose(step):
        before = slot_rows(runner).clone()
        out = real(step)
        changed = set((slot_rows(runner) != before).any(dim=1).nonzero()[:, 0].tolist())
        allowed = set()
        for r in step.sampling:
            ahead = r.shape.lookahead if r.shape.nodes else 0
            for p in range(r.target_start, r.target_start + len(r.target_token_ids) + ahead):
                allowed.add(r.block_table[p // BS] * BS + p % BS)
        assert changed <= allowed, f"slots {sorted(changed - allowed)} outside the lookahead"
        seen["rounds"] += bool(changed)
        seen["written"] += len(changed)
        return out

    monkeypatch.setattr(drafter, "propose", propose)
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": PROMPT[: 10 + i]} for i in range(12)]
    llm.generate(prompts, params, use_tqdm=False)
    assert seen["rounds"] > 5 and seen["written"] > 20
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks


def test_no_kv_block_is_spent_on_drafting(target):
    memory = {"kv_cache_memory": 1 << 20, "block_size": BS}
    plain = LLM(str(target), **memory)
    sparse = LLM(str(target), speculative_config={**SPARSE, "num_speculative_tokens": 3}, **memory)
    assert sparse.engine.num_kv_blocks == plain.engine.num_kv_blocks
    assert sparse.engine.executor.worker.drafter.kv_bytes_per_block(BS) == 0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"window": 0}, "speculative_config.window"),
        ({"sinks": -1}, "speculative_config.sinks"),
        ({"model": "x"}, "speculative_config.model"),
        ({"method": "ngram", "sinks": 0}, "speculative_config.sinks: only self_sparse"),
        ({"method": "ngram", "window": 64}, "speculative_config.window: only self_sparse"),
    ],
)
def test_bad_sparse_settings_name_the_key(target, spec, message):
    with pytest.raises(InvalidInputError, match=message):
        LLM(str(target), speculative_config=spec if "method" in spec else {**SPARSE, **spec})


def test_long_requests_on_a_pool_that_holds_two_preempt_and_lose_nothing(make_checkpoint):
    target = make_checkpoint("llama", seed=11, max_position_embeddings=256)
    prompts = [[(i * 11 + j * 5) % 256 for j in range(90 + 4 * i)] for i in range(6)]
    ref = hf_greedy(target, prompts, 30)
    spec = {**SPARSE, "num_speculative_tokens": 3}
    # a request needs up to 34 blocks (124 + 30 tokens and the lookahead): two fit in 72
    llm = LLM(str(target), speculative_config=spec, num_kv_blocks=72, block_size=BS,
              max_model_len=160)  # fmt: skip
    assert greedy_token_ids(llm, prompts, 30) == ref
    assert llm.engine.scheduler.num_preemptions > 0
