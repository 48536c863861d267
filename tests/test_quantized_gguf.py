"""Tiny GGUF files of every kept type (written by the ``gguf`` package) run with their matrices
kept quantized: greedy output equal to transformers reading the same file, and the law of
speculative sampling on a quantized target."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from specbatch import LLM, SamplingParams
from specbatch.kernels.cpu import cpu_kernels
from specbatch.testing.gguf_files import write_gguf
from tests.test_gguf import MAX_NEW, TEXTS, assert_greedy_equals_transformers, file_maker

pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="no CPU kernels here")

SHAPE = dict(hidden_size=256, intermediate_size=512)  # K-quants pack rows of 256 values
CASES: dict[str, tuple[str, dict[str, Any], str, dict[str, str]]] = {
    # name: (arch, checkpoint arguments, matrix type, per-tensor types)
    "q4_0": ("llama", SHAPE, "Q4_0", {}),
    "q4_1-tied": (
        "llama",
        {**SHAPE, "tie_word_embeddings": True},
        "Q4_1",
        {"token_embd.weight": "Q8_0"},
    ),
    "q8_0": ("llama", SHAPE, "Q8_0", {}),
    "q4_k-mixed": (
        "llama",
        SHAPE,
        "Q4_K",
        {
            "blk.0.attn_v.weight": "Q6_K",
            "blk.1.ffn_down.weight": "Q5_K",
            "blk.1.attn_k.weight": "Q4_1",
            "output.weight": "Q6_K",
        },
    ),
}


@pytest.fixture(scope="module")
def gguf_file(
    make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    return file_maker(CASES, make_checkpoint, tmp_path_factory)


def kept_types(llm: LLM) -> set[str]:
    model = llm.engine.executor.worker.target.model
    layers = [m for m in model.modules() if hasattr(m, "quant")]
    assert all(m.quant is not None for m in layers), "a matrix was dequantized"
    return {m.quant.types() for m in layers}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_output_equals_transformers_reading_the_same_file(
    gguf_file: Callable[[str], Path], case: str
) -> None:
    seen: list[set[str]] = []
    assert_greedy_equals_transformers(gguf_file(case), lambda llm: seen.append(kept_types(llm)))
    types = seen[0]
    if case == "q4_k-mixed":
        assert {"Q4_K+Q6_K", "Q4_K+Q4_1", "Q5_K", "Q6_K"} <= types


def test_verification_rows_equal_one_row_at_a_time(gguf_file: Callable[[str], Path]) -> None:
    """Greedy n-gram speculation (several rows a step) keeps plain decoding's tokens."""
    file = gguf_file("q4_1-tied")
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    texts = [t + " " + t for t in TEXTS]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    outs = {}
    for name, extra in (("plain", {}), ("ngram", {"speculative_config": spec})):
        with LLM(str(file), dtype="bfloat16", num_kv_blocks=64, max_model_len=128, **extra) as llm:
            outs[name] = [
                o.outputs[0].token_ids for o in llm.generate(texts, greedy, use_tqdm=False)
            ]
    assert outs["ngram"] == outs["plain"]


@torch.inference_mode()
def test_speculative_sampling_keeps_the_quantized_targets_law(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """14,000 samples of three tokens at temperature 1, a draft model proposing three, follow
    the joint law of the quantized file (transformers' logits on it, dequantized)."""
    from transformers import AutoModelForCausalLM

    from tests.helpers import exactness_target, make_perturbed_draft
    from tests.test_exactness import PROMPT, VOCAB, N, assert_matches

    hf_target = exactness_target(make_checkpoint, VOCAB)
    target = write_gguf(hf_target, tmp_path / "t.gguf", matrix_type="Q4_1", tokenizer=False)
    draft = make_perturbed_draft(hf_target, tmp_path / "draft", noise=0.25, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(
        str(target.parent), gguf_file=target.name, dtype=torch.float32
    ).eval()
    exact: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(3):
        seqs = list(exact)
        logits = hf(torch.tensor([PROMPT + list(s) for s in seqs])).logits[:, -1].double()
        probs = torch.softmax(logits, -1)
        exact = {(*s, t): exact[s] * float(p[t]) for s, p in zip(seqs, probs, strict=True)
                 for t in range(p.shape[0]) }  # fmt: skip
    llm = LLM(str(target), draft_model=str(draft), num_speculative_tokens=3, max_num_seqs=256,
              num_kv_blocks=512, block_size=4, seed=3, max_model_len=64,
              dtype="float32")  # fmt: skip
    assert kept_types(llm) == {"Q4_1"}
    params = [SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)] * N
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N, params, use_tqdm=False)
    spec = llm.engine.metrics.spec
    assert spec.proposed > 0 and 0.05 < spec.acceptance_rate < 0.98
    assert_matches([tuple(o.outputs[0].token_ids[:3]) for o in outs], exact)


def test_every_matrix_dequantized_when_asked(
    gguf_file: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECBATCH_GGUF_QUANTIZED", "0")
    with LLM(str(gguf_file("q4_k-mixed")), dtype="bfloat16", num_kv_blocks=32) as llm:
        model = llm.engine.executor.worker.target.model
        assert all(getattr(m, "quant", None) is None for m in model.modules())


@pytest.mark.parametrize("case", ["q4_1-tied", "q4_k-mixed"])
def test_tensor_parallel_ranks_keep_their_shares_of_the_blocks(
    gguf_file: Callable[[str], Path], case: str
) -> None:
    """Each rank of two multiplies its rows (column-parallel) or its columns (row-parallel,
    whole blocks, else dequantized): the ranks' outputs joined equal one rank's."""
    from specbatch.distributed.parallel_state import SINGLE, TensorParallelGroup
    from specbatch.model.loader import load_model

    file = gguf_file(case)
    ranks = [load_model(file, torch.float32, "cpu", TensorParallelGroup(r, 2)) for r in (0, 1)]
    whole = load_model(file, torch.float32, "cpu", SINGLE)
    layers = [dict(m.named_modules()) for m in (whole, *ranks)]
    torch.manual_seed(0)
    for name, layer in layers[0].items():
        if not hasattr(layer, "matmul"):  # the linear layers (not the LM head)
            continue
        parts = [lay[name] for lay in layers[1:]]
        k = parts[0].input_size_local if hasattr(parts[0], "input_size_local") else None
        x = torch.randn(3, layer.input_size)
        want = layer.matmul(x, None)
        if k is None:  # column-parallel: each rank its share of every fused part's features
            outs = [p.matmul(x, None).split(p.local_sizes, dim=1) for p in parts]
            got = torch.cat([o[i] for i in range(len(parts[0].local_sizes)) for o in outs], 1)
            assert all(p.quant is not None for p in parts), name
        else:  # row-parallel: each rank its input features, summed (a share that splits a
            # block, as 128 columns of a K-quant's 256-value blocks, is dequantized)
            block = 32 if case == "q4_1-tied" else 256
            assert all((p.quant is not None) == (k % block == 0) for p in parts), name
            got = sum(p.matmul(x[:, r * k : (r + 1) * k], None) for r, p in enumerate(parts))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
