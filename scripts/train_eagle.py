"""Train an EAGLE-3 head for a frozen target (by default the built-in pair's) on the Python stdlib.

Phases (``--phase all`` runs them in order):
  features  the target over windows of the training files: the residual streams entering the
            layers ``--layers`` (the head's input) and the final normed hidden states (the
            target's p) -> RUN/features.pt, RUN/features.json
  train     the head (fc over the streams; one decoder layer over [norm(embedding);
            norm(feature)]; its own final norm and LM head, started from the target's) with the
            target frozen, to match the target's next-token distribution: KL(p || q) + TV(p, q),
            unrolled --unroll draft steps with the inputs and attention each step has when
            drafting -> RUN/head.pt
  export    EXPORT/ (config.json + model.safetensors in EAGLE-3's published layout, which
            specbatch and vLLM load) and EXPORT/training.json
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
    p.add_argument(
        "--layers",
        default=None,
        help="the target layers whose entering residual streams the head reads, e.g. 2,6,9 "
        "(default: 2, L/2 and L-3 of an L-layer target, as specbatch and vLLM assume)",
    )
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=1_000_000, help="training tokens to featurise")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--minutes", type=float, default=None, help="or stop training after this long")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--unroll", type=int, default=2, help="draft steps trained per position")
    p.add_argument("--step-decay", type=float, default=0.6, help="draft step k weighs decay^(k-1)")
    p.add_argument("--noise", type=float, default=0.1, help="stream noise (x stream rms)")
    p.add_argument("--intermediate", type=int, default=None, help="head MLP (default: target's)")
    p.add_argument("--eval-every", type=int, default=500, help="held-out alpha every N steps")
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
    """Up to ``max_tokens`` of the stream in windows that do not overlap, in a random order."""
    n = min(len(stream) // seq_len, max(1, max_tokens // seq_len))
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randperm(len(stream) // seq_len, generator=gen)[:n] * seq_len
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


def load_target(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def stream_ids(layers: str | None, num_layers: int) -> list[int]:
    """The layers read, as ``specbatch.model.eagle.feature_layers`` resolves them."""
    if layers:
        return [int(i) for i in layers.split(",")]
    return [min(max(i, 0), num_layers) for i in (2, num_layers // 2, num_layers - 3)]


@torch.inference_mode()
def featurise(model, tokens: torch.Tensor, streams: list[int], batch: int = 8):
    """The final normed hidden states [N, L, h] and the residual streams entering the layers
    ``streams``, concatenated [N, L, len(streams) * h] (the layer count: the stream after the
    last layer)."""
    seen: dict[int, torch.Tensor] = {}
    layers = model.model.layers
    hooks = [layer.register_forward_pre_hook(lambda _m, a, i=i: seen.__setitem__(i, a[0]))
             for i, layer in enumerate(layers)]  # fmt: skip
    hooks.append(model.model.norm.register_forward_pre_hook(
        lambda _m, a: seen.__setitem__(len(layers), a[0])))  # fmt: skip
    finals, fused = [], []
    try:
        for i in range(0, len(tokens), batch):
            h = model.model(input_ids=tokens[i : i + batch].long()).last_hidden_state
            finals.append(h.to(torch.bfloat16))
            fused.append(torch.cat([seen[j] for j in streams], dim=-1).to(torch.bfloat16))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat(finals), torch.cat(fused)


def phase_features(args, run: Path) -> None:
    from tokenizers import Tokenizer

    target = Path(args.target)
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    train, held = train_and_heldout_files(target, args.tiny)

    def encode(files) -> torch.Tensor:
        ids = [t for enc in tok.encode_batch([t for _, t in files]) for t in enc.ids]
        return torch.tensor(ids, dtype=torch.int64)

    stream, held_stream = encode(train), encode(held)
    model = load_target(target)
    ids = stream_ids(args.layers, model.config.num_hidden_layers)
    t0 = time.time()
    tr = windows(stream, args.seq_len, args.max_tokens, args.seed)
    ev = windows(held_stream, args.seq_len, (64 if not args.tiny else 2) * args.seq_len,
                 args.seed + 1)  # fmt: skip
    (final, streams), (ev_final, ev_streams) = featurise(model, tr, ids), featurise(model, ev, ids)
    torch.save({"tokens": tr.to(torch.int16), "final": final, "streams": streams,
                "eval_tokens": ev.to(torch.int16), "eval_final": ev_final,
                "eval_streams": ev_streams}, run / "features.pt")  # fmt: skip
    info = {"command": command(), "seconds": round(time.time() - t0, 1), "stream_ids": ids,
            "train_tokens": tr.numel(), "train_files": len(train),
            "corpus_tokens": len(stream), "heldout_tokens": ev.numel()}  # fmt: skip
    (run / "features.json").write_text(json.dumps(info, indent=1) + "\n")
    log(run, f"features: {tr.numel():,} train tokens (of {len(stream):,}; {len(train)} files), "
             f"{ev.numel():,} held-out ({len(held)} files), streams {ids}, "
             f"{time.time() - t0:.0f} s")  # fmt: skip


# ---- the head --------------------------------------------------------------------------
def rope_tables(d: int, length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    freqs = torch.arange(length).float()[:, None] * inv[None]
    return freqs.cos(), freqs.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class Head(nn.Module):
    """EAGLE-3: f = fc(streams) (the head's own g at later draft steps); y = f +
    attn([norm(e); norm(f)]); g = y + mlp(norm(y)); q = softmax(lm_head(norm(g))). The final
    norm and LM head start as the target's. Parameter names as exported (less the prefix)."""

    def __init__(self, cfg: dict, intermediate: int, streams: int, target_lm_head: torch.Tensor,
                 target_norm: torch.Tensor) -> None:  # fmt: skip
        super().__init__()
        h, self.nh, self.nkv = (
            cfg["hidden_size"],
            cfg["num_attention_heads"],
            cfg["num_key_value_heads"],
        )
        self.d = cfg.get("head_dim") or h // self.nh
        self.eps = cfg["rms_norm_eps"]
        self.fc = nn.Linear(streams * h, h, bias=False)
        self.q_proj = nn.Linear(2 * h, self.nh * self.d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.nkv * self.d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.nkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.nh * self.d, h, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.hidden_norm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.gate_proj = nn.Linear(h, intermediate, bias=False)
        self.up_proj = nn.Linear(h, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, h, bias=False)
        self.norm = nn.Parameter(target_norm.detach().clone().float())
        self.lm_head = nn.Parameter(target_lm_head.detach().clone().float())
        theta = (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get(
            "rope_theta", 10000.0
        )
        cos, sin = rope_tables(self.d, cfg["max_position_embeddings"], float(theta))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def qkv(self, e: torch.Tensor, feat: torch.Tensor):
        x = torch.cat([self.rms(e, self.input_layernorm), self.rms(feat, self.hidden_norm)], -1)
        b, t, _ = x.shape
        cos, sin = self.cos[:t], self.sin[:t]
        q = rotate(self.q_proj(x).view(b, t, self.nh, self.d).transpose(1, 2), cos, sin)
        k = rotate(self.k_proj(x).view(b, t, self.nkv, self.d).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(b, t, self.nkv, self.d).transpose(1, 2)
        rep = self.nh // self.nkv
        return q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def finish(self, feat: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        y = feat + self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        n = self.rms(y, self.post_attention_layernorm)
        return y + self.down_proj(F.silu(self.gate_proj(n)) * self.up_proj(n))

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        return self.rms(g, self.norm) @ self.lm_head.T


class DistillLoss(torch.autograd.Function):
    """sum_r w_r (KL(p_r || q_r) + TV(p_r, q_r)) for q = softmax(z), and sum_r w_r TV(p_r, q_r)
    (not differentiated), over row chunks. The gradient is computed with the loss, in a few
    passes over the vocabulary: d/dz KL = q - p, d/dz TV = q (s - <q, s>) / 2 with s =
    sign(q - p)."""

    CHUNK = 256

    @staticmethod
    def forward(ctx, z, p, log_p, w):
        grad = torch.empty(z.shape, dtype=torch.float32)
        kl = tv = z.new_zeros((), dtype=torch.float32)
        for r in range(0, len(z), DistillLoss.CHUNK):
            rows = slice(r, r + DistillLoss.CHUNK)
            wr = w[rows, None]
            log_q = torch.log_softmax(z[rows].float(), dim=-1)
            q = log_q.exp()
            d = q - p[rows]
            kl = kl + (wr * p[rows] * (log_p[rows] - log_q)).sum()
            tv = tv + 0.5 * (wr * d.abs()).sum()
            sign = d.sign()
            g = grad[rows]
            torch.mul(q, sign - (q * sign).sum(-1, keepdim=True), out=g)
            g.mul_(0.5).add_(d).mul_(wr)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(tv)
        ctx.dtype = z.dtype
        return kl + tv, tv

    @staticmethod
    def backward(ctx, grad_loss, _grad_tv):
        (grad,) = ctx.saved_tensors
        return (grad * grad_loss).to(ctx.dtype), None, None, None


def unrolled_loss(head: Head, embed: torch.Tensor, lm_head: torch.Tensor, tokens, final, streams,
                  unroll: int, step_decay: float, noise: float):  # fmt: skip
    """Loss over ``unroll`` draft steps. Step k at position i reads token i + 1 and (k = 1) the
    fc of the target's streams at i, else the head's step k-1 output at i - 1; it attends to the
    keys a drafting head has: step 1's (target features) up to i - k + 1, then step m's at
    i - k + m. Returns the loss and E[1 - TV(p, q)] of each step."""
    b, t = tokens.shape[0], tokens.shape[1] - 1
    e = embed[tokens[:, 1:].long()]  # position i reads token i + 1
    with torch.no_grad(), torch.autocast("cpu", enabled=False):  # the target's p in float32
        p_log = F.log_softmax(final[:, 1:].float().reshape(b * t, -1) @ lm_head.float().T, -1)
        p = p_log.exp()
    s_in = streams[:, :-1].float()
    if noise:
        s_in = s_in + torch.randn_like(s_in) * noise * s_in.pow(2).mean().sqrt()
    feat = head.fc(s_in)
    keys: list[tuple[torch.Tensor, torch.Tensor]] = []
    total, alphas = 0.0, []
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    for k in range(1, unroll + 1):
        q, kk, vv = head.qkv(e, feat)
        keys.append((kk, vv))
        scores = []
        for m, (km, _) in enumerate(keys, start=1):
            allowed = (j - i <= 1 - k) if m == 1 else (j - i == m - k)
            s = (q @ km.transpose(-1, -2)) / math.sqrt(head.d)
            scores.append(s.masked_fill(~allowed, float("-inf")))
        w = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
        attn = sum(w[..., m * t : (m + 1) * t] @ vm for m, (_, vm) in enumerate(keys))
        g = head.finish(feat, attn)
        weight = torch.zeros(b, t)  # the mean over positions whose inputs exist at step k
        weight[:, k - 1 :] = 1.0 / (b * (t - k + 1))
        loss, tv = DistillLoss.apply(head.logits(g).reshape(b * t, -1), p, p_log, weight.view(-1))
        total = total + step_decay ** (k - 1) * loss
        alphas.append(1.0 - tv.item())
        feat = torch.cat([feat[:, :1], g[:, :-1]], dim=1)  # step k + 1 at i reads g(i - 1)
    return total, alphas


def phase_train(args, run: Path) -> None:
    torch.manual_seed(args.seed)
    blob = torch.load(run / "features.pt", weights_only=True)
    info = json.loads((run / "features.json").read_text())
    target = load_target(Path(args.target))
    cfg = json.loads((Path(args.target) / "config.json").read_text())
    embed = target.model.embed_tokens.weight.detach()
    lm_head = target.lm_head.weight.detach()
    head = Head(cfg, args.intermediate or cfg["intermediate_size"], len(info["stream_ids"]),
                lm_head, target.model.norm.weight)  # fmt: skip
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    tokens, final, streams = blob["tokens"], blob["final"], blob["streams"]
    n, steps = len(tokens), args.steps
    gen = torch.Generator().manual_seed(args.seed + 7)
    t0 = time.time()
    curve: list[tuple[int, list[float]]] = []
    step, loss = 0, torch.zeros(())
    budget = 60 * args.minutes if args.minutes else math.inf
    for step in range(1, steps + 1):
        # the schedule runs to whichever ends first, --steps or --minutes
        done = max(step / steps, (time.time() - t0) / budget)
        cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, step / 50) * cosine
        idx = torch.randint(0, n, (min(args.batch_size, n),), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, alphas = unrolled_loss(
                head, embed, lm_head, tokens[idx], final[idx], streams[idx], args.unroll,
                args.step_decay, args.noise,
            )  # fmt: skip
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps:
            by_step = " ".join(f"{a:.3f}" for a in alphas)
            log(run, f"step {step}/{steps} loss {loss.item():.3f} alpha by step {by_step} "
                     f"({time.time() - t0:.0f} s)")  # fmt: skip
        stop = done >= 1.0
        if step % args.eval_every == 0 or stop:
            curve.append((step, evaluate(head, embed, lm_head, blob, args)))
            log(run, f"held-out alpha by draft step at step {step}: {curve[-1][1]}")
        if stop:
            break
    torch.save({"head": head.state_dict(), "steps": step, "curve": curve, "loss": loss.item(),
                "seconds": time.time() - t0, "command": command()}, run / "head.pt")  # fmt: skip


@torch.no_grad()
def evaluate(head: Head, embed, lm_head, blob: dict, args) -> list[float]:
    """E[1 - TV(p, q)] at each draft step on held-out windows, without stream noise."""
    tokens, final, streams = blob["eval_tokens"], blob["eval_final"], blob["eval_streams"]
    rows = []
    for i in range(0, len(tokens), 8):
        part = slice(i, i + 8)
        _, alphas = unrolled_loss(head, embed, lm_head, tokens[part], final[part], streams[part],
                                  args.unroll, args.step_decay, 0.0)  # fmt: skip
        rows.append(alphas)
    return [round(sum(col) / len(col), 4) for col in zip(*rows)]


# ---- export ------------------------------------------------------------------------------
def phase_export(args, run: Path) -> None:
    from safetensors.torch import save_file

    out = Path(args.export or run / "export")
    out.mkdir(parents=True, exist_ok=True)
    saved = torch.load(run / "head.pt", weights_only=True)
    info = json.loads((run / "features.json").read_text())
    sd = saved["head"]
    cfg = json.loads((Path(args.target) / "config.json").read_text())
    names = {"fc.weight": "fc.weight", "norm": "norm.weight", "lm_head": "lm_head.weight"}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        names[norm] = f"midlayer.{norm}.weight"
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        names[f"{proj}.weight"] = f"midlayer.self_attn.{proj}.weight"
    for proj in ("gate_proj", "up_proj", "down_proj"):
        names[f"{proj}.weight"] = f"midlayer.mlp.{proj}.weight"
    tensors = {names[k]: v.to(torch.bfloat16).contiguous() for k, v in sd.items() if k in names}
    # The draft vocabulary is the target's, id for id, which a head says by having no d2t
    # (vLLM refuses a d2t when draft_vocab_size equals the target's vocabulary).
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
        draft_vocab_size=cfg["vocab_size"],
        eagle_config={"eagle_aux_hidden_state_layer_ids": info["stream_ids"]},
        dtype="bfloat16",
    )
    (out / "config.json").write_text(json.dumps(head_cfg, indent=2, sort_keys=True) + "\n")
    meta = {
        "what": "EAGLE-3 head for the built-in target, trained with the target frozen",
        "commands": {"features": info["command"], "train": saved["command"], "export": command()},
        "seed": args.seed,
        "target": Path(args.target).name if Path(args.target) == BUILTIN else str(args.target),
        "data": "the target's stdlib training files (training.json); held-out files for eval",
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
        "parameters": sum(v.numel() for v in tensors.values()),
        "torch": torch.__version__,
    }
    (out / "training.json").write_text(json.dumps(meta, indent=1) + "\n")
    log(run, f"exported {out} ({meta['parameters']:,} parameters)")


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # the tails of p and q are subnormal: slow on x86
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
