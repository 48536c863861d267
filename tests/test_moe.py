"""Mixtral, Qwen3-MoE and Qwen2-MoE against transformers, on tiny random checkpoints built with
it (8 experts, top 2).

"mixtral" renormalises its top-2 probabilities; "qwen3moe" too (``norm_topk_prob``), with q/k
norms and its second layer dense (``mlp_only_layers``); "qwen2moe" does not renormalise and adds
a gated shared expert. Checked: the expert-grouped forward against a per-row reference with rows
routed to every pattern of experts (float32 and bfloat16, torch and the CPU kernels), routing
against transformers' routers; logits through the paged cache and logprobs within 1e-4 of
transformers', bfloat16 no further from float32 than transformers' own; greedy output equal to
transformers' plain, with every drafter and at tensor parallelism 2 (each expert's intermediate
dimension split); the chi-square law of whole outputs under speculation; GGUF files as llama.cpp
writes them (Mixtral as "llama" with stacked experts, Qwen3-MoE as "qwen3moe"); clear errors.
A planted bug (router weights not renormalised) moves the logits off transformers'.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from specbatch.distributed.parallel_state import SINGLE
from specbatch.errors import InvalidInputError
from specbatch.model import moe
from specbatch.model.layers.experts import ExpertMLP, grouped_experts, route
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
    prompts,
    save_random,
    schedule_logits,
    with_config,
    worst_logprob_gap,
)
from tests.helpers import greedy_token_ids, make_perturbed_draft

ray_cluster = family_checks.ray_cluster  # a fixture
ARCHS = ("mixtral", "qwen3moe", "qwen2moe")


def moe_config(
    arch: str,
    *,
    layers: int = 3,
    hidden: int = 64,
    experts: int = 8,
    vocab: int = VOCAB,
    **kw: Any,
) -> Any:
    import transformers

    base: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    base.update(kw)
    if arch == "mixtral":
        return transformers.MixtralConfig(
            architectures=["MixtralForCausalLM"], num_local_experts=experts, **base
        )
    qwen: dict[str, Any] = dict(num_experts=experts, moe_intermediate_size=48,
                                decoder_sparse_step=1)  # fmt: skip
    qwen.update(base)
    if arch == "qwen3moe":
        qwen.setdefault("mlp_only_layers", [1] if layers > 1 else [])
        qwen.setdefault("norm_topk_prob", True)
        return transformers.Qwen3MoeConfig(
            architectures=["Qwen3MoeForCausalLM"], head_dim=hidden // 4, **qwen
        )
    qwen.setdefault("mlp_only_layers", [2] if layers > 2 else [])
    qwen.setdefault("shared_expert_intermediate_size", 64)
    return transformers.Qwen2MoeConfig(architectures=["Qwen2MoeForCausalLM"], **qwen)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for i, arch in enumerate(ARCHS):
        out[arch] = save_random(moe_config(arch), root / arch, seed=i)
        small = moe_config(arch, layers=1, hidden=32, experts=4, mlp_only_layers=[])
        out[f"{arch}-draft"] = save_random(small, root / f"{arch}-d", seed=10 + i)
    return out


# ---- the experts --------------------------------------------------------------------------


def random_experts(n: int, hidden: int, size: int, dtype: torch.dtype, seed: int) -> list[Any]:
    gen = torch.Generator().manual_seed(seed)
    experts = []
    for _ in range(n):
        e = ExpertMLP(hidden, size, tp=SINGLE, dtype=dtype, device="cpu")
        for p in e.parameters():
            p.data.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        experts.append(e)
    return experts


def per_row(x, weights, ids, experts) -> torch.Tensor:
    """Row by row, each of its experts on it alone, summed in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            out[t] += w * experts[e](x[t : t + 1])[0].double()
    return out


def every_pattern(num_experts: int, k: int) -> torch.Tensor:
    """One row for each ordered choice of k distinct experts."""
    return torch.tensor(list(itertools.permutations(range(num_experts), k)))


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_experts", "k"), [(8, 2), (8, 1), (4, 4), (6, 3)])
def test_grouped_experts_equal_a_per_row_reference(num_experts, k, dtype, kernels) -> None:
    """Rows routed to every pattern (each expert woken by many rows, by one, or by none of a
    sub-batch), in shuffled order."""
    experts = random_experts(num_experts, 32, 48, dtype, seed=num_experts * 10 + k)
    if kernels:
        from specbatch.kernels.cpu import cpu_kernels

        cpu = cpu_kernels()
        if cpu is None:
            pytest.skip("specbatch's CPU kernels do not build here")
        for e in experts:
            for m in e.modules():
                if hasattr(m, "use_cpu_kernels"):
                    m.use_cpu_kernels(cpu)
    ids = every_pattern(num_experts, k)
    ids = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))]
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1))
    x = torch.randn(len(ids), 32, generator=torch.Generator().manual_seed(2)).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in (slice(None), slice(0, 1), slice(3, 5)):  # a step, one row, two rows
        got = grouped_experts(x[rows], weights[rows], ids[rows], experts)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), per_row(x[rows], weights[rows], ids[rows],
                                                         experts), atol=tol, rtol=tol)  # fmt: skip
    if not kernels:  # torch's matrix multiplies round a row by its batch's size
        return
    alone = torch.cat([grouped_experts(x[i : i + 1], weights[i : i + 1], ids[i : i + 1], experts)
                       for i in range(len(ids))])  # fmt: skip
    assert torch.equal(alone, grouped_experts(x, weights, ids, experts))


def test_grouped_experts_call_each_woken_expert_once() -> None:
    experts = random_experts(8, 16, 24, torch.float32, seed=0)
    calls = [0] * 8
    for i, e in enumerate(experts):
        e.register_forward_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
    ids = torch.tensor([[0, 3], [3, 5], [0, 5], [3, 0]])
    grouped_experts(torch.randn(4, 16), torch.rand(4, 2), ids, experts)
    assert calls == [1, 0, 0, 1, 0, 1, 0, 0]


@pytest.mark.parametrize("renormalise", [True, False])
def test_routing_equals_transformers(renormalise) -> None:
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = transformers.Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=2,
                                      norm_topk_prob=renormalise)  # fmt: skip
    router = Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(64, 16)
    _, want_w, want_ids = router(x)
    weights, ids = route(x @ router.weight.detach().T, 2, renormalise)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w.detach(), atol=1e-6, rtol=1e-6)
    if renormalise:
        torch.testing.assert_close(weights.sum(-1), torch.ones(64))


def test_woken_experts_as_theory_counts_them() -> None:
    """THEORY's E (1 - (1 - k/E)^r) against routes drawn uniformly; its verify cost is 1 for a
    dense model and above 1 at batch 1 for a mixture."""
    from specbatch.theory import expected_woken_experts, moe_verify_cost

    gen = torch.Generator().manual_seed(0)
    for rows in (1, 2, 4, 16):
        picks = torch.rand(4000, rows, 8, generator=gen).argsort(-1)[..., :2]
        drawn = [len(set(p.flatten().tolist())) for p in picks]
        assert abs(sum(drawn) / len(drawn) - expected_woken_experts(rows, 8, 2)) < 0.05
    assert expected_woken_experts(1, 8, 2) == 2.0
    assert moe_verify_cost(1, 3, 8, 2, fixed_bytes=1.0, expert_bytes=0.0) == 1.0
    assert moe_verify_cost(1, 3, 8, 2, fixed_bytes=0.0, expert_bytes=1.0) == pytest.approx(
        expected_woken_experts(4, 8, 2) / 2
    )
    assert moe_verify_cost(64, 3, 8, 2, 0.0, 1.0) == pytest.approx(1.0, abs=1e-6)


# ---- logits and logprobs against transformers ----------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_through_the_paged_cache_equal_transformers(models, arch) -> None:
    model = load_model(models[arch], torch.float32, "cpu")
    assert type(model).__name__ == "MoeForCausalLM"
    kinds = [type(layer._modules[layer.mlp_name]).__name__ for layer in model.model.layers]
    sparse, dense = "SparseMoeBlock", "LlamaMLP"
    assert kinds == {"mixtral": [sparse] * 3, "qwen3moe": [sparse, dense, sparse],
                     "qwen2moe": [sparse, sparse, dense]}[arch]  # fmt: skip
    tokens, ours = schedule_logits(model)
    assert_logits_close(ours, hf_logits(models[arch], tokens))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3moe"])
def test_bfloat16_rounds_no_worse_than_transformers_bfloat16(models, arch) -> None:
    check_bfloat16_rounding(models[arch])


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_within_1e4_of_transformers(models, arch) -> None:
    check_logprobs(models, arch)


# ---- greedy output, every drafter ------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_outputs(models) -> dict[str, list[list[int]]]:
    return hf_greedy_outputs(models, ARCHS)


@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("arch", ["mixtral", "qwen3moe"])
def test_greedy_equals_transformers(models, hf_outputs, arch, drafter) -> None:
    check_greedy(models, hf_outputs[arch], arch, drafter)


@pytest.mark.parametrize("layout", ["eagle", "eagle3"])
def test_greedy_with_an_eagle_head_equals_transformers(models, hf_outputs, layout) -> None:
    check_eagle_head(models["qwen3moe"], hf_outputs["qwen3moe"], layout)


def test_the_law_of_whole_outputs_under_speculation(tmp_path) -> None:
    """A vocabulary of 3 (tests/test_exactness.py's setting) on a Mixtral-shaped target."""
    config = moe_config("mixtral", layers=2, hidden=32, vocab=3, max_position_embeddings=64,
                        eos_token_id=None, bos_token_id=None, pad_token_id=None)  # fmt: skip
    target = save_random(config, tmp_path / "t", seed=7, qk_scale=1.0)
    draft = make_perturbed_draft(target, tmp_path / "d", noise=0.25, seed=1)
    chi_square_law(target, draft)


@pytest.mark.xdist_group("ray")
def test_greedy_at_tensor_parallel_2_equals_transformers(models, hf_outputs, ray_cluster) -> None:
    """Every expert's intermediate dimension split across two ranks: Mixtral verifying a draft
    model's chains, Qwen3-MoE the self-drafter's, Qwen2-MoE (its shared expert split too)
    plain."""
    cases = (("mixtral", "draft"), ("qwen3moe", "self_sparse"), ("qwen2moe", "plain"))
    check_tensor_parallel_2(models, hf_outputs, cases, proposed=False)


# ---- GGUF ---------------------------------------------------------------------------------


def write_moe_gguf(hf_dir: Path, out: Path) -> Path:
    """The file llama.cpp's converter writes: Mixtral as "llama" (query and key rows
    interleaved per head for its rotary, ``llama.expert_count``), Qwen3-MoE as "qwen3moe"; each
    layer's experts stacked into ``ffn_{gate,up,down}_exps`` and its router as
    ``ffn_gate_inp``; a dense layer's MLP under the dense names."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    mixtral = config["model_type"] == "mixtral"
    arch = "llama" if mixtral else "qwen3moe"
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers)
    dense = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)  # not in "qwen3moe"'s map
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if not mixtral:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    tensors = load_file(str(hf_dir / "model.safetensors"))
    stacked: dict[str, list[torch.Tensor]] = {}
    for name in sorted(tensors, key=lambda n: (n.split(".experts.")[0], n)):
        w = tensors[name]
        if ".experts." in name:  # model.layers.0.mlp.experts.3.w1.weight
            head, rest = name.split(".experts.")
            part = rest.split(".")[1]
            stacked.setdefault(f"{head}.experts.{part}", []).append(w)
            continue
        if mixtral and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = heads if "q_proj" in name else config["num_key_value_heads"]
            w = w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        base, suffix = name.rsplit(".", 1)
        gguf_base = names.get_name(base) or dense.get_name(base)
        writer.add_tensor(f"{gguf_base}.{suffix}", w.float().numpy())
    for base, ws in stacked.items():
        writer.add_tensor(f"{names.get_name(base)}.weight", torch.stack(ws).float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("arch", ["mixtral", "qwen3moe"])
def test_a_gguf_file_holds_the_checkpoint_and_gives_its_output(
    models, hf_outputs, tmp_path, arch
) -> None:
    """The reference is the checkpoint the file was written from (transformers reads no
    Mixtral file, and takes a Qwen3-MoE file's expert size from its config's default, 768, and
    every layer as sparse: the next test's checkpoint is shaped so)."""
    file = write_moe_gguf(models[arch], tmp_path / "m.gguf")
    want = load_model(models[arch], torch.float32, "cpu", use_cpu_kernels=False)
    got = load_model(file, torch.float32, "cpu", use_cpu_kernels=False)
    assert got.moe == want.moe
    assert_same_parameters(got, want)
    with engine(file) as llm:
        assert greedy_token_ids(llm, prompts(), MAX_NEW) == hf_outputs[arch]


def test_transformers_reads_a_qwen3moe_gguf_file_as_specbatch_does(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    config = moe_config("qwen3moe", layers=2, moe_intermediate_size=768, mlp_only_layers=[])
    hf_dir = save_random(config, tmp_path / "hf", seed=3)
    (tmp_path / "g").mkdir()
    file = write_moe_gguf(hf_dir, tmp_path / "g" / "m.gguf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "g", gguf_file="m.gguf",
                                              dtype=torch.float32).eval()  # fmt: skip
    tokens, ours = schedule_logits(load_model(file, torch.float32, "cpu"))
    with torch.inference_mode():
        assert_logits_close(ours, [hf(t[None]).logits[0].float() for t in tokens])


def test_cli_and_server_run_it(models, make_checkpoint, tmp_path) -> None:
    assert_cli_and_server_run(models["mixtral"], make_checkpoint, tmp_path)


# ---- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "changes", "message"),
    [
        ("mixtral", {"architectures": ["PhimoeForCausalLM"], "model_type": "phimoe"},
         r"architecture 'PhimoeForCausalLM' is not supported; supported: .*MixtralForCausalLM, "
         r"Qwen2MoeForCausalLM, Qwen3MoeForCausalLM"),
        ("mixtral", {"num_experts_per_tok": 9},
         r"MixtralForCausalLM: num_experts_per_tok=9 is more than the 8 experts"),
        ("qwen3moe", {"hidden_act": "gelu"},
         r"hidden_act 'gelu' is not supported for Qwen3MoeForCausalLM"),
    ],
)  # fmt: skip
def test_bad_configs_name_what_is_wrong(models, tmp_path, arch, changes, message) -> None:
    path = with_config(models[arch], tmp_path / "m", **changes)
    with pytest.raises(InvalidInputError, match=message):
        load_model(path, torch.float32, "cpu")


def test_tensor_parallel_must_divide_the_expert_sizes() -> None:
    from specbatch.model.checkpoint import check_tensor_parallel

    check_tensor_parallel(moe_config("qwen2moe"), 2)
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        config = moe_config("qwen2moe", **{name: 45})
        with pytest.raises(InvalidInputError, match=f"{name}=45"):
            check_tensor_parallel(config, 2)


def test_a_missing_expert_is_named(models, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    path = with_config(models["mixtral"], tmp_path / "m")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.2.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InvalidInputError, match=r"lacks 1 weight.*experts\.5\.w3\.weight"):
        load_model(path, torch.float32, "cpu")


# ---- planted bugs are caught ------------------------------------------------------------------


def test_router_weights_not_renormalised_move_the_logits_off_transformers(
    models, monkeypatch
) -> None:
    real = moe.route
    monkeypatch.setattr(moe, "route", lambda logits, k, renormalise: real(logits, k, False))
    model = load_model(models["mixtral"], torch.float32, "cpu")
    tokens, ours = schedule_logits(model)
    assert worst_logprob_gap(ours, hf_logits(models["mixtral"], tokens)) > 1e-2
