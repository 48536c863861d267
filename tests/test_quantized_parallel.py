"""A GGUF file kept quantized across Ray workers: tensor-parallel ranks multiplying their shares
of the blocks, and data-parallel replicas each loading the file, give transformers' greedy output
on the same file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from specbatch import LLM, SamplingParams
from specbatch.kernels.cpu import cpu_kernels
from specbatch.testing.gguf_files import write_gguf
from tests.family_checks import ray_cluster  # noqa: F401
from tests.test_gguf import MAX_NEW, TEXTS, transformers_greedy

pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="no CPU kernels here")


@pytest.fixture(scope="module")
def q4_1_file(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory):
    hf_dir = make_checkpoint("llama", with_tokenizer=True, hidden_size=256, intermediate_size=512)
    out = tmp_path_factory.mktemp("gguf") / "q4_1.gguf"
    return write_gguf(hf_dir, out, matrix_type="Q4_1", types={"token_embd.weight": "Q8_0"})


@pytest.mark.xdist_group("ray")
@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "data_parallel_size"])
def test_parallel_engines_on_kept_blocks_equal_transformers(
    q4_1_file: Path,
    ray_cluster: None,  # noqa: F811
    parallel: str,
) -> None:
    want_prompts, want = transformers_greedy(q4_1_file, TEXTS)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    kwargs = {parallel: 2, "dtype": "float32", "num_kv_blocks": 32, "max_model_len": 128}
    with LLM(str(q4_1_file), **kwargs) as llm:
        outs = llm.generate(TEXTS, greedy, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == want_prompts
    assert [o.outputs[0].token_ids for o in outs] == want
