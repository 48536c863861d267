"""Phi-3 and Phi-4-mini against transformers, on tiny random checkpoints built with it.

"phi3" turns whole heads, "phi4" the first 0.75 of each (Phi-4-mini's partial rotary, tied
head); both scale their rotary by LongRoPE (original length 64, past every output of the
greedy tests, whose references are transformers' ``generate``). Where sequences cross
LongRoPE's switch (copies with it moved to 12) the reference is transformers' model fed one
token at a time through its cache, which chooses the factors position by position as specbatch
does (its ``generate`` instead recomputes the whole cache with the long factors when a sequence
first passes the switch; see ``model/phi3.py``). Checked: logits through the paged cache within
1e-4, bfloat16 no further from float32 than transformers' own; logprobs within 1e-4; greedy
output equal to transformers' plain, with every drafter and at tensor parallelism 2, and across
the switch; the chi-square law of whole outputs under speculation; GGUF files as llama.cpp
writes them; clear errors. Planted bugs (the rotary over the whole head, the long factors never
used, the attention factor dropped) move the logits off transformers'.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from specbatch.errors import InvalidInputError
from specbatch.model import phi3
from specbatch.model.loader import load_model
from tests import family_checks
from tests.family_checks import (
    DRAFTERS,
    MAX_NEW,
    VOCAB,
    assert_logits_close,
    assert_logprobs_match,
    chi_square_law,
    engine,
    hf_logits,
    hf_stepwise_logits,
    prompts,
    save_random,
    schedule_logits,
    with_config,
    worst_logprob_gap,
)
from tests.helpers import greedy_token_ids, hf_greedy, make_perturbed_draft

ray_cluster = family_checks.ray_cluster  # a fixture

ORIGINAL = 64  # LongRoPE's original length in the checkpoints
SWITCH = 12  # ... and in the copies whose paged-cache schedule crosses it


def phi3_config(
    *,
    layers: int = 3,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    partial: float = 1.0,
    longrope: bool = True,
    vocab: int = VOCAB,
    max_positions: int = 256,
    **kw: Any,
) -> Any:
    import transformers

    rot = int(hidden // heads * partial)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": partial}  # fmt: skip
    if longrope:
        rope.update(
            rope_type="longrope",
            short_factor=[1.0 + 0.05 * i for i in range(rot // 2)],
            long_factor=[1.0 + 1.5 * i for i in range(rot // 2)],
            original_max_position_embeddings=ORIGINAL,
        )
        kw["original_max_position_embeddings"] = ORIGINAL
    return transformers.Phi3Config(
        architectures=["Phi3ForCausalLM"], vocab_size=vocab, hidden_size=hidden,
        intermediate_size=96, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        partial_rotary_factor=partial, rope_parameters=rope,
        **{"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **kw},
    )  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("phi3")
    small = dict(layers=1, hidden=32, heads=2, kv_heads=1)
    return {
        "phi3": save_random(phi3_config(), root / "p3", seed=0),
        "phi4": save_random(phi3_config(partial=0.75, tie_word_embeddings=True), root / "p4",
                            seed=1),
        "phi3-draft": save_random(phi3_config(**small), root / "p3d", seed=2),
        "phi4-draft": save_random(phi3_config(partial=0.75, longrope=False, **small),
                                  root / "p4d", seed=3),
    }  # fmt: skip


def switched(path: Path, out: Path) -> Path:
    """The checkpoint with LongRoPE's original length moved to SWITCH."""
    import json

    rope = json.loads((path / "config.json").read_text())["rope_parameters"]
    rope["original_max_position_embeddings"] = SWITCH
    return with_config(path, out, rope_parameters=rope, original_max_position_embeddings=SWITCH)


# ---- logits and logprobs against transformers ----------------------------------------------


@pytest.mark.parametrize("arch", ["phi3", "phi4"])
def test_logits_through_the_paged_cache_equal_transformers(models, tmp_path, arch) -> None:
    path = switched(models[arch], tmp_path / "m")
    model = load_model(path, torch.float32, "cpu")
    assert type(model).__name__ == "Phi3ForCausalLM"
    assert model.model.rotary_emb.rotary_dim == (16 if arch == "phi3" else 12)
    tokens, ours = schedule_logits(model)
    assert max(len(t) for t in tokens) > SWITCH
    assert_logits_close(ours, hf_stepwise_logits(path, tokens))
    # below the switch a forward of the whole sequence is the same (the short factors)
    short = [t[:SWITCH] for t in tokens]
    assert_logits_close([o[:SWITCH] for o in ours], hf_logits(path, short))


@pytest.mark.parametrize("arch", ["phi3", "phi4"])
def test_bfloat16_rounds_no_worse_than_transformers_bfloat16(models, arch) -> None:
    model = load_model(models[arch], torch.bfloat16, "cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    tokens, ours = schedule_logits(model)
    exact = hf_logits(models[arch], tokens)
    theirs = hf_logits(models[arch], tokens, torch.bfloat16)

    def err(a: list[torch.Tensor]) -> float:
        return max(float((x - r).abs().max()) for x, r in zip(a, exact, strict=True))

    assert 0 < err(ours) <= 1.25 * err(theirs)
    with engine(models[arch], dtype="bfloat16") as llm:
        outs = greedy_token_ids(llm, prompts(2), 8)
    assert [len(o) for o in outs] == [8, 8]


@pytest.mark.parametrize("arch", ["phi3", "phi4"])
def test_logprobs_within_1e4_of_transformers(models, arch) -> None:
    with engine(models[arch], DRAFTERS["draft"](models[f"{arch}-draft"])) as llm:
        assert_logprobs_match(llm, models[arch], prompts(), stepwise=False)


# ---- greedy output, every drafter ------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_outputs(models) -> dict[str, list[list[int]]]:
    return {arch: hf_greedy(models[arch], prompts(), MAX_NEW) for arch in ("phi3", "phi4")}


@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("arch", ["phi3", "phi4"])
def test_greedy_equals_transformers(models, hf_outputs, arch, drafter) -> None:
    with engine(models[arch], DRAFTERS[drafter](models[f"{arch}-draft"])) as llm:
        assert greedy_token_ids(llm, prompts(), MAX_NEW) == hf_outputs[arch]
        if drafter != "plain":
            assert llm.engine.metrics.spec.proposed > 0


@torch.inference_mode()
def stepwise_greedy(path: Path, batch: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy outputs, every token (the prompt's too) fed one at a time."""
    outs = []
    for p in batch:
        seq = list(p)
        for _ in range(n):
            seq.append(int(hf_stepwise_logits(path, [torch.tensor(seq)])[0][-1].argmax()))
        outs.append(seq[len(p) :])
    return outs


@pytest.mark.parametrize("drafter", ["plain", "draft", "self_sparse"])
def test_greedy_across_the_longrope_switch(models, tmp_path, drafter) -> None:
    """Prompts of 5 to 31 tokens and 20 more across a switch at 12: short, long and mixed."""
    path = switched(models["phi4"], tmp_path / "m")
    with engine(path, DRAFTERS[drafter](models["phi4-draft"])) as llm:
        assert greedy_token_ids(llm, prompts(), MAX_NEW) == stepwise_greedy(
            path, prompts(), MAX_NEW
        )


@pytest.mark.parametrize("layout", ["eagle", "eagle3"])
def test_greedy_with_an_eagle_head_equals_transformers(models, hf_outputs, layout) -> None:
    from specbatch.testing.eagle_heads import make_eagle_head

    target = models["phi4"]
    head = make_eagle_head(target.parent / f"head-{layout}", target, layout, seed=5,
                           with_embedding=layout == "eagle")  # fmt: skip
    spec = {"method": layout, "model": str(head), "num_speculative_tokens": 3}
    with engine(target, spec) as llm:
        assert greedy_token_ids(llm, prompts(), MAX_NEW) == hf_outputs["phi4"]
        assert llm.engine.metrics.spec.proposed > 0


def test_the_law_of_whole_outputs_under_speculation(tmp_path) -> None:
    """A vocabulary of 3 (tests/test_exactness.py's setting) on a Phi-4-mini-shaped target."""
    config = phi3_config(layers=2, hidden=32, heads=2, kv_heads=1, partial=0.75, vocab=3,
                         max_positions=64, eos_token_id=None, bos_token_id=None,
                         pad_token_id=None)  # fmt: skip
    target = save_random(config, tmp_path / "t", seed=7, qk_scale=1.0)
    draft = make_perturbed_draft(target, tmp_path / "d", noise=0.25, seed=1)
    chi_square_law(target, draft)


@pytest.mark.xdist_group("ray")
def test_greedy_at_tensor_parallel_2_equals_transformers(models, hf_outputs, ray_cluster) -> None:
    """Fused q/k/v and gate/up split into each rank's heads and columns: Phi-3 verifying a
    draft model's chains, Phi-4-mini the self-drafter's."""
    for arch, drafter in (("phi3", "draft"), ("phi4", "self_sparse")):
        spec = DRAFTERS[drafter](models[f"{arch}-draft"])
        with engine(models[arch], spec, tensor_parallel_size=2) as llm:
            assert greedy_token_ids(llm, prompts(), MAX_NEW) == hf_outputs[arch], arch
            assert llm.engine.metrics.spec.proposed > 0


# ---- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architectures": ["PhiForCausalLM"], "model_type": "phi"},
         r"architecture 'PhiForCausalLM' is not supported; supported: .*Phi3ForCausalLM"),
        ({"architectures": ["Phi4MMForCausalLM"], "model_type": "phi4mm"},
         r"architecture 'Phi4MMForCausalLM' is not supported"),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported for Phi3ForCausalLM"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
         r"(?s)config.json': .*rope_parameters.* must be one of \['longrope'\], got dynamic"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                              "original_max_position_embeddings": 32,
                              "short_factor": [1.0] * 3, "long_factor": [1.0] * 8}},
         r"(?s)config.json': .*short_factor field must have length 8, got 3"),
        ({"partial_rotary_factor": 0.35,
          "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
         r"partial_rotary_factor gives 5 rotary dimensions"),
    ],
)  # fmt: skip
def test_bad_configs_name_what_is_wrong(models, tmp_path, changes, message) -> None:
    path = with_config(models["phi3"], tmp_path / "m", **changes)
    with pytest.raises(InvalidInputError, match=message):
        load_model(path, torch.float32, "cpu")


def test_a_missing_fused_weight_is_named(models, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    path = with_config(models["phi3"], tmp_path / "m")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.qkv_proj.weight"]
    tensors["model.layers.0.mlp.gate_up_proj.weight"] = tensors[
        "model.layers.0.mlp.gate_up_proj.weight"
    ][:-1]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InvalidInputError, match=r"gate_up_proj.weight' has shape \[191, 64\]"):
        load_model(path, torch.float32, "cpu")


# ---- planted bugs are caught ------------------------------------------------------------------


@pytest.fixture
def planted(monkeypatch) -> Iterator[Callable[[str], None]]:
    def plant(bug: str) -> None:
        if bug == "rotary over the whole head":
            monkeypatch.setattr(phi3, "rotary_dim_of", phi3.head_dim_of)
        elif bug == "long factors never used":
            real = phi3.phi3_rope_tables
            monkeypatch.setattr(phi3, "phi3_rope_tables",
                                lambda c: (real(c)[0], None, 0, real(c)[3]))  # fmt: skip
        elif bug == "attention factor dropped":
            real = phi3.phi3_rope_tables
            monkeypatch.setattr(phi3, "phi3_rope_tables", lambda c: (*real(c)[:3], 1.0))
        else:
            raise ValueError(bug)

    yield plant


@pytest.mark.parametrize(
    ("bug", "arch"),
    [("rotary over the whole head", "phi4-draft"), ("long factors never used", "phi4"),
     ("attention factor dropped", "phi3")],
)  # fmt: skip
def test_planted_bugs_move_the_logits_off_transformers(models, tmp_path, planted, bug, arch):
    path = models[arch] if arch.endswith("draft") else switched(models[arch], tmp_path / "m")
    planted(bug)
    model = load_model(path, torch.float32, "cpu")
    tokens, ours = schedule_logits(model)
    assert worst_logprob_gap(ours, hf_stepwise_logits(path, tokens)) > 1e-2
