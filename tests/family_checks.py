"""What the tests of a model family share: tiny random checkpoints built with transformers,
engines over them, transformers' logits (whole sequences, or one token at a time through its
cache), every drafter's speculative config, the chi-square law of whole outputs, and a local
Ray for tensor parallelism."""

from __future__ import annotations

import json
import math
import random
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from specbatch import LLM, SamplingParams
from tests.helpers import greedy_token_ids, hf_greedy
from tests.test_model import SCHEDULE, random_tokens, run_schedule

VOCAB, BS, MAX_NEW = 128, 4, 20
TREE = {"num_speculative_tokens": 3, "topk": 2, "num_draft_tokens": 5}
DRAFTERS: dict[str, Callable[[Path], dict[str, Any] | None]] = {
    "plain": lambda draft: None,
    "ngram": lambda draft: {"method": "ngram", "num_speculative_tokens": 3,
                            "prompt_lookup_min": 1},
    "draft": lambda draft: {"model": str(draft), "num_speculative_tokens": 3},
    "draft-tree": lambda draft: {"model": str(draft), **TREE},
    "self_sparse": lambda draft: {"method": "self_sparse", "num_speculative_tokens": 3,
                                  "sinks": 4, "window": 12},
}  # fmt: skip


def save_random(config: Any, out: Path, seed: int, qk_scale: float = 2.0) -> Path:
    """A transformers model of ``config`` with weights scaled so that its outputs are neither
    uniform nor one-hot (fan-in scaling, norms around 1, queries and keys ``qk_scale`` times
    larger), saved to ``out``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(0.25 * torch.randn_like(p))
            elif "lm_head" in name:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
            elif any(part in name for part in ("q_proj", "k_proj", "qkv_proj")):
                p.copy_(torch.randn_like(p) * qk_scale / math.sqrt(p.shape[-1]))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    model.save_pretrained(out)
    return out


def prompts(n: int = 4, seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(k)] for k in (5, 13, 22, 31)[:n]]


def engine(path: Path, spec: dict[str, Any] | None = None, **kw: Any) -> LLM:
    kw = {"dtype": "float32", "num_kv_blocks": 256, "block_size": BS, "max_model_len": 128,
          "seed": 0, **kw}  # fmt: skip
    return LLM(str(path), speculative_config=spec, **kw)


def _hf(path: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager"
    ).eval()


@torch.inference_mode()
def hf_logits(path: Path, tokens: list[torch.Tensor], dtype: torch.dtype = torch.float32):
    """transformers' logits of each whole sequence in one forward."""
    hf = _hf(path, dtype)
    return [hf(t[None]).logits[0].float() for t in tokens]


@torch.inference_mode()
def hf_stepwise_logits(path: Path, tokens: list[torch.Tensor], dtype: torch.dtype = torch.float32):
    """transformers' logits of each sequence fed one token at a time through its own cache
    (as its ``generate`` decodes)."""
    from transformers import DynamicCache

    hf = _hf(path, dtype)
    out = []
    for t in tokens:
        cache, rows = DynamicCache(config=hf.config), []
        for i in range(len(t)):
            rows.append(hf(t[None, i : i + 1], cache=cache, use_cache=True).logits[0, 0])
        out.append(torch.stack(rows).float())
    return out


def schedule_logits(
    model: Any, vocab: int = VOCAB
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Random sequences fed through the paged cache by ``tests/test_model.py``'s schedule
    (ragged prefills, chunks, decodes, rolled-back speculation), and their logits."""
    lengths = [sum(step[b] for step in SCHEDULE) for b in range(len(SCHEDULE[0]))]
    tokens = random_tokens(lengths, vocab)
    return tokens, run_schedule(model, tokens, SCHEDULE)


def assert_each_close(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    """Each sequence's logits within 1e-4 of the reference, and its logprobs too."""
    for b, (o, r) in enumerate(zip(ours, ref, strict=True)):
        assert o.shape == r.shape
        torch.testing.assert_close(o, r, atol=1e-4, rtol=1e-4, msg=lambda m, b=b: f"{b}: {m}")
        diff = (o.log_softmax(-1) - r.log_softmax(-1)).abs().max()
        assert diff < 1e-4, f"seq {b}: logprobs differ by {diff}"


def assert_logits_close(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    """Logits within 1e-4 of the reference and logprobs too; the reference neither uniform
    nor one-hot."""
    assert_each_close(ours, ref)
    top = torch.cat(ref).softmax(-1).max(-1).values.mean()
    assert 0.05 < top < 0.95, top


def worst_logprob_gap(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max(
        float((o.log_softmax(-1) - r.log_softmax(-1)).abs().max()) for o, r in zip(ours, ref)
    )


def assert_logprobs_match(llm: LLM, path: Path, batch: list[list[int]], stepwise: bool) -> None:
    """The engine's top-5 logprobs of its greedy outputs within 1e-4 of transformers'."""
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    seqs = [torch.tensor(p + list(o.outputs[0].token_ids)) for p, o in zip(batch, outs)]
    ref = (hf_stepwise_logits if stepwise else hf_logits)(path, seqs)
    for p, o, r in zip(batch, outs, ref, strict=True):
        lps = r.log_softmax(-1)
        c = o.outputs[0]
        for i, (tok, entries) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            row = lps[len(p) - 1 + i]
            assert tok == int(row.argmax())
            for t, lp in entries.items():
                assert abs(lp.logprob - float(row[t])) < 1e-4, (i, t)


def with_config(src: Path, out: Path, **changes: Any) -> Path:
    """A copy of the checkpoint at ``src`` with its config.json's fields changed."""
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


def chi_square_law(target: Path, draft: Path, gamma: int = 3) -> None:
    """The first three tokens of 14,000 samples at temperature 1, a draft model proposing
    ``gamma``, follow the target's exact joint (``tests/test_exactness.py``'s test)."""
    from tests.helpers import exact_joint
    from tests.test_exactness import PROMPT, N, assert_matches

    llm = LLM(str(target), draft_model=str(draft), num_speculative_tokens=gamma,
              max_num_seqs=256, num_kv_blocks=512, block_size=4, seed=gamma,
              max_model_len=64, dtype="float32")  # fmt: skip
    params = [SamplingParams(temperature=1.0, max_tokens=gamma + 2, ignore_eos=True)] * N
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N, params, use_tqdm=False)
    samples = [tuple(o.outputs[0].token_ids[:3]) for o in outs]
    spec = llm.engine.metrics.spec
    assert spec.proposed > 0 and 0.05 < spec.acceptance_rate < 0.98
    assert_matches(samples, exact_joint(target, PROMPT, 3))


# ---- test bodies every family runs ---------------------------------------------------------


def hf_greedy_outputs(models: dict[str, Path], archs: Iterable[str]) -> dict[str, list[list[int]]]:
    """transformers' greedy outputs of ``prompts()`` for each of ``archs`` (a module's
    ``hf_outputs`` fixture)."""
    return {arch: hf_greedy(models[arch], prompts(), MAX_NEW) for arch in archs}


def check_bfloat16_rounding(path: Path) -> None:
    """Against float32, specbatch's bfloat16 logits err no more than transformers' own, and
    an engine in bfloat16 runs."""
    from specbatch.model.loader import load_model

    model = load_model(path, torch.bfloat16, "cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    tokens, ours = schedule_logits(model)
    exact, theirs = hf_logits(path, tokens), hf_logits(path, tokens, torch.bfloat16)

    def err(a: list[torch.Tensor]) -> float:
        return max(float((x - r).abs().max()) for x, r in zip(a, exact, strict=True))

    assert 0 < err(ours) <= 1.25 * err(theirs)
    with engine(path, dtype="bfloat16") as llm:
        outs = greedy_token_ids(llm, prompts(2), 8)
    assert [len(o) for o in outs] == [8, 8]


def check_logprobs(models: dict[str, Path], arch: str) -> None:
    """A target verifying its draft model's chains gives transformers' logprobs."""
    with engine(models[arch], DRAFTERS["draft"](models[f"{arch}-draft"])) as llm:
        assert_logprobs_match(llm, models[arch], prompts(), stepwise=False)


def check_greedy(models: dict[str, Path], want: list[list[int]], arch: str, drafter: str) -> None:
    """Greedy output equal to ``want`` (transformers'), ``drafter`` proposing (its draft model
    ``{arch}-draft``)."""
    with engine(models[arch], DRAFTERS[drafter](models[f"{arch}-draft"])) as llm:
        assert greedy_token_ids(llm, prompts(), MAX_NEW) == want
        if drafter != "plain":
            assert llm.engine.metrics.spec.proposed > 0


def check_eagle_head(target: Path, want: list[list[int]], layout: str) -> None:
    """A random EAGLE-1 or EAGLE-3 head on ``target`` leaves its greedy output ``want``."""
    from specbatch.testing.eagle_heads import make_eagle_head

    head = make_eagle_head(target.parent / f"head-{layout}", target, layout, seed=5,
                           with_embedding=layout == "eagle")  # fmt: skip
    spec = {"method": layout, "model": str(head), "num_speculative_tokens": 3}
    with engine(target, spec) as llm:
        assert greedy_token_ids(llm, prompts(), MAX_NEW) == want
        assert llm.engine.metrics.spec.proposed > 0


def check_tensor_parallel_2(
    models: dict[str, Path],
    hf_outputs: dict[str, list[list[int]]],
    cases: Iterable[tuple[str, str]],
    proposed: bool = True,
) -> None:
    """Greedy output at tensor parallelism 2 equal to transformers' for each ``(arch,
    drafter)`` of ``cases`` (``proposed``: and the drafter proposed tokens)."""
    for arch, drafter in cases:
        spec = DRAFTERS[drafter](models[f"{arch}-draft"])
        with engine(models[arch], spec, tensor_parallel_size=2) as llm:
            assert greedy_token_ids(llm, prompts(), MAX_NEW) == hf_outputs[arch], arch
            if proposed:
                assert llm.engine.metrics.spec.proposed > 0


def assert_same_parameters(got: Any, want: Any) -> None:
    """The same parameter names, and each parameter equal bit for bit."""
    params = dict(got.named_parameters())
    assert params.keys() == dict(want.named_parameters()).keys()
    for name, p in want.named_parameters():
        assert torch.equal(params[name], p), name


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A local Ray for a module's tensor-parallel test (as tests/test_ray_tp.py starts it)."""
    import os

    ray = pytest.importorskip("ray")
    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False,
                 object_store_memory=256 << 20, logging_level="WARNING",
                 _node_ip_address="127.0.0.1")  # fmt: skip
    yield
    if started:
        ray.shutdown()


def assert_cli_and_server_run(model: Path, make_checkpoint: Any, tmp_path: Path) -> None:
    """``specbatch generate --model`` and the server's completions on a copy of ``model`` with
    a tokenizer (a tiny BPE of its vocabulary size) answer what ``LLM`` does."""
    from fastapi.testclient import TestClient

    from specbatch.config import EngineArgs
    from specbatch.entrypoints.cli import main
    from specbatch.entrypoints.openai_server import build_app

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    src = make_checkpoint("llama", with_tokenizer=True, vocab_size=vocab)
    path = tmp_path / "with-tokenizer"
    shutil.copytree(model, path)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    with engine(path) as llm:
        params = SamplingParams(temperature=0, max_tokens=6)
        want = llm.generate(["hello world"], params, use_tqdm=False)[0].outputs[0].text
    prompts_file = tmp_path / "p.txt"
    prompts_file.write_text("hello world\n")
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(path), "--prompts", str(prompts_file), "--output",
            str(out), "--num-kv-blocks", "64", "--max-model-len", "64", "--max-tokens", "6",
            "--temperature", "0", "--no-progress", "--dtype", "float32"]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(out.read_text())["text"] == want
    app = build_app(EngineArgs(model=str(path), num_kv_blocks=64, max_model_len=64,
                               dtype="float32"))  # fmt: skip
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 6,
                                                 "temperature": 0})  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
