"""scripts/train_eagle.py's export: the trained head in EAGLE-3's published layout (config.json
and model.safetensors, with d2t for a reduced draft vocabulary), which specbatch and vLLM load,
and its training.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def export_head(args, run: Path, cfg: dict, command: str, builtin: Path) -> tuple[Path, int]:
    """Writes the head of RUN/head.pt to --export (default RUN/export); returns where and its
    parameter count."""
    from safetensors.torch import save_file

    out = Path(args.export or run / "export")
    out.mkdir(parents=True, exist_ok=True)
    saved = torch.load(run / "head.pt", weights_only=True)
    info = json.loads((run / "features.json").read_text())
    sd = saved["head"]
    vocab = saved.get("vocab")
    names = {"fc.weight": "fc.weight", "norm": "norm.weight", "lm_head": "lm_head.weight"}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        names[norm] = f"midlayer.{norm}.weight"
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        names[f"{proj}.weight"] = f"midlayer.self_attn.{proj}.weight"
    for proj in ("gate_proj", "up_proj", "down_proj"):
        names[f"{proj}.weight"] = f"midlayer.mlp.{proj}.weight"
    tensors = {names[k]: v.to(torch.bfloat16).contiguous() for k, v in sd.items() if k in names}
    # A full draft vocabulary is the target's, id for id, which a head says by having no d2t
    # (vLLM refuses a d2t when draft_vocab_size equals the target's vocabulary).
    if vocab is not None:
        tensors["d2t"] = (vocab - torch.arange(len(vocab))).to(torch.int64)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    head_cfg = {k: cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                    "head_dim", "rms_norm_eps", "max_position_embeddings",
                                    "rope_parameters", "vocab_size", "bos_token_id", "eos_token_id")
                if k in cfg}  # fmt: skip
    head_cfg.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        num_hidden_layers=1,
        hidden_act="silu",
        intermediate_size=sd["gate_proj.weight"].shape[0],
        draft_vocab_size=len(vocab) if vocab is not None else cfg["vocab_size"],
        eagle_config={"eagle_aux_hidden_state_layer_ids": info["stream_ids"]},
        dtype="bfloat16",
    )
    (out / "config.json").write_text(json.dumps(head_cfg, indent=2, sort_keys=True) + "\n")
    meta = {
        "what": "EAGLE-3 head for the built-in target, trained with the target frozen",
        "commands": {"features": info["command"], "train": saved["command"], "export": command},
        "seed": args.seed,
        "target": Path(args.target).name if Path(args.target) == builtin else str(args.target),
        "data": "the target's stdlib training files (training.json) and, generated_tokens "
        "of them, the target's own continuations (temperature 1) of windows of those files; "
        "held-out files for eval",
        "stream_ids": info["stream_ids"],
        "train_tokens": info["train_tokens"],
        "features_seconds": info["seconds"],
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "steps": saved["steps"],
        "lr": args.lr,
        "unroll": args.unroll,
        "stream_noise": args.noise,
        "loss": f"KL(p||q) + TV(p,q), draft step k weighted {args.step_decay}^(k-1)",
        "final_loss": saved["loss"],
        "train_seconds": round(saved["seconds"], 1),
        "heldout_alpha_by_step": {str(s): a for s, a in saved["curve"]},
        "generated_tokens": info.get("generated_tokens", 0),
        "heldout_own_text_alpha_by_step": {str(s): a for s, a in saved.get("curve_generated", [])},
        "parameters": sum(v.numel() for v in tensors.values()),
        "torch": torch.__version__,
    }
    if "chat_data" in info:
        meta.update(chat_meta(info, saved, cfg, command))
    (out / "training.json").write_text(json.dumps(meta, indent=1) + "\n")
    return out, meta["parameters"]


def chat_meta(info: dict, saved: dict, cfg: dict, command: str) -> dict:
    """training.json's fields for a head self-distilled on chat answers."""
    answers = info["answers_meta"] or {}
    minutes = {"answers": answers.get("seconds", 0.0) / 60, "features": info["seconds"] / 60,
               "train": saved["seconds"] / 60}  # fmt: skip
    minutes["total"] = sum(minutes.values())
    size = len(saved["vocab"]) if saved.get("vocab") is not None else cfg["vocab_size"]
    return {
        "what": f"EAGLE-3 head for {cfg.get('_model_name_or_path') or 'the target'}, "
        "self-distilled on the target's own chat answers, the target frozen",
        "commands": {
            "answers": answers.get("command"),
            "features": info["command"],
            "train": saved["command"],
            "export": command,
        },
        "data": {
            "answers": info["chat_data"],
            "how": "instructions built from templates over stdlib source and docstrings and "
            "word lists (scripts/chat_instructions.py), answered by the target through "
            "specbatch (scripts/chat_answers.py); held-out conversations are of other kinds "
            "and material",
            "answers_meta": answers,
            "conversations": info["conversations"],
            "kinds": info["kinds"],
            "answer_tokens": info["answer_tokens"],
            "tokens_with_prompts": info["tokens"],
        },
        "draft_vocab_size": size,
        "draft_vocab_coverage": info["coverage"].get(str(size), [1.0, 1.0]),
        "draft_vocab_coverage_is": "share of the train and held-out answers' tokens inside it",
        "coverage_by_size": info["coverage"],
        "train_dtype": saved.get("train_dtype"),
        "minutes": {k: round(v, 1) for k, v in minutes.items()},
        "heldout_alpha": saved["curve"][-1][1] if saved["curve"] else None,
    }
