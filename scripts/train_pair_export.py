"""Export for scripts/train_pair.py: bf16 HF checkpoints, final held-out metrics, training.json.

The final metrics are measured on the exported bf16 weights (upcast to float32, no autocast), i.e.
on exactly what ships, over the held-out files only.
"""

from __future__ import annotations

import inspect
import json
import platform
import sys
import time
from pathlib import Path

import torch
import train_pair_train as tr

PROMPT = 'import os\nimport sys\n\n\ndef main(argv):\n    """'


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def save_hf(model, tokenizer, path: Path, eot: int):
    from transformers import GenerationConfig

    path.mkdir(parents=True, exist_ok=True)
    m = model.to("cpu").to(torch.bfloat16)
    m.config.dtype = "bfloat16"
    m.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)
    m.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))


@torch.no_grad()
def decode_step_ms(model, context: int, steps: int, seed: int) -> float:
    """Median wall time of one batch-1 decode step with a KV cache after a ``context`` prompt."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    # transformers renamed ``past_key_values`` to ``cache`` in 5.x; accept either.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=torch.randint(0, vocab, (1, context), generator=g), use_cache=True)
    cache = getattr(out, name)
    tok = torch.randint(0, vocab, (1, 1), generator=g)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        out = model(input_ids=tok, use_cache=True, **{name: cache})
        times.append(time.perf_counter() - t)
        cache = getattr(out, name)
    times.sort()
    return 1000 * times[len(times) // 2]


@torch.no_grad()
def sample(model, tokenizer, seed: int, n: int, temperature: float) -> str:
    torch.manual_seed(seed)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    eot = tokenizer.eos_token_id
    ids = torch.cat([torch.tensor([[eot]]), ids], dim=1)
    room = model.config.max_position_embeddings - ids.shape[1]
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max(1, min(n, room)),
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
    )
    return tokenizer.decode(out[0, 1:], skip_special_tokens=False)


def export(args, target, draft, tck, dck, meta, heldout_ids, device, log, t_start):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    t0 = time.time()
    exp: Path = args.export_dir
    tokenizer = AutoTokenizer.from_pretrained(str(args.out / "tokenizer"))
    eot = meta["tokenizer"]["eot_id"]
    params = {"target": tr.count_params(target), "draft": tr.count_params(draft)}
    save_hf(target, tokenizer, exp / "target", eot)
    save_hf(draft, tokenizer, exp / "draft", eot)
    log(f"export: wrote {exp}/target and {exp}/draft (bf16)")

    # Reload what was written, as a user would, and measure on it (float32 compute).
    models = {
        who: AutoModelForCausalLM.from_pretrained(str(exp / who), dtype=torch.float32).eval()
        for who in ("target", "draft")
    }
    windows = tr.eval_windows(heldout_ids, args.seq_len, args.final_eval_windows)
    for m in models.values():
        m.to(device)

    def final_eval(w):
        return tr.evaluate(models["target"], models["draft"], w, args.batch_size, device, amp=False)

    if args.adaptive_threads and device.type == "cpu":
        threads = tr.pick_threads(lambda: final_eval(windows[:1]), args.threads)
        log(f"export: evaluating with {threads} thread(s)")
    final = final_eval(windows)
    log(f"export: final held-out eval (bf16 weights, fp32 compute) {final}")
    for m in models.values():
        m.to("cpu")
    # Batch-1 decode is latency-bound: measured on one thread, which is also what a loaded
    # shared machine gives reliably.
    torch.set_num_threads(1)
    steps = 20 if args.tiny else 200
    ctx = min(128, args.context - steps - 1)
    ms = {who: decode_step_ms(m, ctx, steps, args.seed) for who, m in models.items()}
    torch.set_num_threads(args.threads)
    cost = {
        "target_decode_ms": round(ms["target"], 3),
        "draft_decode_ms": round(ms["draft"], 3),
        "c": round(ms["draft"] / ms["target"], 4),
        "param_ratio": round(params["draft"] / params["target"], 4),
        "how": "transformers LlamaForCausalLM, CPU float32, 1 thread, batch 1, one-token "
        f"decode step with KV cache after a {ctx}-token prompt, median of {steps}",
    }
    log(f"export: cost ratio {cost}")
    n_sample = 40 if args.tiny else 200
    samples = {who: sample(m, tokenizer, args.seed, n_sample, 0.8) for who, m in models.items()}
    for who, text in samples.items():
        (exp / f"sample_{who}.txt").write_text(text)
        log(f"export: {who} sample (T=0.8):\n{text}\n{'-' * 60}")

    def phase_info(ck, lr):
        hist = ck["history"]
        return {
            "finished": bool(ck["done"]),
            "steps": ck["step"],
            "tokens": ck["tokens"],
            "epochs": round(ck["tokens"] / max(1, meta["train_tokens"]), 3),
            "wall_s": round(ck["elapsed"], 1),
            "hyperparameters": ck["hp"],
            "peak_lr": lr,
            "last_eval": hist[-1] if hist else None,
            "eval_history": hist,
            "invocations": ck["invocations"],
        }

    weights = {who: (exp / who / "model.safetensors").stat().st_size for who in ("target", "draft")}
    info = {
        "what": "specbatch built-in target/draft pair, trained from scratch on the Python stdlib",
        "command": " ".join([sys.executable, *sys.argv]),
        "seed": args.seed,
        "seeds": {
            "target_init": args.seed,
            "draft_init": args.seed + 7,
            "target_batches": args.seed + 1,
            "draft_batches": args.seed + 2,
        },
        "data": {k: v for k, v in meta.items() if k != "tokenizer"},
        "tokenizer": meta["tokenizer"],
        "models": {
            who: {
                "architecture": "LlamaForCausalLM",
                "sizes": args.sizes[who],
                "vocab_size": meta["tokenizer"]["vocab_size"],
                "context": args.context,
                "params": params[who],
                "safetensors_bytes": weights[who],
                "dir_bytes": dir_bytes(exp / who),
            }
            for who in ("target", "draft")
        },
        "total_bytes": dir_bytes(exp / "target") + dir_bytes(exp / "draft"),
        "training": {
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "optimizer": "AdamW(betas=(0.9, 0.95), wd on matrices), warmup + cosine to 10%",
            "bf16_autocast": args.amp != "off" and not (args.tiny and args.amp == "auto"),
            "device": str(device),
            "threads": args.threads,
            "adaptive_threads": args.adaptive_threads,
            "target": phase_info(tck, args.target_lr),
            "draft": phase_info(dck, args.draft_lr),
            "draft_loss": {
                "kl_p_q": args.kl_weight,
                "tv": args.tv_weight,
                "ce_data": args.ce_weight,
            },
        },
        "eval": {
            "data": "held-out files only",
            "weights": "exported bf16, computed in float32",
            "temperature": 1.0,
            **final,
            "alpha_definition": "mean over positions of sum_x min(p(x), q(x))",
            "greedy_definition": "fraction of positions with argmax q == argmax p",
        },
        "cost_ratio": cost,
        "samples": {"prompt": PROMPT, "temperature": 0.8, **samples},
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "tokenizers": __import__("tokenizers").__version__,
        },
        "export_wall_s": round(time.time() - t0, 1),
        "wall_s_this_invocation": round(time.time() - t_start, 1),
        "wall_s_total_training": round(tck["elapsed"] + dck["elapsed"], 1),
    }
    (exp / "training.json").write_text(json.dumps(info, indent=1))
    log(
        f"export: target {params['target']} params, draft {params['draft']} params, "
        f"{info['total_bytes']} bytes in all; alpha {final['alpha']}, greedy {final['greedy']}, "
        f"c {cost['c']}; wrote {exp / 'training.json'}"
    )
    return info
