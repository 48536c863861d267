"""Gemma 2 and Gemma 3 (text) against transformers, on tiny random checkpoints built with it.

The checkpoints have 4 layers with an 8-key sliding window (prompts and outputs run past it),
Gemma 2's soft-capping set to bite (attention 5.0 with query/key projections scaled so that raw
scores exceed it, final 3.0 with logits beyond it), random norm weights (the ``1 + weight``
matters) and tied heads; Gemma 3's layers mix sliding and global ones with a rope of each.
Checked: the windowed, soft-capped attention against a row-by-row reference (chunks, decodes,
a verification tree, a drafter's beam pass); logits through the paged cache (ragged prefills,
chunks, decodes, rolled-back speculation) and logprobs within 1e-4 of transformers' in float32,
bfloat16 no further from float32 than transformers' own; greedy output equal to transformers'
plain and with every drafter (n-gram, a smaller Gemma as a chain and as a tree, self_sparse,
random EAGLE-1 and EAGLE-3 heads), and at tensor parallelism 2; GGUF files as llama.cpp writes
them (norms stored as ``1 + weight``, its metadata and its defaults) holding the checkpoint's
weights and giving its output; the CLI and the server on ``--model``; clear errors. Planted
bugs (either soft-cap dropped, a sliding layer seeing one key past its window, the embedding
unscaled, a norm without its 1) move the logits off transformers'.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from specbatch.errors import InvalidInputError
from specbatch.model import gemma
from specbatch.model.layers import window_attention as wa
from specbatch.model.loader import load_model
from tests import family_checks
from tests.family_checks import (
    BS,
    DRAFTERS,
    MAX_NEW,
    VOCAB,
    assert_cli_and_server_run,
    assert_each_close,
    check_bfloat16_rounding,
    check_eagle_head,
    check_greedy,
    check_logprobs,
    check_tensor_parallel_2,
    engine,
    hf_greedy_outputs,
    hf_logits,
    prompts,
    schedule_logits,
    with_config,
    worst_logprob_gap,
)
from tests.helpers import greedy_token_ids, random_paged_batch

ray_cluster = family_checks.ray_cluster  # a fixture
WINDOW = 8


def make_gemma(
    out: Path,
    arch: str,
    *,
    seed: int,
    layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    qk_scale: float = 3.0,
    **config: Any,
) -> Path:
    """A random Gemma checkpoint saved by transformers: norm weights around 0 (the final one
    around 4, so the tied head's logits reach past a final cap of 3), query/key projections
    ``qk_scale`` times fan-in scaling (raw attention scores past a cap of 5)."""
    import transformers

    kw: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        query_pre_attn_scalar=head_dim, sliding_window=WINDOW, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    kw.update(config)
    if arch == "gemma2":
        cfg = transformers.Gemma2Config(architectures=["Gemma2ForCausalLM"], **kw)
    else:
        cfg = transformers.Gemma3TextConfig(architectures=["Gemma3ForCausalLM"], **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "model.norm.weight":
                p.copy_(4.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn_like(p))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(0.05 * torch.randn_like(p))
            elif "q_proj" in name or "k_proj" in name:
                p.copy_(torch.randn_like(p) * qk_scale / math.sqrt(p.shape[-1]))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma")
    small = dict(layers=2, hidden=32, heads=2, kv_heads=1)
    mixed = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    gemma3 = dict(layer_types=mixed, rope_scaling={"rope_type": "linear", "factor": 2.0})
    return {
        "gemma2": make_gemma(root / "g2", "gemma2", seed=0, attn_logit_softcapping=5.0,
                             final_logit_softcapping=3.0),
        "gemma3": make_gemma(root / "g3", "gemma3", seed=1, **gemma3),
        "gemma2-draft": make_gemma(root / "g2d", "gemma2", seed=2, attn_logit_softcapping=5.0,
                                   final_logit_softcapping=3.0, tie_word_embeddings=False,
                                   **small),
        "gemma3-draft": make_gemma(root / "g3d", "gemma3", seed=3, **small),
    }  # fmt: skip


# ---- the attention -----------------------------------------------------------------------


def reference_attention(q, k_cache, v_cache, meta, positions, tables, scale, softcap, window):
    """Row by row in float64: the keys a row sees (its context and itself, or a tree's
    ancestors), those within ``window`` positions, scores soft-capped."""
    bs, hkv, hq = k_cache.shape[1], k_cache.shape[2], q.shape[1]
    out = torch.empty_like(q)
    starts = meta.tree_starts.tolist() if meta.tree_starts is not None else None
    masks = meta.tree_masks.tolist() if meta.tree_masks is not None else None
    row = 0
    for b, (q_len, s_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        for i in range(q_len):
            pos = int(positions[row + i])
            own = s_len - q_len + i
            first = starts[b] if starts is not None else -1
            keys = []
            for j in range(s_len):
                if first >= 0 and j >= first:
                    seen = j - first < 64 and (masks[row + i] >> (j - first)) & 1
                else:
                    seen = j <= own and (window is None or j > pos - window)
                if seen:
                    keys.append(j)
            table = tables[b]
            kk = torch.stack([k_cache[table[j // bs], j % bs] for j in keys]).double()
            vv = torch.stack([v_cache[table[j // bs], j % bs] for j in keys]).double()
            for h in range(hq):
                s = kk[:, h // (hq // hkv)] @ q[row + i, h].double() * scale
                if softcap is not None:
                    s = torch.tanh(s / softcap) * softcap
                out[row + i, h] = (torch.softmax(s, 0) @ vv[:, h // (hq // hkv)]).to(q.dtype)
        row += q_len
    return out


def tree_batch(seed: int = 0):
    """Decodes deep past the window, a long chunk, a prompt, a verification tree (its root at
    its position, two branches: a node sits at the root's position plus its depth) and a
    drafter's third beam pass (two depth-1 and two depth-2 nodes cached after the root, the
    two depth-3 nodes queried: they sit at the root's position plus 3)."""
    query_lens, seq_lens = [1, 40, 5, 7, 3, 2], [30, 60, 5, 27, 11, 26]
    q, k, v, k_cache, v_cache, meta, tables = random_paged_batch(
        query_lens, seq_lens, BS, 4, 2, 16, seed=seed
    )
    positions = torch.cat([torch.arange(s - n, s) for n, s in zip(query_lens, seq_lens)])
    masks = torch.zeros(sum(query_lens), dtype=torch.int64)
    starts = [-1] * len(query_lens)
    at = [sum(query_lens[:i]) for i in range(len(query_lens) + 1)]
    parents = [-1, 0, 0, 1, 2, 3, 4]  # verification: depths 0 1 1 2 2 3 3
    bits: list[int] = []
    for i, p in enumerate(parents):
        bits.append((bits[p] if p >= 0 else 0) | 1 << i)
    starts[3] = seq_lens[3] - query_lens[3]
    positions[at[3] : at[4]] = starts[3] + torch.tensor([0, 1, 1, 2, 2, 3, 3])
    masks[at[3] : at[4]] = torch.tensor(bits)
    starts[5] = seq_lens[5] - 6  # keys: depth 1 (2), depth 2 (2), depth 3 (the 2 rows)
    positions[at[5] : at[6]] = starts[5] + 2  # the root sits at starts[5] - 1
    masks[at[5] : at[6]] = torch.tensor([0b010101, 0b101010])
    meta.tree_starts = torch.tensor(starts)
    meta.tree_masks = masks
    return q, k, v, k_cache, v_cache, meta, tables, positions


@pytest.mark.parametrize(("softcap", "window"), [(None, None), (5.0, None), (None, 8), (3.0, 8)])
def test_window_attention_matches_a_row_by_row_reference(softcap, window) -> None:
    q, k, v, k_cache, v_cache, meta, tables, positions = tree_batch()
    q = q * 3  # scores past the cap
    out = wa.window_attention(q, k, v, k_cache, v_cache, meta, 0.25, softcap, window)
    ref = reference_attention(q, k_cache, v_cache, meta, positions, tables, 0.25, softcap, window)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    if window is not None:  # each sequence's window leaves keys out: one more changes its rows
        wider = wa.window_attention(q, k, v, k_cache, v_cache, meta, 0.25, softcap, window + 1)
        for b in (0, 1, 3, 4, 5):
            rows = slice(int(meta.query_start_loc[b]), int(meta.query_start_loc[b + 1]))
            assert (wider[rows] - ref[rows]).abs().max() > 1e-3, b


# ---- logits and logprobs against transformers ----------------------------------------------


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_logits_through_the_paged_cache_equal_transformers(models, arch) -> None:
    model = load_model(models[arch], torch.float32, "cpu")
    assert type(model).__name__ == "GemmaForCausalLM" and model.attention_backend.name == "torch"
    tokens, ours = schedule_logits(model)
    ref = hf_logits(models[arch], tokens)
    assert_each_close(ours, ref)
    probs = ref[4].softmax(-1)
    assert 0.02 < probs.max(-1).values.mean() < 0.9  # neither uniform nor one-hot
    if arch == "gemma2":
        assert ref[4].abs().max() > 2.9  # the final cap holds logits near +-3


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_bfloat16_rounds_no_worse_than_transformers_bfloat16(models, arch) -> None:
    """Against float32, specbatch's bfloat16 logits err no more than transformers' own."""
    check_bfloat16_rounding(models[arch])


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_logprobs_within_1e4_of_transformers(models, arch) -> None:
    check_logprobs(models, arch)


# ---- greedy output, every drafter ------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_outputs(models) -> dict[str, list[list[int]]]:
    return hf_greedy_outputs(models, ("gemma2", "gemma3"))


@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_greedy_equals_transformers(models, hf_outputs, arch, drafter) -> None:
    check_greedy(models, hf_outputs[arch], arch, drafter)


@pytest.mark.parametrize("layout", ["eagle", "eagle3"])
def test_greedy_with_an_eagle_head_equals_transformers(models, hf_outputs, layout) -> None:
    """A random head (its layer is EAGLE's Llama layer) on Gemma's embedding table (unscaled,
    as vLLM shares it), its final hidden states (EAGLE-1) or residual streams (EAGLE-3) and
    its soft-capped logits."""
    check_eagle_head(models["gemma2"], hf_outputs["gemma2"], layout)


@pytest.mark.xdist_group("ray")
def test_greedy_at_tensor_parallel_2_equals_transformers(models, hf_outputs, ray_cluster) -> None:
    """Heads split across two ranks as for Llama (q/k norms and every other norm replicated),
    Gemma 2 verifying a draft model's chains, Gemma 3 the self-drafter's."""
    check_tensor_parallel_2(models, hf_outputs, (("gemma2", "draft"), ("gemma3", "self_sparse")))


# ---- GGUF ---------------------------------------------------------------------------------


def write_gemma_gguf(
    hf_dir: Path,
    out: Path,
    matrix_type: str = "F32",
    pattern: int | list[bool] | None = None,
    scale: float | None = None,
    bare: bool = False,
) -> Path:
    """The file llama.cpp's converter writes for a Gemma 2 / Gemma 3 checkpoint: the ``gguf``
    package's tensor names, every norm stored as ``1 + weight``, no LM head (tied), its
    metadata (no query scale: the reader derives it from the head size; no sliding rope base
    or layer pattern: llama.cpp's defaults; ``pattern`` and ``scale``: those keys written;
    ``bare``: no window and no soft-caps either)."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    arch = {"gemma2": "gemma2", "gemma3_text": "gemma3"}[config["model_type"]]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    if not bare:
        writer.add_sliding_window(config["sliding_window"])
    rope = config["rope_parameters"]
    if arch == "gemma2":
        if not bare:
            writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    else:
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        if rope["full_attention"]["rope_type"] == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
    if pattern is not None:
        writer.add_sliding_window_pattern(pattern)
    if scale is not None:
        writer.add_attention_scale(scale)
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        if name == "lm_head.weight":
            continue
        w = tensor.float()
        if name.endswith("norm.weight"):
            w = w + 1
        base, suffix = name.rsplit(".", 1)
        kind = gguf.GGMLQuantizationType[matrix_type if w.dim() == 2 else "F32"]
        data = w.numpy().astype(np.float32)
        if kind != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(data, kind)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_gguf_file_holds_the_checkpoint_and_gives_its_output(
    models, hf_outputs, tmp_path, arch
) -> None:
    """transformers' own GGUF loading cannot be the reference: it takes Gemma 2's soft-caps
    and every query scale from its config defaults (50, 30, 256), not from the file. The
    reference is the checkpoint the file was written from."""
    hf_dir = models[arch]
    file = write_gemma_gguf(hf_dir, tmp_path / "m.gguf")
    if arch == "gemma3":  # not llama.cpp's default pattern: the file must state this one
        with pytest.raises(AssertionError, match="layer_types"):
            _assert_same_model(file, hf_dir)
        config = json.loads((hf_dir / "config.json").read_text())
        sliding = [t == "sliding_attention" for t in config["layer_types"]]
        file = write_gemma_gguf(hf_dir, tmp_path / "p.gguf", pattern=sliding)
    _assert_same_model(file, hf_dir)
    with engine(file) as llm:
        assert greedy_token_ids(llm, prompts(), MAX_NEW) == hf_outputs[arch]


def _assert_same_model(file: Path, hf_dir: Path) -> None:
    """The same weights (a norm's ``1 + weight`` bit for bit) and the same settings."""
    want = load_model(hf_dir, torch.float32, "cpu", use_cpu_kernels=False)
    got = load_model(file, torch.float32, "cpu", use_cpu_kernels=False)
    for key in ("query_pre_attn_scalar", "sliding_window", "layer_types", "num_hidden_layers",
                "attn_logit_softcapping", "final_logit_softcapping"):  # fmt: skip
        assert getattr(got.hf_config, key) == getattr(want.hf_config, key), key
    for layer_type in ("sliding_attention", "full_attention"):
        assert torch.equal(gemma.rope_of(got.hf_config, layer_type)[0],
                           gemma.rope_of(want.hf_config, layer_type)[0])  # fmt: skip
    params = dict(got.named_parameters())
    assert params.keys() == dict(want.named_parameters()).keys()
    for name, p in want.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(1.0 + params[name], 1.0 + p), name
        else:
            assert torch.equal(params[name], p), name


def test_gguf_metadata_the_reader_derives(models, tmp_path) -> None:
    """llama.cpp's rules where a file says nothing: Gemma 2's window 4096 and caps 50 / 30,
    every other layer sliding; Gemma 3 every sixth layer global, its sliding layers' rope
    base 10000; the query scale from the head size, or ``attention.scale``; an int pattern."""
    from specbatch.model.checkpoint import read_checkpoint

    g2 = write_gemma_gguf(models["gemma2"], tmp_path / "a.gguf", bare=True)
    cfg = read_checkpoint(g2).hf_config
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2
    assert (cfg.query_pre_attn_scalar, cfg.sliding_window) == (16, 4096)
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
    g2 = write_gemma_gguf(models["gemma2"], tmp_path / "s.gguf", scale=0.125)
    assert read_checkpoint(g2).hf_config.query_pre_attn_scalar == 64
    g3 = write_gemma_gguf(models["gemma3"], tmp_path / "b.gguf", pattern=3)
    cfg = read_checkpoint(g3).hf_config
    assert cfg.layer_types == ["sliding_attention"] * 2 + ["full_attention", "sliding_attention"]
    assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert cfg.final_logit_softcapping is None and cfg.attn_logit_softcapping is None


# ---- entry points ---------------------------------------------------------------------------


def test_cli_and_server_run_gemma(models, make_checkpoint, tmp_path) -> None:
    assert_cli_and_server_run(models["gemma2"], make_checkpoint, tmp_path)


# ---- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"},
         r"architecture 'Gemma3ForConditionalGeneration' is not supported \(a multimodal "
         r"model.*supported: .*Gemma2ForCausalLM, Gemma3ForCausalLM"),
        ({"architectures": ["GemmaForCausalLM"], "model_type": "gemma"},
         r"architecture 'GemmaForCausalLM' is not supported; supported: "),
        ({"hidden_activation": "gelu"},
         r"hidden_activation 'gelu' is not supported for Gemma2ForCausalLM"),
        ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention",
                          "full_attention"]}, "layer_types must list"),
        ({"query_pre_attn_scalar": -1}, "'query_pre_attn_scalar' must be a positive number"),
        ({"attn_logit_softcapping": "x"}, "'attn_logit_softcapping' must be a positive number"),
    ],
)  # fmt: skip
def test_bad_configs_name_what_is_wrong(models, tmp_path, changes, message) -> None:
    path = with_config(models["gemma2"], tmp_path / "m", **changes)
    with pytest.raises(InvalidInputError, match=message):
        load_model(path, torch.float32, "cpu")


def test_bad_gemma3_settings(models, tmp_path) -> None:
    rope = {"full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6,
                               "original_max_position_embeddings": 64},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}  # fmt: skip
    path = with_config(models["gemma3"], tmp_path / "m", rope_parameters=rope)
    with pytest.raises(InvalidInputError, match="rope_type 'yarn' of the full_attention layers"):
        load_model(path, torch.float32, "cpu")
    path = with_config(models["gemma3"], tmp_path / "b" / "m", use_bidirectional_attention=True)
    with pytest.raises(InvalidInputError, match="use_bidirectional_attention"):
        load_model(path, torch.float32, "cpu")


def test_other_attention_backends_are_refused(models) -> None:
    with pytest.raises(InvalidInputError, match=r"attention_backend 'cpu' cannot run this "
                       r"model: Gemma2ForCausalLM's attention soft-capping"):  # fmt: skip
        engine(models["gemma2"], attention_backend="cpu")
    with pytest.raises(InvalidInputError, match=r"batch_invariant .*Gemma3ForCausalLM"):
        engine(models["gemma3"], batch_invariant=True)


def test_unknown_gguf_architecture_lists_gemma(models, tmp_path) -> None:
    file = write_gemma_gguf(models["gemma2"], tmp_path / "m.gguf")
    raw = bytearray(file.read_bytes())
    at = raw.find(b"gemma2", raw.find(b"general.architecture"))
    raw[at : at + 6] = b"gemmaX"
    file.write_bytes(bytes(raw))
    with pytest.raises(InvalidInputError, match=r"'gemmaX' is not supported; supported: .*gemma2"):
        load_model(file, torch.float32, "cpu")


# ---- planted bugs are caught ------------------------------------------------------------------


@pytest.fixture
def planted(monkeypatch) -> Iterator[Callable[[str], None]]:
    def plant(bug: str) -> None:
        if bug == "attention softcap skipped":
            real = wa.window_attention

            def no_cap(*a: Any, softcap: float | None = None, **kw: Any) -> torch.Tensor:
                return real(*a, softcap=None, **kw)

            monkeypatch.setattr(gemma, "window_attention", no_cap)
        elif bug == "final softcap skipped":
            monkeypatch.setattr(gemma.GemmaForCausalLM, "compute_logits",
                                lambda self, h: self.lm_head(h))  # fmt: skip
        elif bug == "sliding layer sees past its window":
            real = wa.window_attention

            def wide(*a: Any, window: int | None = None, **kw: Any) -> torch.Tensor:
                return real(*a, window=None if window is None else window + 1, **kw)

            monkeypatch.setattr(gemma, "window_attention", wide)
        elif bug == "embedding unscaled":
            monkeypatch.setattr(gemma.GemmaModel, "embed", lambda self, ids: self.embed_tokens(ids))
        elif bug == "norm weight without the 1":
            monkeypatch.setattr(gemma.GemmaRMSNorm, "forward", lambda self, x: (
                x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
                * self.weight.float()).to(x.dtype))  # fmt: skip
        else:
            raise ValueError(bug)

    yield plant


@pytest.mark.parametrize(
    "bug",
    ["attention softcap skipped", "final softcap skipped", "sliding layer sees past its window",
     "embedding unscaled", "norm weight without the 1"],
)  # fmt: skip
def test_planted_bugs_move_the_logits_off_transformers(models, planted, bug) -> None:
    """Each bug, planted, makes the logits test above fail: the checkpoints and prompts are
    sensitive to every Gemma specific."""
    planted(bug)
    model = load_model(models["gemma2"], torch.float32, "cpu")
    tokens, ours = schedule_logits(model)
    assert worst_logprob_gap(ours, hf_logits(models["gemma2"], tokens)) > 1e-2
