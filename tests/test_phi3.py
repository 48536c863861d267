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
    assert_cli_and_server_run,
    assert_logits_close,
    assert_same_parameters,
    check_bfloat16_rounding,
    check_eagle_head,
    check_greedy,
    check_logprobs,
    check_tensor_parallel_2,
    chi_square_law,
    engine,
    hf_greedy_outputs,
    hf_logits,
    hf_stepwise_logits,
    prompts,
    save_random,
    schedule_logits,
    with_config,
    worst_logprob_gap,
)
from tests.helpers import greedy_token_ids, make_perturbed_draft

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
    check_bfloat16_rounding(models[arch])


@pytest.mark.parametrize("arch", ["phi3", "phi4"])
def test_logprobs_within_1e4_of_transformers(models, arch) -> None:
    check_logprobs(models, arch)


# ---- greedy output, every drafter ------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_outputs(models) -> dict[str, list[list[int]]]:
    return hf_greedy_outputs(models, ("phi3", "phi4"))


@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("arch", ["phi3", "phi4"])
def test_greedy_equals_transformers(models, hf_outputs, arch, drafter) -> None:
    check_greedy(models, hf_outputs[arch], arch, drafter)


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
    check_eagle_head(models["phi4"], hf_outputs["phi4"], layout)


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
    check_tensor_parallel_2(models, hf_outputs, (("phi3", "draft"), ("phi4", "self_sparse")))


def test_cli_and_server_run_it(models, make_checkpoint, tmp_path) -> None:
    assert_cli_and_server_run(models["phi4"], make_checkpoint, tmp_path)


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


# ---- GGUF ---------------------------------------------------------------------------------


def write_phi3_gguf(hf_dir: Path, out: Path, matrix_type: str = "F32") -> Path:
    """The file llama.cpp's converter writes for a Phi-3 checkpoint: the fused projections
    under the ``gguf`` package's names (``attn_qkv``, ``ffn_up`` holding gate and up), the
    rotary's width, LongRoPE's factors as two tensors with its original length and attention
    factor, window 0 for none, no output tensor when the head is tied."""
    import json
    import math

    import gguf
    import numpy as np
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    rope = config["rope_parameters"]
    layers, hidden, heads = (config[k] for k in ("num_hidden_layers", "hidden_size",
                                                 "num_attention_heads"))  # fmt: skip
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI3, layers)
    writer = gguf.GGUFWriter(str(out), "phi3")
    writer.add_vocab_size(config["vocab_size"])
    writer.add_pad_token_id(config.get("pad_token_id") or 0)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(config.get("sliding_window") or 0)
    if rope["rope_type"] == "longrope":
        original = rope["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = config["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight",
                              np.array(rope[f"{kind}_factor"], dtype=np.float32))  # fmt: skip
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        base, suffix = name.rsplit(".", 1)
        kind = gguf.GGMLQuantizationType[matrix_type if tensor.dim() == 2 else "F32"]
        data = tensor.float().numpy()
        if kind == gguf.GGMLQuantizationType.BF16:
            data = tensor.bfloat16().view(torch.int16).numpy()
        elif kind != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(data, kind)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def assert_same_model(file: Path, hf_dir: Path, dtype: torch.dtype = torch.float32) -> None:
    """The same weights bit for bit, the same rotary width, factors and window."""
    want = load_model(hf_dir, dtype, "cpu", use_cpu_kernels=False)
    got = load_model(file, dtype, "cpu", use_cpu_kernels=False)
    for key in ("sliding_window", "num_hidden_layers", "tie_word_embeddings"):
        assert getattr(got.hf_config, key) == getattr(want.hf_config, key), key
    ours, theirs = got.model.rotary_emb, want.model.rotary_emb
    assert ours.rotary_dim == theirs.rotary_dim
    assert torch.equal(ours.cos, theirs.cos) and torch.equal(ours.sin, theirs.sin)
    assert_same_parameters(got, want)


@pytest.mark.parametrize("arch", ["phi3", "phi4"])
def test_a_gguf_file_holds_the_checkpoint_and_gives_its_output(
    models, hf_outputs, tmp_path, arch
) -> None:
    """transformers' GGUF loading reads neither the rotary's width nor LongRoPE's factors (it
    would run another model), so the reference is the checkpoint the file was written from."""
    file = write_phi3_gguf(models[arch], tmp_path / "m.gguf")
    assert_same_model(file, models[arch])
    with engine(file) as llm:
        assert greedy_token_ids(llm, prompts(), MAX_NEW) == hf_outputs[arch]


def test_a_bfloat16_gguf_file_runs_in_bfloat16(models, tmp_path) -> None:
    from specbatch.model.checkpoint import read_checkpoint

    file = write_phi3_gguf(models["phi4"], tmp_path / "b.gguf", "BF16")
    assert read_checkpoint(file).dtype == torch.bfloat16
    assert_same_model(file, models["phi4"], torch.bfloat16)
    with engine(file, dtype="bfloat16") as llm:
        assert [len(o) for o in greedy_token_ids(llm, prompts(2), 8)] == [8, 8]


def test_transformers_reads_a_full_rotary_gguf_file_as_specbatch_does(models, tmp_path) -> None:
    """Where transformers' GGUF loading reads all a file holds (whole-head rotary, no
    LongRoPE), its model of the file gives specbatch's logits."""
    from transformers import AutoModelForCausalLM

    plain = save_random(phi3_config(longrope=False), tmp_path / "plain", seed=4)
    (tmp_path / "g").mkdir()
    file = write_phi3_gguf(plain, tmp_path / "g" / "m.gguf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "g", gguf_file="m.gguf",
                                              dtype=torch.float32).eval()  # fmt: skip
    model = load_model(file, torch.float32, "cpu")
    tokens, ours = schedule_logits(model)
    with torch.inference_mode():
        ref = [hf(t[None]).logits[0].float() for t in tokens]
    assert_logits_close(ours, ref)
