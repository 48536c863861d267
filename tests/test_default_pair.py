"""The built-in target/draft pair ships with the package and runs with no --model."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest

from specbatch import LLM, EngineArgs, SamplingParams
from specbatch.entrypoints.cli import main
from specbatch.model.eagle import detect_layout
from specbatch.model.model_pair import default_model_path
from specbatch.speculative_config import SpeculativeConfig
from specbatch.tokenizer import load_tokenizer
from tests.helpers import assert_full_vocab_head_has_no_d2t, hf_greedy

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def uuid5(namespace, name):", "class Future:", "import os"]


def test_pair_is_small_and_shares_a_tokenizer():
    target, draft = Path(default_model_path("target")), Path(default_model_path("draft"))
    pair = sum(f.stat().st_size for d in (target, draft) for f in d.iterdir())
    assert pair <= 32 * 2**20
    everything = sum(f.stat().st_size for f in target.parent.rglob("*") if f.is_file())
    assert everything <= 35 * 2**20  # the EAGLE head and the training records too
    assert (target / "tokenizer.json").read_bytes() == (draft / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("spec", [None, {"method": "eagle"}, {"method": "eagle3"}])
def test_the_builtin_target_drafts_with_its_eagle3_head(spec):
    """Without a model, either EAGLE method name picks the head shipped with the target."""
    config = EngineArgs(speculative_config=spec).create_engine_config()
    resolved = config.speculative_config
    assert resolved.method == "eagle" and resolved.auto  # auto by default
    assert resolved.depth == SpeculativeConfig.max_draft_length
    fixed = EngineArgs(speculative_config=spec, batch_invariant=True).create_engine_config()
    assert not fixed.speculative_config.auto and fixed.speculative_config.depth == 3
    assert config.draft is not None and config.draft.path == default_model_path("eagle")
    assert detect_layout(config.draft.path) == "eagle3"
    assert_full_vocab_head_has_no_d2t(Path(config.draft.path))
    draft = EngineArgs(speculative_config={"method": "draft_model"}).create_engine_config().draft
    assert draft is not None and draft.path == default_model_path("draft")


def test_specbatch_greedy_equals_transformers_on_the_shipped_weights():
    # The built-in pair, speculating, in float32 as transformers runs it: in bfloat16 the two
    # round differently and a near-tie may go either way.
    llm = LLM(max_model_len=256, dtype="float32")
    assert llm.engine.config.speculative_config.speculative
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    expected = hf_greedy(default_model_path("target"), ids, 24)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
    # the models, made before the first step, are left out of every later garbage collection
    model = llm.engine.executor.worker.target.model
    assert not any(o is model for o in gc.get_objects())


def test_the_shipped_head_predicts_the_shipped_target():
    """A real pair: greedy on the example prompts, three drafts every round (``auto`` drafts as
    the machine's timing decides, and a run where it chose few drafts would read alpha from a
    handful), the head's drafts pass more often than not."""
    llm = LLM(max_model_len=256, dtype="float32", num_speculative_tokens=3)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm.generate([{"prompt_token_ids": tok.encode(p)} for p in PROMPTS], params, use_tqdm=False)
    spec = llm.engine.metrics.spec
    assert spec.proposed >= 3 * 3 * 6  # every request drafted three a round
    assert spec.alpha > 0.5


def test_generate_without_model_on_the_example_prompts(tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    prompts = ROOT / "examples" / "prompts.txt"
    rc = main(
        [
            "generate",
            "--prompts",
            str(prompts),
            "--output",
            str(out),
            "--max-tokens",
            "8",
            "--no-progress",
        ]
    )
    assert rc == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    n = sum(1 for x in prompts.read_text().splitlines() if x.strip())
    assert sorted(r["index"] for r in lines) == list(range(n))
    tok = load_tokenizer(default_model_path("target"))
    for r in lines:  # --max-tokens 8: eight tokens, or fewer ending at EOS
        ids = r["token_ids"]
        assert r["num_output_tokens"] == len(ids)
        if r["finish_reason"] == "length":
            assert len(ids) == 8
        else:
            assert r["finish_reason"] == "stop" and len(ids) < 8 and ids[-1] == tok.eos_token_id
        assert r["text"] == tok.decode(ids, skip_special_tokens=True)
