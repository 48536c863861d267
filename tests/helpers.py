"""Test utilities: reference generations and exact sequence distributions from transformers."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import torch

from specbatch.model.layers.attention import AttentionMetadata
from specbatch.worker.sampler import SamplingTensors, logits_to_probs


def hf_model(path: Path | str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def greedy_token_ids(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """``llm``'s greedy outputs of ``prompts`` (token ids), checking every KV block came back."""
    from specbatch import SamplingParams

    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        use_tqdm=False,
    )
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
    return [o.outputs[0].token_ids for o in outs]


@torch.inference_mode()
def hf_greedy(path: Path | str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy ``generate``, one prompt at a time (no padding effects)."""
    model = hf_model(path)
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        outs.append(out[0, len(p) :].tolist())
    return outs


def exactness_target(make_checkpoint, vocab: int) -> Path:
    """The tiny Llama the exactness tests enumerate outputs of (every token content: no EOS)."""
    return make_checkpoint(
        "llama",
        vocab_size=vocab,
        hidden_size=32,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        seed=7,
        max_position_embeddings=64,
        eos_token_id=None,
    )


def make_perturbed_draft(target: Path | str, out_dir: Path, noise: float, seed: int = 0) -> Path:
    """A draft that resembles the target: its weights plus Gaussian noise (relative scale
    ``noise``), so acceptance is high but not 1 and every path of the sampler is exercised."""
    model = hf_model(target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std().clamp_min(1e-3))
    model.save_pretrained(out_dir)
    return out_dir


@torch.inference_mode()
def exact_joint(
    path: Path | str,
    prompt: list[int],
    n_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_mass: float = 0.0,
    penalties: dict | None = None,
) -> dict[tuple[int, ...], float]:
    """P(first ``n_tokens`` generated tokens) of plain sampling from the target, computed by
    enumerating continuations with transformers' logits under the request's transforms
    (``penalties``: ``reference_penalties``' keywords, applied first).
    Branches below ``min_mass`` are dropped (their total is negligible for the tests)."""
    model = hf_model(path)
    frontier: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(n_tokens):
        seqs = list(frontier)
        ids = torch.tensor([prompt + list(s) for s in seqs])
        logits = model(ids).logits[:, -1].float()
        if penalties is not None:
            logits = torch.stack(
                [
                    reference_penalties(row, prompt, list(s), **penalties)
                    for row, s in zip(logits, seqs)
                ]
            )
        n = len(seqs)
        st = SamplingTensors.from_lists([temperature] * n, [top_k] * n, [top_p] * n, [0.0] * n)
        probs = logits_to_probs(logits, st)
        nxt: dict[tuple[int, ...], float] = {}
        for s, row in zip(seqs, probs.tolist()):
            base = frontier[s]
            for tok, pr in enumerate(row):
                mass = base * pr
                if mass >= min_mass:
                    nxt[(*s, tok)] = mass
        frontier = nxt
    total = sum(frontier.values())
    return {s: m / total for s, m in frontier.items()}


def reference_penalties(
    logits: torch.Tensor,
    prompt: list[int],
    output: list[int],
    presence: float = 0.0,
    frequency: float = 0.0,
    repetition: float = 1.0,
    min_tokens: int = 0,
    banned: tuple[int, ...] = (),
) -> torch.Tensor:
    """vLLM's and OpenAI's penalties written out token by token, as an independent reference:
    min_tokens bans ``banned`` while fewer than min_tokens were generated; transformers'
    repetition rule over prompt and output; presence and frequency over the output."""
    out = logits.clone().tolist()
    for t in range(len(out)):
        if len(output) < min_tokens and t in banned:
            out[t] = float("-inf")
            continue
        if t in prompt or t in output:
            out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
        count = output.count(t)
        out[t] -= frequency * count + (presence if count else 0.0)
    return torch.tensor(out, dtype=torch.float32)


def all_sequences(vocab: int, n: int) -> list[tuple[int, ...]]:
    return list(itertools.product(range(vocab), repeat=n))


def shuffled_block_tables(
    blocks_needed: list[int], spare: int, rng: random.Random
) -> tuple[list[list[int]], int]:
    """Block tables of ``blocks_needed`` blocks each, drawn without overlap from a shuffled
    pool with ``spare`` blocks left over (so physical ids are neither contiguous nor in
    order); and the pool's size."""
    num_blocks = sum(blocks_needed) + spare
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, used = [], 0
    for n in blocks_needed:
        tables.append(ids[used : used + n])
        used += n
    return tables, num_blocks


def random_paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    hq: int,
    hkv: int,
    d: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    AttentionMetadata,
    list[list[int]],
]:
    """One ragged attention forward on random data: q/k/v of the new tokens, caches holding
    random earlier context (NaN in every unused slot), shuffled non-contiguous block tables,
    the metadata, and the tables."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    tables, num_blocks = shuffled_block_tables([-(-s // block_size) for s in seq_lens], 3, rng)
    k_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    for q_len, s_len, table in zip(query_lens, seq_lens, tables, strict=True):
        for p in range(s_len - q_len):  # earlier context, already cached
            k_cache[table[p // block_size], p % block_size] = torch.randn(hkv, d, generator=gen)
            v_cache[table[p // block_size], p % block_size] = torch.randn(hkv, d, generator=gen)
    t = sum(query_lens)
    q = torch.randn(t, hq, d, generator=gen).to(dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype)
    meta = AttentionMetadata.from_lists(query_lens, seq_lens, tables, block_size)
    return q, k, v, k_cache, v_cache, meta, tables


def assert_full_vocab_head_has_no_d2t(head: Path) -> None:
    """A head whose draft vocabulary is the target's says so by having no d2t: vLLM refuses
    to load a d2t when draft_vocab_size equals the target's vocabulary."""
    from safetensors import safe_open

    cfg = json.loads((head / "config.json").read_text())
    assert cfg["draft_vocab_size"] == cfg["vocab_size"]
    with safe_open(str(head / "model.safetensors"), "pt") as f:
        assert "d2t" not in set(f.keys())
