"""Training loops for scripts/train_pair.py: models, batches, metrics, resumable checkpoints.

Phase ``target`` minimises next-token cross-entropy. Phase ``draft`` distils the frozen target
into the draft: ``kl_w * KL(p || q) + tv_w * TV(p, q) + ce_w * CE(data, q)`` where ``p`` is the
target's and ``q`` the draft's next-token distribution at temperature 1, the target's logits
computed on the fly. Acceptance of speculative decoding is ``alpha = sum_x min(p, q) = 1 - TV``.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def make_model(sizes: dict, vocab: int, eot: int, context: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=sizes["hidden"],
        intermediate_size=sizes["intermediate"],
        num_hidden_layers=sizes["layers"],
        num_attention_heads=sizes["heads"],
        num_key_value_heads=sizes["kv_heads"],
        max_position_embeddings=context,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def autocast(device: torch.device, amp: bool):
    if not amp:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def logits_of(model, x, device, amp) -> torch.Tensor:
    with autocast(device, amp):
        out = model(input_ids=x, use_cache=False).logits
    return out.float()


def eval_windows(stream: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """``count`` non-overlapping windows of ``seq_len + 1`` tokens, evenly spread (fixed)."""
    n_avail = (stream.numel() - 1) // (seq_len + 1)
    count = max(1, min(count, n_avail))
    starts = [(i * n_avail // count) * (seq_len + 1) for i in range(count)]
    return torch.stack([stream[s : s + seq_len + 1].long() for s in starts])


@torch.no_grad()
def evaluate(target, draft, windows, batch_size, device, amp) -> dict:
    """Held-out mean loss of each model; for the draft alpha = E[sum min(p, q)], greedy match."""
    sums = {"target_loss": 0.0, "draft_loss": 0.0, "alpha": 0.0, "greedy": 0.0, "kl": 0.0}
    n = 0
    for i in range(0, windows.shape[0], batch_size):
        w = windows[i : i + batch_size].to(device)
        x, y = w[:, :-1], w[:, 1:].reshape(-1)
        count = y.numel()
        n += count
        if target is not None:
            lp = logits_of(target, x, device, amp).reshape(count, -1)
            sums["target_loss"] += F.cross_entropy(lp, y, reduction="sum").item()
        if draft is not None:
            lq = logits_of(draft, x, device, amp).reshape(count, -1)
            sums["draft_loss"] += F.cross_entropy(lq, y, reduction="sum").item()
        if target is not None and draft is not None:
            logp, logq = lp.log_softmax(-1), lq.log_softmax(-1)
            sums["alpha"] += torch.minimum(logp, logq).exp().sum().item()
            sums["greedy"] += (lp.argmax(-1) == lq.argmax(-1)).sum().item()
            sums["kl"] += (logp.exp() * (logp - logq)).sum().item()
    res = {k: v / n for k, v in sums.items()}
    keep = (["target_loss"] if target is not None else []) + (
        ["draft_loss"] if draft is not None else []
    )
    if target is not None and draft is not None:
        keep += ["alpha", "greedy", "kl"]
    res = {k: round(res[k], 5) for k in keep}
    res["positions"] = n
    return res


def distill_loss(target, draft, x, y, weights, device, amp):
    with torch.no_grad():
        lp = logits_of(target, x, device, amp)
        logp = lp.log_softmax(-1)
        p = logp.exp()
    lq = logits_of(draft, x, device, amp)
    logq = lq.log_softmax(-1)
    kl = (p * (logp - logq)).sum(-1).mean()
    tv = 0.5 * (p - logq.exp()).abs().sum(-1).mean()
    ce = F.cross_entropy(lq.reshape(-1, lq.shape[-1]), y.reshape(-1))
    loss = weights["kl"] * kl + weights["tv"] * tv + weights["ce"] * ce
    return loss, {"kl": kl.item(), "tv": tv.item(), "ce": ce.item()}


def lm_loss(model, x, y, device, amp):
    logits = logits_of(model, x, device, amp)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return loss, {"ce": loss.item()}


def make_optimizer(model, lr, weight_decay):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step, progress, peak, warmup, min_ratio=0.1) -> float:
    """Linear warmup over ``warmup`` steps, then cosine to ``min_ratio * peak`` over progress."""
    if step < warmup:
        return peak * (step + 1) / warmup
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return peak * (min_ratio + (1 - min_ratio) * cos)


def progress_of(state, hp) -> float:
    parts = []
    if hp["max_steps"]:
        parts.append(state["step"] / hp["max_steps"])
    if hp["minutes"]:
        parts.append(state["elapsed"] / (hp["minutes"] * 60))
    return max(parts)


def save_atomic(obj, path: Path):
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class StopFlag:
    """SIGTERM/SIGINT ask the loop to checkpoint and stop at the end of the current step."""

    def __init__(self):
        self.stop = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not in the main thread
                signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        self.stop = True


class ThreadTuner:
    """Chooses between ``max_threads`` and 1 CPU thread by measured step time.

    On a shared machine a niced multi-threaded job stalls at every parallel region whenever a
    core is busy with someone else's work, and one thread is then several times faster; on an
    idle machine the opposite holds. After ``first`` steps, then every ``every`` steps, the other
    setting is tried for one step and the faster one kept; each probe that loses doubles the
    wait before the next one (up to ``max_every``), so probing costs little when the answer
    does not change.
    """

    def __init__(
        self, max_threads: int, enabled: bool, first: int = 2, every: int = 40, max_every: int = 320
    ):
        self.opts = [max_threads, 1] if enabled and max_threads > 1 else [max_threads]
        self.every, self.interval = every, first
        self.max_every = max_every
        self.sec = {}  # EMA of seconds per step, per thread count
        self.cur = max_threads
        self.since = 0
        self.probing = None  # the thread count we came from while probing
        torch.set_num_threads(self.cur)

    def _switch(self, threads: int):
        if threads != self.cur:
            torch.set_num_threads(threads)
            self.cur = threads

    def after_step(self, seconds: float):
        old = self.sec.get(self.cur)
        self.sec[self.cur] = seconds if old is None or self.probing else 0.5 * (old + seconds)
        if len(self.opts) == 1:
            return
        self.since += 1
        if self.probing is not None:
            came_from, self.probing = self.probing, None
            won = self.sec[self.cur] < self.sec[came_from]
            backoff = min(2 * max(self.interval, self.every // 2), self.max_every)
            self.interval = self.every if won else backoff
            if not won:
                self._switch(came_from)
            self.since = 0
        elif self.since >= self.interval:
            self.probing = self.cur
            self._switch(next(t for t in self.opts if t != self.cur))


def pick_threads(fn, max_threads: int) -> int:
    """Time ``fn`` once with 1 and with ``max_threads`` threads and keep the faster."""
    times = {}
    for threads in sorted({1, max_threads}):
        torch.set_num_threads(threads)
        t = time.perf_counter()
        fn()
        times[threads] = time.perf_counter() - t
    best = min(times, key=times.get)
    torch.set_num_threads(best)
    return best


def train_phase(
    name: str,
    model,
    step_loss,
    train_stream: torch.Tensor,
    eval_fn,
    ckpt_path: Path,
    hp: dict,
    device,
    log,
    resume: bool,
):
    """Generic resumable loop. ``hp``: lr, warmup, weight_decay, batch_size, seq_len, seed,
    max_steps (or None), minutes (or None), ckpt_minutes, eval_minutes, log_every, grad_clip,
    threads, adaptive_threads. A resumed phase continues until the budgets given now are spent,
    so a finished phase can be extended by resuming it with a larger budget."""
    opt = make_optimizer(model, hp["lr"], hp["weight_decay"])
    gen = torch.Generator().manual_seed(hp["seed"])
    state = {"step": 0, "tokens": 0, "elapsed": 0.0, "history": [], "invocations": []}
    if resume and ckpt_path.exists():
        ck = torch.load(ckpt_path, weights_only=True, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optim"])
        gen.set_state(ck["gen_state"])
        torch.set_rng_state(ck["rng_state"])
        state = {k: ck[k] for k in state}
        log(f"[{name}] resumed at step {state['step']} ({state['elapsed'] / 60:.1f} min done)")
    state["invocations"].append(" ".join([sys.executable, *sys.argv]))
    model.to(device).train()
    if progress_of(state, hp) >= 1.0:
        log(f"[{name}] budget already spent (step {state['step']}), skipping")
        return state
    seq, bs = hp["seq_len"], hp["batch_size"]
    stop = StopFlag()
    tuner = ThreadTuner(hp["threads"], hp["adaptive_threads"])

    def progress():
        return progress_of(state, hp)

    def checkpoint(done):
        save_atomic(
            {
                "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                "optim": opt.state_dict(),
                "gen_state": gen.get_state(),
                "rng_state": torch.get_rng_state(),
                "done": done,
                "hp": {k: v for k, v in hp.items()},
                **state,
            },
            ckpt_path,
        )

    def run_eval():
        model.eval()
        res = eval_fn()
        model.train()
        res.update(step=state["step"], tokens=state["tokens"], minutes=state["elapsed"] / 60)
        state["history"].append(res)
        log(f"[{name}] eval {res}")

    last_ckpt = last_eval = time.time()
    t_log, tok_log = time.time(), 0
    n_tok = len(train_stream) - seq - 1
    while progress() < 1.0 and not stop.stop:
        t0 = time.time()
        starts = torch.randint(0, n_tok, (bs,), generator=gen)
        batch = torch.stack([train_stream[s : s + seq + 1] for s in starts.tolist()]).long()
        batch = batch.to(device)
        lr = lr_at(state["step"], progress(), hp["lr"], hp["warmup"])
        for g in opt.param_groups:
            g["lr"] = lr
        loss, parts = step_loss(model, batch[:, :-1], batch[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), hp["grad_clip"]).item()
        opt.step()
        tuner.after_step(time.time() - t0)
        state["step"] += 1
        state["tokens"] += bs * seq
        tok_log += bs * seq
        if state["step"] % hp["log_every"] == 0 or state["step"] == 1:
            dt = time.time() - t_log
            extra = " ".join(f"{k} {v:.4f}" for k, v in parts.items())
            log(
                f"[{name}] step {state['step']} loss {loss.item():.4f} ({extra}) lr {lr:.2e} "
                f"gnorm {gnorm:.2f} threads {tuner.cur} tok/s {tok_log / max(dt, 1e-9):.0f} "
                f"tokens {state['tokens']} elapsed {state['elapsed'] / 60:.1f} min "
                f"progress {100 * progress():.1f}%"
            )
            t_log, tok_log = time.time(), 0
        now = time.time()
        if now - last_eval > hp["eval_minutes"] * 60:
            run_eval()
            last_eval = time.time()
        if now - last_ckpt > hp["ckpt_minutes"] * 60:
            state["elapsed"] += time.time() - t0
            t0 = time.time()
            checkpoint(False)
            last_ckpt = time.time()
            log(f"[{name}] checkpoint step {state['step']} -> {ckpt_path}")
        state["elapsed"] += time.time() - t0
    torch.set_num_threads(hp["threads"])
    done = progress() >= 1.0
    if done:
        run_eval()
    checkpoint(done)
    log(f"[{name}] {'finished' if done else 'stopped'} at step {state['step']}, saved {ckpt_path}")
    if not done:
        raise SystemExit(f"{name} interrupted; continue with --resume")
    return state
