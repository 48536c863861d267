"""Tiny random EAGLE heads written in the layouts their authors publish (see model/eagle.py), for
tests: EAGLE-1 (``fc`` over [embedding; feature], ``layers.0.*``) and EAGLE-3 (``fc`` over three
of the target's residual streams, ``midlayer.*``, ``norm``, its own ``lm_head`` and ``d2t``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def make_eagle_head(
    out_dir: str | Path,
    target_dir: str | Path,
    layout: str = "eagle",
    *,
    seed: int = 0,
    with_embedding: bool = False,
    draft_vocab_size: int | None = None,
    scale: float = 1.0,
) -> Path:
    """A random head for the checkpoint at ``target_dir`` (same hidden size and heads)."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    h, vocab = target["hidden_size"], target["vocab_size"]
    heads, kv = (
        target["num_attention_heads"],
        target.get("num_key_value_heads", target["num_attention_heads"]),
    )
    d = target.get("head_dim") or h // heads
    inter = target["intermediate_size"]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, fan_in: int | None = None) -> torch.Tensor:
        std = scale / (fan_in or shape[-1]) ** 0.5
        return torch.randn(*shape, generator=gen) * std

    layer = "layers.0." if layout == "eagle" else "midlayer."
    attn_in = h if layout == "eagle" else 2 * h
    tensors: dict[str, torch.Tensor] = {
        f"{layer}self_attn.q_proj.weight": rand(heads * d, attn_in),
        f"{layer}self_attn.k_proj.weight": rand(kv * d, attn_in),
        f"{layer}self_attn.v_proj.weight": rand(kv * d, attn_in),
        f"{layer}self_attn.o_proj.weight": rand(h, heads * d),
        f"{layer}mlp.gate_proj.weight": rand(inter, h),
        f"{layer}mlp.up_proj.weight": rand(inter, h),
        f"{layer}mlp.down_proj.weight": rand(h, inter),
        f"{layer}post_attention_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
        f"{layer}input_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
    }
    config: dict[str, Any] = {
        key: target[key]
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size",
                    "rms_norm_eps", "max_position_embeddings", "rope_theta", "bos_token_id",
                    "eos_token_id", "head_dim")
        if key in target
    }  # fmt: skip
    config.update(
        model_type="llama", num_hidden_layers=1, num_key_value_heads=kv, torch_dtype="float32"
    )
    if layout == "eagle":
        tensors["fc.weight"] = rand(h, 2 * h)
        config["architectures"] = ["LlamaForCausalLM"]
    else:
        draft_vocab = draft_vocab_size or vocab
        tensors["fc.weight"] = rand(h, 3 * h)
        tensors[f"{layer}hidden_norm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
        tensors["norm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
        tensors["lm_head.weight"] = rand(draft_vocab, h) * 2.0
        # the draft vocabulary: the target's first ids, then every other one of the rest
        first = vocab - 2 * (vocab - draft_vocab)
        if not 0 <= first <= draft_vocab:
            raise ValueError(f"draft_vocab_size must be in [{vocab // 2}, {vocab}]")
        ids = torch.cat([torch.arange(first), torch.arange(first, vocab, 2)])
        tensors["d2t"] = ids - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
        config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab)
    if with_embedding:
        tensors["embed_tokens.weight"] = rand(vocab, h) * 2.0
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
