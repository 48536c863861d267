"""Where speculation pays for a mixture of experts and for its dense twin, batch 1 to 64.

Two tiny random targets of equal active parameters: a Mixtral (``--experts`` experts, top
``--top-k``, each of intermediate size ``--expert-size``) and a Llama whose MLP is ``top_k``
experts wide, the rest alike (layers, attention, vocabulary). Each has a draft made of its own
first layer (embedding, layer 0, final norm and head), and its later layers add only a fraction
(``--late``) to the residual stream, so that the draft agrees with its target often. Both run
``specbatch bench``'s grid (``bench/offline.py``: plain and ``--gamma`` drafts side by side at
each batch size, greedy, random prompts), in bfloat16.

Per cell, beside the measured speedup, THEORY.md's prediction from the measured alpha and c
with a verify cost that counts woken experts: a step reads the weights every step reads plus
each woken expert's once; ``r`` rows each taking ``k`` of ``E`` experts uniformly wake
``E (1 - (1 - k/E)^r)`` of a layer's experts, ``B`` rows in a plain step and ``B (gamma + 1)``
in a verify pass (``theory.moe_verify_cost``; the dense twin's is 1). Next to it the measured
verify cost (target time per speculative step over the plain step's). Prints a table, writes
JSON.

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/moe_speculation.py \
        [--batch-sizes 1 4 16 64] [--gamma 3] [--output-len 32]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_expert_args, fmt, format_table, machine_info, run_main


def save_target(config: Any, out: Path, late: float, seed: int) -> Path:
    """A random model of ``config`` in bfloat16 whose layers after the first add ``late``
    times their usual share to the residual stream."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
            later = ".layers.0." not in name and ".layers." in name
            if later and any(k in name for k in ("o_proj", "down_proj", "w2")):
                p.mul_(late)
    model.to(torch.bfloat16).save_pretrained(out)
    return out


def first_layer(target: Path, out: Path) -> Path:
    """The target cut to its first layer (embedding, layer 0, final norm, head)."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(target / "model.safetensors"))
    kept = {k: v for k, v in tensors.items() if ".layers." not in k or ".layers.0." in k}
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def weight_bytes(target: Path) -> tuple[float, float]:
    """Bytes a step reads whatever the routing (every tensor but the experts', the embedding
    counted at none: a step reads only its rows) and one expert's bytes over all layers."""
    from safetensors import safe_open

    fixed = per_expert = 0.0
    with safe_open(str(target / "model.safetensors"), "pt") as f:
        for k in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            t = f.get_slice(k)
            nbytes = math.prod(t.get_shape()) * 2  # bfloat16
            if ".experts." in k:
                per_expert += nbytes
            elif "embed_tokens" not in k:
                fixed += nbytes
    experts = json.loads((target / "config.json").read_text()).get("num_local_experts") or 1
    return fixed, per_expert / experts


def build_pair(root: Path, kind: str, args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    shape = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                 num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
                 max_position_embeddings=512, tie_word_embeddings=False)  # fmt: skip
    if kind == "moe":
        config = transformers.MixtralConfig(
            architectures=["MixtralForCausalLM"], intermediate_size=args.expert_size,
            num_local_experts=args.experts, num_experts_per_tok=args.top_k, **shape,
        )  # fmt: skip
    else:
        config = transformers.LlamaConfig(
            architectures=["LlamaForCausalLM"], intermediate_size=args.top_k * args.expert_size,
            **shape,
        )  # fmt: skip
    target = save_target(config, root / kind, args.late, args.seed)
    fixed, expert = weight_bytes(target)
    return {"target": target, "draft": first_layer(target, root / f"{kind}-draft"),
            "fixed_bytes": fixed, "expert_bytes": expert}  # fmt: skip


def predictions(cell: dict[str, Any], kind: str, pair: dict[str, Any], args: argparse.Namespace):
    """THEORY's woken-expert verify cost and the speedup it predicts for a speculative cell."""
    from specbatch.theory import expected_tokens_per_round, moe_verify_cost

    gamma = cell["mean_draft_length"] or args.gamma
    if kind == "moe":
        verify = moe_verify_cost(cell["batch_size"], gamma, args.experts, args.top_k,
                                 pair["fixed_bytes"], pair["expert_bytes"])  # fmt: skip
    else:
        verify = 1.0
    speedup = None
    if cell["alpha"] is not None and cell["cost_ratio"] is not None:
        tokens = expected_tokens_per_round(cell["alpha"], gamma)
        speedup = tokens / (gamma * cell["cost_ratio"] + verify)
    return verify, speedup


def run(args: argparse.Namespace) -> dict[str, Any]:
    from specbatch.bench.bench_config import BenchConfig
    from specbatch.bench.offline import run_bench
    from specbatch.theory import expected_woken_experts

    out: dict[str, Any] = {"config": vars(args), "machine": machine_info(), "models": {}}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("moe", "dense"):
            pair = build_pair(Path(tmp), kind, args)
            cfg = BenchConfig(
                model=str(pair["target"]), draft_model=str(pair["draft"]),
                batch_sizes=list(args.batch_sizes), draft_lengths=[0, args.gamma],
                input_len=args.input_len, output_len=args.output_len, output_len_spread=0.0,
                num_requests=args.num_requests, seed=args.seed,
                engine_kwargs={"dtype": "bfloat16", "num_kv_blocks": args.kv_blocks},
            )  # fmt: skip
            result = run_bench(cfg, progress=not args.quiet)
            cells = [c.to_dict() for c in result.cells]
            for c in cells:
                if c["draft"] == "0":
                    continue
                verify, predicted = predictions(c, kind, pair, args)
                c["predicted_verify_cost_woken"] = verify
                c["predicted_speedup_woken"] = predicted
                b, g = c["batch_size"], c["mean_draft_length"] or args.gamma
                woken: tuple[Any, Any] = ("-", "-")
                if kind == "moe":
                    e, k = args.experts, args.top_k
                    woken = (expected_woken_experts(b, e, k),
                             expected_woken_experts(b * (g + 1), e, k))  # fmt: skip
                rows.append([kind, b, c["alpha"], c["cost_ratio"], fmt(woken[0], 1),
                             fmt(woken[1], 1), c["verify_ratio"], verify, c["measured_speedup"],
                             c["predicted_speedup"], predicted])  # fmt: skip
            out["models"][kind] = {
                "fixed_bytes": pair["fixed_bytes"], "expert_bytes": pair["expert_bytes"],
                "cells": cells,
            }  # fmt: skip
    headers = ["model", "B", "alpha", "c", "woken plain", "woken verify", "verify (meas)",
               "verify (woken)", "speedup", "pred (verify 1)", "pred (woken)"]  # fmt: skip
    print(format_table(headers, [[fmt(x) if isinstance(x, float) else x for x in r]
                                 for r in rows]))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--gamma", type=int, default=3)
    add_expert_args(p, expert_size=1024)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--late", type=float, default=0.3, help="later layers' residual share")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--kv-blocks", type=int, default=2048)
    p.add_argument("--quiet", action="store_true")
    return run_main(p, argv, run, "moe_speculation")


if __name__ == "__main__":
    raise SystemExit(main())
