"""The Llama-family model and its loader against transformers, through the paged KV cache."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from specbatch.distributed.parallel_state import SINGLE, TensorParallelGroup
from specbatch.errors import InvalidInputError
from specbatch.model.checkpoint import load_hf_config
from specbatch.model.layers.attention import AttentionMetadata
from specbatch.model.llama import LlamaForCausalLM
from specbatch.model.loader import load_model
from tests.helpers import shuffled_block_tables

BLOCK_SIZE = 4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "llama-rope-llama3": ("llama", {"rope_scaling": LLAMA3_ROPE}),
    "llama-rope-yarn": ("llama", {"rope_scaling": YARN_ROPE, "rope_theta": 5000.0}),
    "llama-biases-mqa": ("llama", {"attention_bias": True, "mlp_bias": True, "num_kv_heads": 1}),
    "qwen3-head-dim-32": ("qwen3", {"head_dim": 32, "num_kv_heads": 4}),
}

# Per step, how many new tokens each of the five sequences feeds (0 = not scheduled that step).
# Step 0 is the ragged prefill: four whole prompts and the first chunk of sequence 1 and 4.
# Later steps mix prompt chunks (9, and a long 20-token chunk on top of context), one-token
# decodes and 2-3 token verification. REJECT_AFTER marks a step after which every scheduled
# sequence feeds 3 wrong tokens that are then rolled back, as after rejected speculation.
SCHEDULE = [
    [7, 10, 1, 12, 5],
    [1, 9, 3, 1, 20],
    [3, 1, 1, 3, 1],
    [1, 3, 3, 1, 3],
    [3, 3, 1, 3, 0],
    [1, 2, 1, 1, 1],
]
REJECT_AFTER = {2, 4}


def _block_tables(lengths: list[int], rng: random.Random) -> tuple[list[list[int]], int]:
    need = [-(-(n + 3) // BLOCK_SIZE) for n in lengths]  # +3: room for the rejected tokens
    return shuffled_block_tables(need, 2, rng)


def run_schedule(
    model: LlamaForCausalLM, tokens: list[torch.Tensor], schedule: list[list[int]], seed: int = 0
) -> list[torch.Tensor]:
    """Feed each sequence's tokens step by step through the paged cache; return, per sequence,
    the logits at every position ``[len, vocab]``."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lengths = [len(t) for t in tokens]
    tables, num_blocks = _block_tables(lengths, rng)
    caches = model.allocate_kv_caches(num_blocks, BLOCK_SIZE)
    done = [0] * len(tokens)
    logits: list[list[torch.Tensor]] = [[] for _ in tokens]

    def forward(batch: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        q_lens = [len(ids) for _, ids in batch]
        seq_lens = [done[b] + len(ids) for b, ids in batch]
        meta = AttentionMetadata.from_lists(
            q_lens, seq_lens, [tables[b] for b, _ in batch], BLOCK_SIZE
        )
        positions = torch.cat([torch.arange(done[b], done[b] + len(ids)) for b, ids in batch])
        ids = torch.cat([ids for _, ids in batch])
        return model.compute_logits(model(ids, positions, caches, meta))

    for step, q_lens in enumerate(schedule):
        batch = [(b, tokens[b][done[b] : done[b] + n]) for b, n in enumerate(q_lens) if n > 0]
        out = forward(batch)
        row = 0
        for b, ids in batch:
            logits[b].append(out[row : row + len(ids)])
            row += len(ids)
            done[b] += len(ids)
        if step in REJECT_AFTER:  # speculative tokens that all get rejected: not advanced
            wrong = [(b, torch.randint(3, model.vocab_size, (3,), generator=gen)) for b, _ in batch]
            forward(wrong)
    assert done == lengths
    return [torch.cat(chunks) for chunks in logits]


def hf_logits(path: Path, tokens: list[torch.Tensor]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return [hf(t[None]).logits[0].float() for t in tokens]


def random_tokens(lengths: list[int], vocab: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen) for n in lengths]


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers_prefill_and_paged_decode(
    case: str, make_checkpoint: Callable[..., Path]
) -> None:
    arch, kwargs = CASES[case]
    path = make_checkpoint(arch, **kwargs)
    model = load_model(path, torch.float32, "cpu")
    lengths = [sum(step[b] for step in SCHEDULE) for b in range(len(SCHEDULE[0]))]
    tokens = random_tokens(lengths, model.vocab_size)
    ours = run_schedule(model, tokens, SCHEDULE)
    ref = hf_logits(path, tokens)
    for b, (o, r) in enumerate(zip(ours, ref, strict=True)):
        assert o.dtype == torch.float32 and o.shape == r.shape
        torch.testing.assert_close(o, r, atol=1e-4, rtol=1e-4, msg=lambda m, b=b: f"seq {b}: {m}")
    # the random model is neither degenerate nor uniform
    probs = ref[1].softmax(-1)
    assert 0.02 < probs.max(-1).values.mean() < 0.9


def test_checkpoint_has_expected_files_and_is_deterministic(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    from specbatch.testing.checkpoints import make_random_checkpoint

    path = make_checkpoint("qwen2")
    again = make_random_checkpoint(tmp_path / "again", "qwen2")
    a, b = load_file(path / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "model.layers.0.self_attn.q_proj.bias" in a
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]


def test_tokenizer_checkpoint(tiny_llama_checkpoint: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_checkpoint)
    ids = tok("Hello world, the quick fox.")["input_ids"]
    assert max(ids) < 256 and tok.decode(ids) == "Hello world, the quick fox."
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1
    hf_config = load_hf_config(tiny_llama_checkpoint)
    assert hf_config.eos_token_id == tok.eos_token_id


def test_model_properties_and_cache_size(make_checkpoint: Callable[..., Path]) -> None:
    model = load_model(make_checkpoint("qwen3", head_dim=32, num_kv_heads=4), torch.float32, "cpu")
    assert (model.num_layers, model.num_kv_heads_local, model.head_dim) == (2, 4, 32)
    assert model.kv_cache_bytes_per_token() == 2 * 2 * 4 * 32 * 4
    assert model.kv_cache_bytes_per_token(torch.bfloat16) == 2 * 2 * 4 * 32 * 2
    assert model.sliding_window is None
    assert load_model(make_checkpoint("mistral"), torch.float32, "cpu").sliding_window == 4096
    windowed = make_checkpoint(
        "qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=0
    )
    assert load_model(windowed, torch.float32, "cpu").sliding_window == 64


def test_bfloat16_model(make_checkpoint: Callable[..., Path]) -> None:
    path = make_checkpoint("llama")
    model = load_model(path, torch.bfloat16, "cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    tokens = random_tokens([6, 3], model.vocab_size)
    ours = run_schedule(model, tokens, [[4, 2], [1, 1], [1, 0]])
    ref = hf_logits(path, tokens)
    for o, r in zip(ours, ref, strict=True):
        assert o.dtype == torch.float32
        assert (o - r).abs().max() < 0.25  # bf16 rounding through two layers


# --- loader errors -----------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match=r"model: path '.*nope' does not exist"):
        load_model(tmp_path / "nope", torch.float32, "cpu")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="is not a Hugging Face checkpoint directory"):
        load_hf_config(tmp_path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(
        tmp_path
    )
    with pytest.raises(
        InvalidInputError,
        match=r"model: architecture 'GPT2LMHeadModel' is not supported; supported: "
        r"LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM",
    ):
        load_model(tmp_path, torch.float32, "cpu")


def test_tp_size_must_divide_heads(make_checkpoint: Callable[..., Path]) -> None:
    path = make_checkpoint("llama")
    with pytest.raises(InvalidInputError, match=r"num_attention_heads=4 .*tensor_parallel_size=3"):
        load_model(path, torch.float32, "cpu", TensorParallelGroup(rank=0, size=3))
    with pytest.raises(InvalidInputError, match=r"num_key_value_heads=2 .*tensor_parallel_size=4"):
        load_model(path, torch.float32, "cpu", TensorParallelGroup(rank=0, size=4))


def test_no_safetensors(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((make_checkpoint("llama") / "config.json").read_text())
    with pytest.raises(InvalidInputError, match=r"no \*\.safetensors weights"):
        load_model(tmp_path, torch.float32, "cpu")


def test_missing_weight_is_named(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    src = make_checkpoint("qwen2")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    del tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(
        InvalidInputError,
        match=r"lacks 2 weight\(s\): model.layers.1.self_attn.k_proj.bias, model.norm.weight",
    ):
        load_model(tmp_path, torch.float32, "cpu")


def test_sharded_checkpoint_with_index(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    src = make_checkpoint("llama")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    parts = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, part in parts.items():
        save_file({n: tensors[n] for n in part}, tmp_path / file)
        weight_map.update(dict.fromkeys(part, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a = load_model(src, torch.float32, "cpu")
    b = load_model(tmp_path, torch.float32, "cpu")
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)


def test_wrong_shape_is_named(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    src = make_checkpoint("llama")
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(src / "model.safetensors")
    with pytest.raises(
        InvalidInputError,
        match=r"weight 'model.layers.0.mlp.(gate|up|down)_proj.weight' has shape .* implies",
    ):
        load_model(tmp_path, torch.float32, "cpu")


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_dynamic_rope_rejected(
    rope_type: str, make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    src = make_checkpoint("llama")
    config = json.loads((src / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = {"rope_type": rope_type, "factor": 2.0}
    if rope_type == "longrope":
        half = config["head_dim"] // 2
        config["rope_scaling"].update(short_factor=[1.0] * half, long_factor=[2.0] * half)
        config["rope_scaling"]["original_max_position_embeddings"] = 256
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(src / "model.safetensors")
    with pytest.raises(
        InvalidInputError,
        match=rf"rope_type '{rope_type}' is not supported.*"
        r"supported: default, linear, llama3, yarn",
    ):
        load_model(tmp_path, torch.float32, "cpu")


def test_single_group_is_default() -> None:
    assert SINGLE.size == 1 and SINGLE.rank == 0


# --- tensor parallelism over gloo (two CPU processes) ---------------------------------------

TP_CASES: list[tuple[str, dict[str, Any]]] = [
    # vocab 255 does not split evenly: the last rank's rows are padded
    ("llama", {"vocab_size": 255, "attention_bias": True, "mlp_bias": True}),
    ("qwen3", {"vocab_size": 255, "tie_word_embeddings": True, "attention_bias": True}),
]


def _tp_worker(rank: int, world: int, init_file: str, paths: list[str], out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        tp = TensorParallelGroup(rank=rank, size=world, group=dist.group.WORLD)
        results = []
        for path in paths:
            model = load_model(path, torch.float32, "cpu", tp)
            assert model.num_kv_heads_local == 2 // world
            lengths = [sum(step[b] for step in SCHEDULE) for b in range(len(SCHEDULE[0]))]
            results.append(run_schedule(model, random_tokens(lengths, 255), SCHEDULE))
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)
def test_tensor_parallel_2_matches_single(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """Each rank loads only its shard; logits (gathered on every rank) match the unsharded model."""
    import torch.multiprocessing as mp

    paths = [make_checkpoint(arch, **kwargs) for arch, kwargs in TP_CASES]
    args = (2, str(tmp_path / "init"), [str(p) for p in paths], str(tmp_path))
    # spawned, not forked: a fork copies the native threads other tests' engines left running
    # (which Python's thread count does not see), and a child exiting with them aborts
    ctx = mp.start_processes(_tp_worker, args=args, nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 180
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail("tensor-parallel workers did not finish within 180 s")
    rank0 = torch.load(tmp_path / "rank0.pt")
    rank1 = torch.load(tmp_path / "rank1.pt")
    for path, got0, got1 in zip(paths, rank0, rank1, strict=True):
        model = load_model(path, torch.float32, "cpu")
        lengths = [len(x) for x in got0]
        want = run_schedule(model, random_tokens(lengths, 255), SCHEDULE)
        for a, b, w in zip(got0, got1, want, strict=True):
            assert a.shape == w.shape == (w.shape[0], 255)
            torch.testing.assert_close(a, b, atol=0, rtol=0)
            torch.testing.assert_close(a, w, atol=1e-4, rtol=1e-4)
