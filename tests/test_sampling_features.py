"""logprobs, prompt_logprobs, repetition_penalty, min_tokens and n > 1, checked against
transformers on the same float32 weights, with and without speculation (a draft model,
n-gram lookup). The distributions under penalties are tested in test_exactness.py."""

from __future__ import annotations

import random

import pytest
import torch

from specbatch import LLM, SamplingParams
from specbatch.testing.eagle_heads import make_eagle_head
from tests.helpers import hf_model, make_perturbed_draft, reference_penalties

TOL = 1e-4  # float32 logprobs against transformers' log-softmax
MAX_NEW = 12


@pytest.fixture(scope="module")
def pair(make_checkpoint, tmp_path_factory):
    target = make_checkpoint("llama", max_position_embeddings=128)
    draft = make_perturbed_draft(target, tmp_path_factory.mktemp("draft"), noise=0.2, seed=3)
    head = make_eagle_head(tmp_path_factory.mktemp("eagle3"), target, "eagle3", seed=3)
    return target, draft, head


@pytest.fixture(scope="module")
def reference(pair):
    return hf_model(pair[0])


SPECULATION = {
    "plain": None,
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    "eagle3": {"method": "eagle3", "num_speculative_tokens": 3},
    "draft_tree": {"method": "draft_model", "num_speculative_tokens": 3, "topk": 2,
                   "num_draft_tokens": 5},
    "eagle3_tree": {"method": "eagle3", "num_speculative_tokens": 3, "topk": 2,
                    "num_draft_tokens": 5},
}  # fmt: skip


def engine(pair, method: str, **kw) -> LLM:
    target, draft, head = pair
    spec = SPECULATION[method]
    if spec is not None and spec["method"] in ("draft_model", "eagle3"):
        spec = {**spec, "model": str(draft if spec["method"] == "draft_model" else head)}
    args = dict(num_kv_blocks=256, block_size=4, max_model_len=128, seed=0)
    args.update(kw)
    return LLM(str(target), speculative_config=spec, **args)


def prompts(n: int = 4, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # repeated stretches give the n-gram drafter something to find
    out = []
    for _ in range(n):
        piece = [rng.randrange(3, 256) for _ in range(rng.randint(3, 8))]
        out.append((piece * 4)[: rng.randint(8, 30)])
    return out


@torch.inference_mode()
def target_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of ``tokens`` [len, V]."""
    return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def by_rank(entry):
    return [t for t, _ in sorted(entry.items(), key=lambda kv: kv[1].rank)]


@pytest.mark.parametrize("method", list(SPECULATION))
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_targets_at_every_emitted_token(pair, reference, method, temperature):
    llm = engine(pair, method)
    ps = prompts()
    params = SamplingParams(
        temperature=temperature,
        max_tokens=MAX_NEW,
        ignore_eos=True,
        logprobs=5,
        prompt_logprobs=3,
        seed=11,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    if method in ("draft_model", "draft_tree") or (method == "ngram" and temperature == 0.0):
        assert llm.engine.metrics.spec.accepted > 0  # drafts were accepted, not just proposed
    for p, out in zip(ps, outs):
        c = out.outputs[0]
        ref = target_logprobs(reference, p + c.token_ids)
        assert len(c.logprobs) == len(c.token_ids) == MAX_NEW
        for i, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[len(p) - 1 + i]
            assert abs(entry[tok].logprob - row[tok].item()) < TOL
            better = int((row > row[tok] + TOL).sum()), int((row > row[tok] - TOL).sum())
            assert better[0] + 1 <= entry[tok].rank <= better[1] + 1
            top = by_rank(entry)[:5]
            assert all(abs(entry[t].logprob - row[t].item()) < TOL for t in top)
            assert row[top].min() >= row.topk(5).values[-1] - TOL  # they are the top 5
            if temperature == 0.0:
                assert tok == top[0]
        assert c.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for e, t in zip(c.logprobs, c.token_ids))
        )
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
        for j in range(1, len(p)):
            assert abs(out.prompt_logprobs[j][p[j]].logprob - ref[j - 1, p[j]].item()) < TOL
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks


def test_prompt_logprobs_of_a_chunked_and_preempted_prompt(pair, reference):
    """A prompt read in chunks, then recomputed after preemption: each position once."""
    llm = engine(pair, "draft_model", max_num_batched_tokens=8, num_kv_blocks=24, max_model_len=64)
    ps = [list(range(3, 43)), list(range(50, 90)), list(range(100, 140))]
    params = SamplingParams(max_tokens=20, ignore_eos=True, prompt_logprobs=0, seed=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    assert llm.engine.metrics.num_preemptions > 0
    for p, out in zip(ps, outs):
        ref = target_logprobs(reference, p)
        assert len(out.prompt_logprobs) == len(p)
        for j in range(1, len(p)):
            assert abs(out.prompt_logprobs[j][p[j]].logprob - ref[j - 1, p[j]].item()) < TOL
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks


def test_processed_logprobs_are_those_of_the_distribution_sampled_from(pair, reference):
    llm = engine(pair, "draft_model", logprobs_mode="processed_logprobs")
    p = prompts(1)[0]
    params = SamplingParams(
        temperature=0.7, top_k=8, presence_penalty=0.5, max_tokens=MAX_NEW, logprobs=2, seed=2
    )
    c = llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0]
    with torch.inference_mode():
        logits = reference(torch.tensor([p + c.token_ids])).logits[0].float()
    for i, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        row = reference_penalties(logits[len(p) - 1 + i], p, c.token_ids[:i], presence=0.5) / 0.7
        kept = row.topk(8).indices
        masked = torch.full_like(row, float("-inf")).scatter(0, kept, row[kept])
        assert abs(entry[tok].logprob - torch.log_softmax(masked, -1)[tok].item()) < TOL


@torch.inference_mode()
def hf_greedy_penalised(path, prompt: list[int], penalty: float) -> list[int]:
    model = hf_model(path)
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=MAX_NEW * 2,
        min_new_tokens=MAX_NEW * 2,
        do_sample=False,
        repetition_penalty=penalty,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("method", list(SPECULATION))
def test_greedy_with_repetition_penalty_is_transformers_generate(pair, method):
    llm = engine(pair, method)
    ps = prompts(3, seed=4)
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW * 2, ignore_eos=True, repetition_penalty=1.4
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    for p, out in zip(ps, outs):
        assert out.outputs[0].token_ids == hf_greedy_penalised(pair[0], p, 1.4)
    plain = llm.generate(
        [{"prompt_token_ids": p} for p in ps],
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW * 2, ignore_eos=True),
        use_tqdm=False,
    )
    assert any(a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(outs, plain))


@pytest.mark.parametrize("method", ["plain", "draft_model"])
def test_min_tokens_holds_back_the_stop_token(pair, method):
    llm = engine(pair, method)
    p = prompts(1, seed=5)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": p}, greedy, use_tqdm=False)[0].outputs[0]
    stop = first.token_ids[0]  # greedy's first choice, made a stop token
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW, min_tokens=4, stop_token_ids=[stop], ignore_eos=True
    )
    c = llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) >= 4 and stop not in c.token_ids[:4]
    assert c.token_ids[-1] == stop or len(c.token_ids) == MAX_NEW


@pytest.mark.parametrize("method", ["plain", "draft_model"])
def test_min_tokens_holds_back_eos(pair, make_checkpoint, method):
    """The same weights with greedy's first token made EOS: without min_tokens the request
    ends on it at once; with min_tokens 4 it is masked for four tokens."""
    p = prompts(1, seed=7)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    llm = engine(pair, method)
    eos = llm.generate({"prompt_token_ids": p}, greedy, use_tqdm=False)[0].outputs[0].token_ids[0]
    target = make_checkpoint("llama", max_position_embeddings=128, eos_token_id=eos)
    llm = engine((target, *pair[1:]), method)
    stop_now = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    c = llm.generate({"prompt_token_ids": p}, stop_now, use_tqdm=False)[0].outputs[0]
    assert c.token_ids == [eos] and c.finish_reason == "stop"
    held = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=4)
    c = llm.generate({"prompt_token_ids": p}, held, use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) >= 4 and eos not in c.token_ids[:4]
    assert c.token_ids[-1] == eos or len(c.token_ids) == MAX_NEW
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks


@pytest.mark.parametrize("method", list(SPECULATION))
def test_n_completions_share_the_prompt_blocks_and_give_them_back(pair, method):
    llm = engine(pair, method)
    e = llm.engine
    p = prompts(1, seed=6)[0] + list(range(3, 25))  # 34 tokens: full blocks of 4 and a part
    params = SamplingParams(temperature=1.0, max_tokens=MAX_NEW, ignore_eos=True, n=4, seed=8)
    e.add_request({"prompt_token_ids": p}, params, request_id="r")
    shared = 0
    while e.has_unfinished_requests():
        outs = e.step()
        shared = max(shared, max(e.kv_cache.pool._ref_counts))
        if outs and outs[0].finished:
            final = outs[0]
    assert shared == 4  # the prompt's full blocks had all four completions as owners
    assert [c.index for c in final.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in final.outputs}) == 4
    assert e.num_free_kv_blocks == e.num_kv_blocks
    # seeded: the same request again gives the same completions; n = 1 gives the first
    again = llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in final.outputs]
    one = SamplingParams(temperature=1.0, max_tokens=MAX_NEW, ignore_eos=True, seed=8)
    single = llm.generate({"prompt_token_ids": p}, one, use_tqdm=False)[0]
    assert single.outputs[0].token_ids == final.outputs[0].token_ids


def test_n_completions_aborted_or_preempted_leak_nothing(pair):
    llm = engine(pair, "draft_model", num_kv_blocks=40, max_num_seqs=16)
    e = llm.engine
    p = list(range(3, 35))
    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, n=6, seed=1)
    for rid in ("a", "b"):
        e.add_request({"prompt_token_ids": p}, params, request_id=rid)
    for _ in range(6):
        e.step()
    e.abort_request("a")
    while e.has_unfinished_requests():
        outs = e.step()
    assert e.metrics.num_preemptions > 0
    assert outs[0].request_id == "b" and len(outs[0].outputs) == 6
    assert all(len(c.token_ids) == 40 for c in outs[0].outputs)
    assert e.num_free_kv_blocks == e.num_kv_blocks
    # an abort before any completion forked
    e.add_request({"prompt_token_ids": p}, params, request_id="c")
    e.abort_request(["c"])
    assert not e.has_unfinished_requests() and e.num_free_kv_blocks == e.num_kv_blocks
