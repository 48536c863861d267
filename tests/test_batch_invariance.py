"""Batch invariance: with ``batch_invariant=True`` a seeded request returns the same tokens alone
or inside any batch, with and without speculation, also when the KV pool is so small that
requests wait and are preempted. The model's logits for a sequence are bit-identical alone and
in a ragged batch on the kernel path, and (the check can fail) not on torch's own path."""

from __future__ import annotations

import random

import pytest
import torch

from specbatch import LLM, InvalidInputError, SamplingParams
from specbatch.kernels.cpu import cpu_kernels
from specbatch.model.layers.attention import AttentionMetadata, TorchAttentionBackend
from specbatch.model.loader import load_model

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels do not build here")

N_REQUESTS = 64


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    from specbatch.bench.workload import heldout_token_stream
    from specbatch.model.model_pair import default_model_path
    from specbatch.tokenizer import load_tokenizer

    stream, _ = heldout_token_stream(load_tokenizer(default_model_path("target")))
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randrange(4, 40)
        start = rng.randrange(len(stream) - length)
        out.append(stream[start : start + length])
    return out


def seeded(n: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=1.0, top_p=0.95, seed=1000 + i, max_tokens=24, ignore_eos=True)
        for i in range(n)
    ]


def generate(llm: LLM, batch: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks, "leaked KV blocks"
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("k", [0, 3])
def test_seeded_requests_alone_equal_inside_one_batch(k: int) -> None:
    batch, params = prompts(N_REQUESTS), seeded(N_REQUESTS)
    llm = LLM(num_speculative_tokens=k, batch_invariant=True, max_model_len=128)
    together = generate(llm, batch, params)
    alone = [generate(llm, [p], [sp])[0] for p, sp in zip(batch, params)]
    differ = [i for i, (a, b) in enumerate(zip(alone, together)) if a != b]
    assert not differ, f"requests {differ} differ alone and in the batch"
    if k:
        assert llm.engine.metrics.spec.proposed > 0


def test_seeded_requests_under_kv_pressure_equal_alone() -> None:
    """A pool of 24 blocks of 16 slots for 64 requests of up to 66 tokens: requests wait and
    are preempted (recompute); none of that changes a seeded request's tokens."""
    batch, params = prompts(N_REQUESTS, seed=1), seeded(N_REQUESTS)
    small = LLM(num_speculative_tokens=3, batch_invariant=True, max_model_len=128, num_kv_blocks=24)
    together = generate(small, batch, params)
    assert small.engine.metrics.num_preemptions > 0
    roomy = LLM(num_speculative_tokens=3, batch_invariant=True, max_model_len=128)
    alone = [generate(roomy, [p], [sp])[0] for p, sp in zip(batch[:16], params[:16])]
    assert alone == together[:16]


def test_batch_invariant_refuses_what_it_cannot_keep() -> None:
    with pytest.raises(InvalidInputError, match="batch_invariant needs a fixed"):
        LLM(num_speculative_tokens="auto", batch_invariant=True)
    with pytest.raises(InvalidInputError, match="batch_invariant needs attention_backend 'cpu'"):
        LLM(batch_invariant=True, attention_backend="torch")


# --- the model's logits -------------------------------------------------------------------


def ragged_logits(model, seqs: list[torch.Tensor]) -> torch.Tensor:
    """Last-position logits of each sequence, all prefilled in one ragged forward."""
    block = 16
    tables, nxt = [], 0
    for s in seqs:
        n = -(-len(s) // block)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    caches = model.allocate_kv_caches(nxt, block)
    lens = [len(s) for s in seqs]
    meta = AttentionMetadata.from_lists(lens, lens, tables, block)
    positions = torch.cat([torch.arange(n) for n in lens])
    hidden = model(torch.cat(seqs), positions, caches, meta)
    last = torch.tensor([sum(lens[: i + 1]) - 1 for i in range(len(lens))])
    return model.compute_logits(hidden[last])


def logits_alone_and_batched(model) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, model.vocab_size, (n,), generator=gen) for n in (1, 9, 33, 70, 5)]
    batched = ragged_logits(model, seqs)
    alone = torch.cat([ragged_logits(model, [s]) for s in seqs])
    return alone, batched


def test_logits_are_bit_identical_alone_and_batched_on_the_kernel_path(make_checkpoint) -> None:
    model = load_model(make_checkpoint("qwen3", head_dim=32), torch.float32, "cpu")
    alone, batched = logits_alone_and_batched(model)
    assert torch.equal(alone, batched)


def test_the_check_fails_on_torchs_own_path(make_checkpoint) -> None:
    """torch's float32 matrix multiply sums a 1-row product in another order than a many-row
    one, so the same comparison finds differences there."""
    model = load_model(
        make_checkpoint("qwen3", head_dim=32, hidden_size=256, intermediate_size=512),
        torch.float32, "cpu", attention_backend=TorchAttentionBackend(), use_cpu_kernels=False,
    )  # fmt: skip
    alone, batched = logits_alone_and_batched(model)
    assert not torch.equal(alone, batched)
