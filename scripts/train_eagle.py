"""Train an EAGLE-3 head for a frozen target (by default the built-in pair's) on the Python stdlib,
or, with ``--chat-data``, on the target's own answers to chat instructions (self-distillation).

Phases (``--phase all`` runs them in order):
  features  the target over windows of the training files (or over each answered conversation,
            prompt and answer), and with ``--generated N`` over N tokens of the target's own
            continuations of such windows (eagle_generated.py): the residual streams entering
            the layers ``--layers`` (the head's input) and the final normed hidden states (the
            target's p) -> RUN/features.pt, RUN/features.json
  train     the head (fc over the streams; one decoder layer over [norm(embedding);
            norm(feature)]; its own final norm and LM head, started from the target's) with the
            target frozen, to match the target's next-token distribution: KL(p || q) + TV(p, q),
            unrolled --unroll draft steps with the inputs and attention each step has when
            drafting (chat: on the answer positions, over a draft vocabulary of the
            ``--draft-vocab`` tokens most frequent in the answers) -> RUN/head.pt
  export    EXPORT/ (config.json + model.safetensors in EAGLE-3's published layout, which
            specbatch and vLLM load) and EXPORT/training.json
The training files are the stdlib files the target was trained on (``training.json`` beside
it, when there is one, else all but the held-out 5%); held-out files are only evaluated on.
Chat data (scripts/chat_answers.py) holds its own held-out conversations, of other kinds and
material; they are only evaluated on. A target is a Hugging Face folder or a GGUF file.

  python scripts/train_eagle.py --out runs/eagle --export specbatch/assets/default_pair/eagle
  python scripts/chat_answers.py --out runs/smollm2/chat.jsonl        # then (see the README):
  python scripts/train_eagle.py --target SmolLM2.gguf --chat-data runs/smollm2/chat.jsonl \
      --draft-vocab 16384 --out runs/smollm2 --export ~/.cache/specbatch/models/...-eagle3
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eagle_chat_features as chat
import eagle_generated
import train_pair_data as data
from eagle_head import DistillLoss, Head, rope_tables, rotate, unrolled_loss
from train_eagle_export import export_head

__all__ = ["DistillLoss", "Head", "rope_tables", "rotate", "unrolled_loss"]

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
    p.add_argument("--chat-data", default=None, help="scripts/chat_answers.py's JSON lines")
    p.add_argument(
        "--draft-vocab", type=int, default=None, help="chat: the draft vocabulary's size (d2t)"
    )
    p.add_argument(
        "--train-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto: bfloat16 autocast where the CPU multiplies bfloat16 natively, else float32",
    )
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=1_000_000, help="training tokens to featurise")
    p.add_argument(
        "--generated",
        type=int,
        default=0,
        help="and this many tokens of the target's own continuations of training windows",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--minutes", type=float, default=None, help="or stop training after this long")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--unroll", type=int, default=2, help="draft steps trained per position")
    p.add_argument("--step-decay", type=float, default=0.6, help="draft step k weighs decay^(k-1)")
    p.add_argument(
        "--noise",
        type=float,
        default=0.1,
        help="stream noise (x the streams' overall rms; 0 for a target whose streams have a few "
        "channels far larger than the rest, as SmolLM2's, where it would drown the others)",
    )
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


def _where(path: Path) -> dict:
    if path.suffix == ".gguf":
        return {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
    return {"pretrained_model_name_or_path": str(path)}


def load_target(path: Path, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(**_where(path), dtype=torch.float32)
    model = model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def target_config(path: Path) -> dict:
    if path.suffix != ".gguf":
        return json.loads((path / "config.json").read_text())
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(**_where(path)).to_dict()


def bf16_native() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return any(f in flags.split() for f in ("avx512_bf16", "amx_bf16"))


def stream_ids(layers: str | None, num_layers: int) -> list[int]:
    """The layers read, as ``specbatch.model.eagle.feature_layers`` resolves them."""
    if layers:
        return [int(i) for i in layers.split(",")]
    return [min(max(i, 0), num_layers) for i in (2, num_layers // 2, num_layers - 3)]


@torch.inference_mode()
def featurise(model, tokens: torch.Tensor, streams: list[int], batch: int = 8):
    """The final normed hidden states [N, L, h] and the residual streams entering the layers
    ``streams``, concatenated [N, L, len(streams) * h] (the layer count: the stream after the
    last layer); bfloat16, on the host."""
    device = next(model.parameters()).device
    seen: dict[int, torch.Tensor] = {}
    layers = model.model.layers
    hooks = [layer.register_forward_pre_hook(lambda _m, a, i=i: seen.__setitem__(i, a[0]))
             for i, layer in enumerate(layers)]  # fmt: skip
    hooks.append(model.model.norm.register_forward_pre_hook(
        lambda _m, a: seen.__setitem__(len(layers), a[0])))  # fmt: skip
    finals, fused = [], []
    try:
        for i in range(0, len(tokens), batch):
            h = model.model(input_ids=tokens[i : i + batch].long().to(device)).last_hidden_state
            finals.append(h.to(torch.bfloat16).cpu())
            fused.append(torch.cat([seen[j] for j in streams], dim=-1).to(torch.bfloat16).cpu())
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat(finals), torch.cat(fused)


def phase_features(args, run: Path) -> None:
    if args.chat_data:
        phase_chat_features(args, run)
        return
    from tokenizers import Tokenizer

    target = Path(args.target)
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    train, held = train_and_heldout_files(target, args.tiny)

    def encode(files) -> torch.Tensor:
        ids = [t for enc in tok.encode_batch([t for _, t in files]) for t in enc.ids]
        return torch.tensor(ids, dtype=torch.int64)

    stream, held_stream = encode(train), encode(held)
    model = load_target(target, args.device)
    ids = stream_ids(args.layers, model.config.num_hidden_layers)
    batch = 256 if args.device == "cuda" else 8
    t0 = time.time()
    tr = windows(stream, args.seq_len, args.max_tokens, args.seed)
    ev = windows(held_stream, args.seq_len, (64 if not args.tiny else 2) * args.seq_len,
                 args.seed + 1)  # fmt: skip
    blob = {"eval_tokens": ev}
    generated = 0
    if args.generated:  # the target's continuations of training windows, and of held-out ones
        sample = 2048 if args.device == "cuda" else 16
        own = eagle_generated.sample_continuations(
            model, windows(stream, args.seq_len, args.generated, args.seed + 2), args.seed, sample
        ).cpu()
        generated = own.numel()
        tr = torch.cat([tr, own])
        blob["gen_eval_tokens"] = eagle_generated.sample_continuations(
            model, ev, args.seed + 1, sample
        ).cpu()
        log(run, f"sampled {generated:,} tokens of the target's text ({time.time() - t0:.0f} s)")
    blob["tokens"] = tr
    for name in list(blob):
        final, streams = featurise(model, blob[name], ids, batch)
        prefix = name.removesuffix("tokens")
        blob[name] = blob[name].to(torch.int16)
        blob[prefix + "final"], blob[prefix + "streams"] = final, streams
    torch.save(blob, run / "features.pt")
    info = {"command": command(), "seconds": round(time.time() - t0, 1), "stream_ids": ids,
            "train_tokens": tr.numel(), "generated_tokens": generated,
            "train_files": len(train), "corpus_tokens": len(stream),
            "heldout_tokens": ev.numel()}  # fmt: skip
    (run / "features.json").write_text(json.dumps(info, indent=1) + "\n")
    log(run, f"features: {tr.numel():,} train tokens ({generated:,} the target's own; "
             f"corpus {len(stream):,}, {len(train)} files), {ev.numel():,} held-out "
             f"({len(held)} files), streams {ids}, {time.time() - t0:.0f} s")  # fmt: skip


COVERAGE_SIZES = (4096, 8192, 12288, 16384, 24576, 32768)


def draft_vocab(train: list[dict], size: int | None, cfg: dict) -> torch.Tensor | None:
    """The draft vocabulary (None: the target's whole vocabulary)."""
    if not size or size >= cfg["vocab_size"]:
        return None
    eos = cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], list) else [cfg["eos_token_id"]]
    return chat.draft_vocab(train, size, cfg["vocab_size"], eos)


def phase_chat_features(args, run: Path) -> None:
    path = Path(args.chat_data)
    convs = chat.load_chat(path)
    cfg = target_config(Path(args.target))
    ids = stream_ids(args.layers, cfg["num_hidden_layers"])
    cover = {}
    for size in sorted({*COVERAGE_SIZES, args.draft_vocab or 0} - {0}):
        if size < cfg["vocab_size"]:
            v = draft_vocab(convs["train"], size, cfg)
            cover[size] = [round(chat.coverage(convs[s], v), 4) for s in ("train", "heldout")]
    log(run, f"draft vocabulary coverage of the answers' tokens (train, held-out): {cover}")
    t0 = time.time()
    featurise = chat.Featuriser(Path(args.target), ids)
    blobs = {s: chat.featurise_chat(convs[s], featurise) for s in ("train", "heldout")}
    torch.save({"train": blobs["train"], "eval": blobs["heldout"]}, run / "features.pt")
    meta_path = path.with_suffix(path.suffix + ".json")
    answered = {s: len(blobs[s]["tokens"]) for s in blobs}
    answers = {s: sum(len(r["answer_token_ids"]) for r in convs[s]) for s in convs}
    info = {"command": command(), "seconds": round(time.time() - t0, 1), "stream_ids": ids,
            "chat_data": str(path), "conversations": {s: len(convs[s]) for s in convs},
            "kinds": {s: sorted({r["kind"] for r in convs[s]}) for s in convs},
            "tokens": answered, "answer_tokens": answers, "train_tokens": answers["train"],
            "coverage": cover, "answers_meta": json.loads(meta_path.read_text())
            if meta_path.exists() else None}  # fmt: skip
    (run / "features.json").write_text(json.dumps(info, indent=1) + "\n")
    log(run, f"features: {answered['train']:,} train tokens ({answers['train']:,} answer tokens, "
             f"{len(convs['train'])} conversations), {answered['heldout']:,} held-out "
             f"({len(convs['heldout'])}), streams {ids}, {time.time() - t0:.0f} s")  # fmt: skip


# ---- training ----------------------------------------------------------------------------
def phase_train(args, run: Path) -> None:
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    blob = torch.load(run / "features.pt", weights_only=True)
    if "train" not in blob:  # windows: every tensor on the device, batches taken there
        blob = {k: v.to(device) for k, v in blob.items()}
    info = json.loads((run / "features.json").read_text())
    target = load_target(Path(args.target), args.device)
    cfg = target_config(Path(args.target))
    embed = target.model.embed_tokens.weight.detach()
    lm_head = target.lm_head.weight.detach()
    vocab = None
    if args.chat_data:
        vocab = draft_vocab(chat.load_chat(Path(args.chat_data))["train"], args.draft_vocab, cfg)
    if vocab is not None:
        log(run, f"draft vocabulary: {len(vocab)} tokens")
    head = Head(cfg, args.intermediate or cfg["intermediate_size"], len(info["stream_ids"]),
                lm_head if vocab is None else lm_head[vocab], target.model.norm.weight)  # fmt: skip
    head = head.to(device)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    steps = args.steps
    gen = torch.Generator().manual_seed(args.seed + 7)
    if "train" in blob:  # chat: records of similar lengths, masked to their answers
        sample = chat.length_batches(blob["train"], args.batch_size, gen)

        def batch():
            return chat.chat_batch(blob["train"], sample())
    else:
        tokens, final, streams = blob["tokens"], blob["final"], blob["streams"]

        def batch():
            idx = torch.randint(0, len(tokens), (min(args.batch_size, len(tokens)),), generator=gen)
            idx = idx.to(device)
            return tokens[idx], final[idx], streams[idx], None

    bf16 = args.train_dtype == "bfloat16" or (
        args.train_dtype == "auto" and (device.type == "cuda" or bf16_native())
    )
    t0 = time.time()
    curve: list[tuple[int, list[float]]] = []
    own_curve: list[tuple[int, list[float]]] = []  # on the target's own held-out continuations
    step, loss = 0, torch.zeros(())
    budget = 60 * args.minutes if args.minutes else math.inf
    for step in range(1, steps + 1):
        # the schedule runs to whichever ends first, --steps or --minutes
        done = max(step / steps, (time.time() - t0) / budget)
        cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, step / 50) * cosine
        tok, fin, st, mask = batch()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss, alphas = unrolled_loss(
                head, embed, lm_head, tok, fin, st, args.unroll, args.step_decay, args.noise,
                mask, vocab,
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
            curve.append((step, evaluate(head, embed, lm_head, blob, args, vocab)))
            log(run, f"held-out alpha by draft step at step {step}: {curve[-1][1]}")
            if "gen_eval_tokens" in blob:
                own_curve.append((step, evaluate(head, embed, lm_head, blob, args, vocab, "gen_")))
                log(run, f"  on the target's own continuations: {own_curve[-1][1]}")
        if stop:
            break
    torch.save({"head": head.state_dict(), "steps": step, "curve": curve,
                "curve_generated": own_curve, "loss": loss.item(),
                "seconds": time.time() - t0, "command": command(), "vocab": vocab,
                "train_dtype": "bfloat16" if bf16 else "float32"}, run / "head.pt")  # fmt: skip


@torch.no_grad()
def evaluate(head: Head, embed, lm_head, blob: dict, args, vocab=None, own="") -> list[float]:
    """E[sum_x min(p, q)] at each draft step on held-out windows (chat: held-out answers; own
    "gen_": the target's continuations of the held-out windows), without stream noise, each
    batch weighed by its positions."""
    if "eval" in blob:
        ev = blob["eval"]
        lens = ev["offsets"][1:] - ev["offsets"][:-1]
        order = torch.argsort(lens).tolist()
        parts = [chat.chat_batch(ev, order[i : i + 8]) for i in range(0, len(order), 8)]
    else:
        tok, fin, st = (blob[f"{own}eval_{part}"] for part in ("tokens", "final", "streams"))
        parts = [(tok[i : i + 8], fin[i : i + 8], st[i : i + 8], None)
                 for i in range(0, len(tok), 8)]  # fmt: skip
    rows, weights = [], []
    for tok, fin, st, mask in parts:
        _, alphas = unrolled_loss(head, embed, lm_head, tok, fin, st, args.unroll,
                                  args.step_decay, 0.0, mask, vocab)  # fmt: skip
        rows.append(alphas)
        weights.append(mask.sum().item() if mask is not None else 1)
    total = sum(weights)
    return [round(sum(a * w for a, w in zip(col, weights)) / total, 4) for col in zip(*rows)]


# ---- export ------------------------------------------------------------------------------
def phase_export(args, run: Path) -> None:
    cfg = target_config(Path(args.target))
    out, parameters = export_head(args, run, cfg, command(), BUILTIN)
    log(run, f"exported {out} ({parameters:,} parameters)")


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
