"""Train specbatch's built-in target/draft pair from scratch on the Python stdlib's own source.

Phases (``--phase all`` runs them in order, each skipped under ``--resume`` once done):
  tokenizer  byte-level BPE on the train files -> RUN/tokenizer/, RUN/data.pt, RUN/data.json
  target     Llama target, next-token loss     -> RUN/target.pt (resumable checkpoint)
  draft      Llama draft, distilled from target -> RUN/draft.pt (resumable checkpoint)
  export     bf16 HF checkpoints EXPORT/target/, EXPORT/draft/ + EXPORT/training.json
Training phases take a wall-clock budget (--target-minutes/--draft-minutes) and/or a step count;
the cosine schedule follows whichever ends first. Checkpoints every --ckpt-minutes and on
SIGTERM/SIGINT; rerun the same command with --resume to continue. Logs: stdout + RUN/train.log.

Example (CPU, in the background on a shared 2-core machine):
  nice -n 19 python scripts/train_pair.py --out runs/main --phase all --threads 2 \
      --adaptive-threads --target-minutes 66 --draft-minutes 34
On a GPU (--device auto picks CUDA) a few minutes per phase suffice, e.g.
  python scripts/train_pair.py --out runs/gpu --target-minutes 6 --draft-minutes 3
Smoke test: python scripts/train_pair.py --tiny --out /tmp/pair --phase all
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_pair_data as data
import train_pair_export as export
import train_pair_train as tr

FULL = {
    "vocab_size": 4096,
    "context": 512,
    "seq_len": 512,
    "batch_size": 8,
    "target": {"hidden": 256, "layers": 12, "heads": 4, "kv_heads": 2, "intermediate": 704},
    "draft": {"hidden": 192, "layers": 1, "heads": 4, "kv_heads": 4, "intermediate": 512},
    "eval_windows": 32,
    "final_eval_windows": 64,
    "max_files": None,
}
TINY = {
    "vocab_size": 320,
    "context": 64,
    "seq_len": 32,
    "batch_size": 4,
    "target": {"hidden": 64, "layers": 2, "heads": 2, "kv_heads": 1, "intermediate": 128},
    "draft": {"hidden": 32, "layers": 1, "heads": 2, "kv_heads": 2, "intermediate": 64},
    "eval_windows": 4,
    "final_eval_windows": 4,
    "max_files": 12,
    "target_steps": 3,
    "draft_steps": 3,
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/main"), help="run directory")
    ap.add_argument("--export-dir", type=Path, default=None, help="default: OUT/export")
    ap.add_argument(
        "--phase", choices=["tokenizer", "target", "draft", "export", "all"], default="all"
    )
    ap.add_argument("--resume", action="store_true", help="continue/skip phases already started")
    ap.add_argument("--fresh", action="store_true", help="redo phases whose outputs exist")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes and steps, for tests")
    ap.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument(
        "--adaptive-threads",
        action="store_true",
        help="while training, switch between --threads and 1 thread, whichever steps faster "
        "(for a shared machine; results then depend on the load)",
    )
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--amp", choices=["auto", "on", "off"], default="auto", help="bf16 autocast")
    ap.add_argument("--heldout-percent", type=float, default=5.0)
    ap.add_argument("--max-files", type=int, default=None, help="cap on train files (tests)")
    ap.add_argument("--vocab-size", type=int)
    ap.add_argument("--context", type=int, help="max_position_embeddings of both models")
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--batch-size", type=int)
    for who in ("target", "draft"):
        for key in ("hidden", "layers", "heads", "kv_heads", "intermediate"):
            ap.add_argument(f"--{who}-{key.replace('_', '-')}", type=int)
        ap.add_argument(f"--{who}-minutes", type=float, help="wall-clock budget of the phase")
        ap.add_argument(f"--{who}-steps", type=int, help="step budget of the phase")
    ap.add_argument("--target-lr", type=float, default=1.5e-3)
    ap.add_argument("--draft-lr", type=float, default=2e-3)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--kl-weight", type=float, default=1.0, help="draft loss: KL(p||q)")
    ap.add_argument("--tv-weight", type=float, default=0.0, help="draft loss: TV(p,q)")
    ap.add_argument("--ce-weight", type=float, default=0.0, help="draft loss: CE to the data")
    ap.add_argument("--eval-windows", type=int, help="held-out windows per periodic eval")
    ap.add_argument("--final-eval-windows", type=int, help="held-out windows for export eval")
    ap.add_argument("--ckpt-minutes", type=float, default=5.0)
    ap.add_argument("--eval-minutes", type=float, default=10.0)
    ap.add_argument("--log-every", type=int, default=10)
    args = ap.parse_args(argv)
    preset = TINY if args.tiny else FULL
    for key in ("vocab_size", "context", "seq_len", "batch_size", "eval_windows"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    if args.final_eval_windows is None:
        args.final_eval_windows = preset["final_eval_windows"]
    if args.max_files is None:
        args.max_files = preset["max_files"]
    args.sizes = {}
    for who in ("target", "draft"):
        args.sizes[who] = {k: getattr(args, f"{who}_{k}") or v for k, v in preset[who].items()}
        steps, minutes = f"{who}_steps", f"{who}_minutes"
        if getattr(args, steps) is None and getattr(args, minutes) is None:
            if args.tiny:
                setattr(args, steps, preset[steps])
            else:
                setattr(args, minutes, {"target": 70.0, "draft": 35.0}[who])
    if args.seq_len > args.context:
        ap.error("--seq-len must not exceed --context")
    args.export_dir = args.export_dir or args.out / "export"
    return args


def main(argv=None):
    args = parse_args(argv)
    t_start = time.time()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)

    def log(msg):
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}"
        print(line, flush=True)
        with open(out / "train.log", "a") as f:
            f.write(line + "\n")

    torch.set_num_threads(args.threads)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    amp = args.amp == "on" or (args.amp == "auto" and not args.tiny)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    log(f"command: {' '.join([sys.executable, *sys.argv])}")
    log(f"device {device}, threads {args.threads}, bf16 autocast {amp}, seed {args.seed}")
    phases = ["tokenizer", "target", "draft", "export"] if args.phase == "all" else [args.phase]

    def guard(path: Path, what: str) -> bool:
        """True when the phase should run from scratch; False: resume (or skip when done)."""
        if not path.exists() or args.fresh:
            return True
        if not args.resume:
            raise SystemExit(f"{path} exists: pass --resume to continue or --fresh to redo {what}")
        return False

    if "tokenizer" in phases:
        if guard(out / "data.json", "the tokenizer"):
            data.build(
                out, args.vocab_size, args.heldout_percent, args.context, args.max_files, log
            )
        else:
            log("tokenizer: already built, skipping")
    train_ids, heldout_ids, meta = data.load(out)
    vocab, eot = meta["tokenizer"]["vocab_size"], meta["tokenizer"]["eot_id"]
    windows = tr.eval_windows(heldout_ids, args.seq_len, args.eval_windows)
    common = {
        "warmup": args.warmup_steps,
        "weight_decay": args.weight_decay,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "ckpt_minutes": args.ckpt_minutes,
        "eval_minutes": args.eval_minutes,
        "log_every": args.log_every,
        "grad_clip": args.grad_clip,
        "threads": args.threads,
        "adaptive_threads": args.adaptive_threads,
    }

    def load_done(who):
        model = tr.make_model(args.sizes[who], vocab, eot, args.context, args.seed)
        ck = torch.load(out / f"{who}.pt", weights_only=True, map_location="cpu")
        if not ck["done"]:
            log(f"warning: {who} checkpoint is not finished (step {ck['step']})")
        model.load_state_dict(ck["model"])
        return model.to(device).eval(), ck

    if "target" in phases:
        path = out / "target.pt"
        fresh = guard(path, "the target")
        target = tr.make_model(args.sizes["target"], vocab, eot, args.context, args.seed)
        log(f"target: {tr.count_params(target)} params, {args.sizes['target']}")
        hp = dict(common, lr=args.target_lr, seed=args.seed + 1)
        hp.update(max_steps=args.target_steps, minutes=args.target_minutes)

        def target_eval():
            return tr.evaluate(target, None, windows, args.batch_size, device, amp)

        tr.train_phase(
            "target",
            target,
            lambda m, x, y: tr.lm_loss(m, x, y, device, amp),
            train_ids,
            target_eval,
            path,
            hp,
            device,
            log,
            resume=not fresh,
        )
    if "draft" in phases:
        path = out / "draft.pt"
        fresh = guard(path, "the draft")
        target, _ = load_done("target")
        for p in target.parameters():
            p.requires_grad_(False)
        draft = tr.make_model(args.sizes["draft"], vocab, eot, args.context, args.seed + 7)
        log(f"draft: {tr.count_params(draft)} params, {args.sizes['draft']}")
        hp = dict(common, lr=args.draft_lr, seed=args.seed + 2)
        hp.update(max_steps=args.draft_steps, minutes=args.draft_minutes)
        weights = {"kl": args.kl_weight, "tv": args.tv_weight, "ce": args.ce_weight}

        def draft_eval():
            return tr.evaluate(target, draft, windows, args.batch_size, device, amp)

        tr.train_phase(
            "draft",
            draft,
            lambda m, x, y: tr.distill_loss(target, m, x, y, weights, device, amp),
            train_ids,
            draft_eval,
            path,
            hp,
            device,
            log,
            resume=not fresh,
        )
    if "export" in phases:
        target, tck = load_done("target")
        draft, dck = load_done("draft")
        export.export(args, target, draft, tck, dck, meta, heldout_ids, device, log, t_start)
    log(f"done ({', '.join(phases)}) in {(time.time() - t_start) / 60:.1f} min")


if __name__ == "__main__":
    main()
