"""Train an EAGLE head for a frozen target (by default the built-in pair's) on the Python stdlib.

Phases (``--phase all`` runs them in order):
  features  the target's final hidden states over windows of the training files
            -> RUN/features.pt (tokens int16 [N, L], features bf16 [N, L, h])
  train     the head (EAGLE-1 layout: fc over [embedding; feature], one decoder layer), the
            target's embedding and LM head frozen, to match the target's next-token
            distribution: KL(p || q) + TV(p, q) + feature regression, unrolled --unroll draft
            steps with the attention each step has when drafting -> RUN/head.pt
  export    EXPORT/ (config.json + model.safetensors, the layout specbatch and vLLM load)
            and EXPORT/training.json
The training files are the stdlib files the target was trained on (``training.json`` beside
it, when there is one, else all but the held-out 5%); held-out files are only evaluated on.

  python scripts/train_eagle.py --out runs/eagle --export specbatch/assets/default_pair/eagle
  python scripts/train_eagle.py --tiny --target DIR --out /tmp/e --export /tmp/e/head  # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_pair_data as data

REPO = Path(__file__).resolve().parent.parent
BUILTIN = REPO / "specbatch" / "assets" / "default_pair" / "target"


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default=str(BUILTIN))
    p.add_argument("--out", required=True, help="run folder (features, checkpoints, log)")
    p.add_argument("--export", default=None, help="where to write the head (default RUN/export)")
    p.add_argument("--phase", default="all", choices=["features", "train", "export", "all"])
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=1_000_000, help="training tokens to featurise")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--minutes", type=float, default=None, help="stop training after this long")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--unroll", type=int, default=2, help="draft steps trained per position")
    p.add_argument("--noise", type=float, default=0.1, help="feature noise (x feature rms)")
    p.add_argument("--intermediate", type=int, default=None, help="head MLP (default: target's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tiny", action="store_true", help="a few files, short windows (smoke test)")
    return p.parse_args(argv)


def command() -> str:
    return " ".join(["python", "scripts/train_eagle.py", *sys.argv[1:]])


def log(run: Path, msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    with open(run / "train_eagle.log", "a") as f:
        f.write(line + "\n")


# ---- data and features ---------------------------------------------------------------------
def train_and_heldout_files(target: Path, tiny: bool):
    _, files = data.list_stdlib_files()
    meta_path = target.parent / "training.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())["data"]
        train_paths = set(meta["train_files"]["paths"])
        held_paths = set(meta["heldout_files"]["paths"])
        train = [f for f in files if f[0] in train_paths]
        held = [f for f in files if f[0] in held_paths]
    else:
        train, held = data.split_files(files, 5.0)
    if tiny:
        train, held = train[:6], held[:2]
    return train, held


def windows(stream: torch.Tensor, seq_len: int, max_tokens: int, seed: int) -> torch.Tensor:
    n = min(len(stream) // seq_len, max(1, max_tokens // seq_len))
    starts = torch.randperm(len(stream) - seq_len, generator=torch.Generator().manual_seed(seed))[
        :n
    ]
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


def load_target(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@torch.inference_mode()
def featurise(model, tokens: torch.Tensor, batch: int = 8) -> torch.Tensor:
    out = []
    for i in range(0, len(tokens), batch):
        x = tokens[i : i + batch].long()
        h = model.model(input_ids=x).last_hidden_state  # after the final norm
        out.append(h.to(torch.bfloat16))
    return torch.cat(out)


def phase_features(args, run: Path) -> None:
    from tokenizers import Tokenizer

    target = Path(args.target)
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    train, held = train_and_heldout_files(target, args.tiny)
    stream = torch.tensor(
        [t for enc in tok.encode_batch([t for _, t in train]) for t in enc.ids], dtype=torch.int64
    )
    held_stream = torch.tensor(
        [t for enc in tok.encode_batch([t for _, t in held]) for t in enc.ids], dtype=torch.int64
    )
    model = load_target(target)
    t0 = time.time()
    tr = windows(stream, args.seq_len, args.max_tokens, args.seed)
    ev = windows(
        held_stream,
        args.seq_len,
        16 * args.seq_len if not args.tiny else 2 * args.seq_len,
        args.seed + 1,
    )
    feats, ev_feats = featurise(model, tr), featurise(model, ev)
    torch.save({"tokens": tr.to(torch.int16), "features": feats, "eval_tokens": ev.to(torch.int16),
                "eval_features": ev_feats, "command": command(), "seconds": time.time() - t0},
               run / "features.pt")  # fmt: skip
    log(run, f"features: {tr.numel():,} train tokens ({len(train)} files), {ev.numel():,} "
             f"held-out ({len(held)} files), {time.time() - t0:.0f} s")  # fmt: skip


# ---- the head --------------------------------------------------------------------------
def rope_tables(d: int, length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    freqs = torch.arange(length).float()[:, None] * inv[None]
    return freqs.cos(), freqs.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class Head(nn.Module):
    """EAGLE-1: x = fc([e; f]); y = x + attn(x); g = y + mlp(norm(y)). Names as exported."""

    def __init__(self, cfg: dict, intermediate: int) -> None:
        super().__init__()
        h, self.nh, self.nkv = (
            cfg["hidden_size"],
            cfg["num_attention_heads"],
            cfg["num_key_value_heads"],
        )
        self.d = cfg.get("head_dim") or h // self.nh
        self.eps = cfg["rms_norm_eps"]
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.q_proj = nn.Linear(h, self.nh * self.d, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.d, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.nh * self.d, h, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.gate_proj = nn.Linear(h, intermediate, bias=False)
        self.up_proj = nn.Linear(h, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, h, bias=False)
        theta = (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get(
            "rope_theta", 10000.0
        )
        cos, sin = rope_tables(self.d, cfg["max_position_embeddings"], float(theta))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def qkv(self, x: torch.Tensor):
        b, t, _ = x.shape
        cos, sin = self.cos[:t], self.sin[:t]
        q = rotate(self.q_proj(x).view(b, t, self.nh, self.d).transpose(1, 2), cos, sin)
        k = rotate(self.k_proj(x).view(b, t, self.nkv, self.d).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(b, t, self.nkv, self.d).transpose(1, 2)
        rep = self.nh // self.nkv
        return q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        y = x + self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        n = (
            y
            * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
            * self.post_attention_layernorm
        )
        return y + self.down_proj(F.silu(self.gate_proj(n)) * self.up_proj(n))


def unrolled_loss(head: Head, embed: torch.Tensor, lm_head: torch.Tensor, tokens, feats, args):
    """Loss over ``args.unroll`` draft steps. Step k at position i reads token i + 1 and (k = 1)
    the target's feature of i, else the head's step k-1 output at i - 1; it attends to the keys a
    drafting head has: step 1's (real features) up to i - k + 1, then step m's at i - k + m."""
    f = feats.float()
    x_tok = embed[tokens[:, 1:].long()]  # position i reads token i + 1
    f_in, f_next = f[:, :-1], f[:, 1:]
    with torch.no_grad():
        p_log = F.log_softmax(f_next @ lm_head.T, dim=-1)
    rms = f_in.pow(2).mean().sqrt()
    feat = f_in + torch.randn_like(f_in) * args.noise * rms
    t = f_in.shape[1]
    keys: list[tuple[torch.Tensor, torch.Tensor]] = []
    total, stats = 0.0, []
    for k in range(1, args.unroll + 1):
        x = head.fc(torch.cat([x_tok, feat], dim=-1))
        q, kk, vv = head.qkv(x)
        keys.append((kk, vv))
        scores = []
        values = []
        i = torch.arange(t)[:, None]
        j = torch.arange(t)[None, :]
        for m, (km, vm) in enumerate(keys, start=1):
            allowed = (j - i <= 1 - k) if m == 1 else (j - i == m - k)
            s = (q @ km.transpose(-1, -2)) / math.sqrt(head.d)
            scores.append(s.masked_fill(~allowed, float("-inf")))
            values.append(vm)
        w = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
        attn = sum(w[..., m * t : (m + 1) * t] @ v for m, v in enumerate(values))
        g = head.finish(x, attn)
        valid = slice(k - 1, None)  # positions whose inputs exist at step k
        q_log = F.log_softmax(g[:, valid] @ lm_head.T, dim=-1)
        pl = p_log[:, valid]
        kl = (pl.exp() * (pl - q_log)).sum(-1).mean()
        tv = 0.5 * (pl.exp() - q_log.exp()).abs().sum(-1).mean()
        reg = F.smooth_l1_loss(g[:, valid], f_next[:, valid])
        weight = 1.0 if k == 1 else 0.6 ** (k - 1)
        total = total + weight * (kl + tv + reg)
        stats.append(1.0 - tv.item())
        feat = torch.cat([f_in[:, :1], g[:, :-1]], dim=1)  # step k + 1 at i reads g(i - 1)
    return total, stats


def phase_train(args, run: Path) -> None:
    torch.manual_seed(args.seed)
    blob = torch.load(run / "features.pt", weights_only=True)
    target = load_target(Path(args.target))
    cfg = json.loads((Path(args.target) / "config.json").read_text())
    embed = target.model.embed_tokens.weight.detach()
    lm_head = target.lm_head.weight.detach()
    head = Head(cfg, args.intermediate or cfg["intermediate_size"])
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    tokens, feats = blob["tokens"], blob["features"]
    n = len(tokens)
    steps = args.steps
    g = torch.Generator().manual_seed(args.seed + 7)
    t0 = time.time()
    step = 0
    for step in range(1, steps + 1):
        lr = (
            args.lr
            * min(1.0, step / 50)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        )
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(0, n, (min(args.batch_size, n),), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, stats = unrolled_loss(head, embed, lm_head, tokens[idx], feats[idx], args)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps:
            alphas = " ".join(f"{a:.3f}" for a in stats)
            log(run, f"step {step}/{steps} loss {loss.item():.3f} alpha by step {alphas} "
                     f"({time.time() - t0:.0f} s)")  # fmt: skip
        if args.minutes and time.time() - t0 > 60 * args.minutes:
            break
    ev = evaluate(head, embed, lm_head, blob["eval_tokens"], blob["eval_features"], args)
    log(run, f"held-out alpha by draft step (teacher-forced tokens): {ev}")
    torch.save({"head": head.state_dict(), "steps": step, "eval": ev, "seconds": time.time() - t0,
                "loss": loss.item(), "command": command()}, run / "head.pt")  # fmt: skip


@torch.no_grad()
def evaluate(head, embed, lm_head, tokens, feats, args) -> list[float]:
    """E[1 - TV(p, q)] at each draft step on held-out windows, without feature noise."""
    quiet = argparse.Namespace(**{**vars(args), "noise": 0.0})
    alphas = []
    for i in range(0, len(tokens), 8):
        _, stats = unrolled_loss(head, embed, lm_head, tokens[i : i + 8], feats[i : i + 8], quiet)
        alphas.append(stats)
    return [round(sum(col) / len(col), 4) for col in zip(*alphas)]


# ---- export ------------------------------------------------------------------------------
def phase_export(args, run: Path) -> None:
    from safetensors.torch import save_file

    out = Path(args.export or run / "export")
    out.mkdir(parents=True, exist_ok=True)
    saved = torch.load(run / "head.pt", weights_only=True)
    features = torch.load(run / "features.pt", weights_only=True)
    sd = saved["head"]
    cfg = json.loads((Path(args.target) / "config.json").read_text())
    names = {
        "fc.weight": "fc.weight",
        "post_attention_layernorm": "layers.0.post_attention_layernorm.weight",
    }
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        names[f"{proj}.weight"] = f"layers.0.self_attn.{proj}.weight"
    for proj in ("gate_proj", "up_proj", "down_proj"):
        names[f"{proj}.weight"] = f"layers.0.mlp.{proj}.weight"
    tensors = {names[k]: v.to(torch.bfloat16).contiguous() for k, v in sd.items() if k in names}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    head_cfg = {k: cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                    "head_dim", "rms_norm_eps", "max_position_embeddings",
                                    "rope_parameters", "vocab_size", "bos_token_id", "eos_token_id")
                if k in cfg}  # fmt: skip
    head_cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
                    intermediate_size=sd["gate_proj.weight"].shape[0], hidden_act="silu",
                    dtype="bfloat16")  # fmt: skip
    (out / "config.json").write_text(json.dumps(head_cfg, indent=2, sort_keys=True) + "\n")
    meta = {
        "what": "EAGLE-1 head for the built-in target, trained with the target frozen",
        "commands": {
            "features": features["command"],
            "train": saved["command"],
            "export": command(),
        },
        "seed": args.seed,
        "target": Path(args.target).name if Path(args.target) == BUILTIN else str(args.target),
        "train_tokens": int(features["tokens"].numel()),
        "features_seconds": round(float(features["seconds"]), 1),
        "data": "the target's stdlib training files (training.json); held-out files for eval",
        "seq_len": args.seq_len,
        "max_tokens": args.max_tokens,
        "batch_size": args.batch_size,
        "steps": saved["steps"],
        "unroll": args.unroll,
        "feature_noise": args.noise,
        "loss": "KL(p||q) + TV(p,q) + smooth-L1(feature), draft step k weighted 0.6^(k-1)",
        "final_loss": saved["loss"],
        "train_seconds": round(saved["seconds"], 1),
        "heldout_alpha_by_step": saved["eval"],
        "parameters": sum(v.numel() for v in tensors.values()),
        "torch": torch.__version__,
    }
    (out / "training.json").write_text(json.dumps(meta, indent=1) + "\n")
    log(run, f"exported {out} ({meta['parameters']:,} parameters)")


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    run = Path(args.out)
    run.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        args.seq_len, args.max_tokens, args.batch_size = 32, 4096, 4
        args.steps = min(args.steps, 200)
    for phase in ("features", "train", "export"):
        if args.phase in (phase, "all"):
            globals()[f"phase_{phase}"](args, run)


if __name__ == "__main__":
    main()
