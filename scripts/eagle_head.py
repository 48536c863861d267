"""The EAGLE-3 head as scripts/train_eagle.py trains it, and its distillation loss unrolled over
draft steps (the inputs and attention each step has when drafting)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def rope_tables(d: int, length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    freqs = torch.arange(length).float()[:, None] * inv[None]
    return freqs.cos(), freqs.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class Head(nn.Module):
    """EAGLE-3: f = fc(streams) (the head's own g at later draft steps); y = f +
    attn([norm(e); norm(f)]); g = y + mlp(norm(y)); q = softmax(lm_head(norm(g))) over the draft
    vocabulary. The final norm and LM head start as the target's (its rows of the draft
    vocabulary). Parameter names as exported (less the prefix)."""

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
    """sum_r w_r (KL(p_r || q_r) + TV(p_tv_r, q_r)) for q = softmax(z), and sum_r w_r
    TV(p_tv_r, q_r) (not differentiated), over row chunks; ``p_tv`` defaults to ``p``. With a
    draft vocabulary, ``p`` is the target's distribution renormalised on it and ``p_tv`` its
    mass there, not renormalised, so that 1 - p_tv's mass off the vocabulary counts as
    rejected. The gradient is computed with the loss, in a few passes over the vocabulary, a
    chunk of rows at a time (rows that fit a CPU's cache; more on a GPU):
    d/dz KL = q - p, d/dz TV = q (s - <q, s>) / 2 with s = sign(q - p_tv)."""

    CHUNK = 256

    @staticmethod
    def forward(ctx, z, p, log_p, w, p_tv=None):
        p_tv = p if p_tv is None else p_tv
        grad = torch.empty(z.shape, dtype=torch.float32, device=z.device)
        kl = tv = z.new_zeros((), dtype=torch.float32)
        chunk = DistillLoss.CHUNK if z.device.type == "cpu" else 32 * DistillLoss.CHUNK
        for r in range(0, len(z), chunk):
            rows = slice(r, r + chunk)
            wr = w[rows, None]
            log_q = torch.log_softmax(z[rows].float(), dim=-1)
            q = log_q.exp()
            kl = kl + (wr * p[rows] * (log_p[rows] - log_q)).sum()
            d = q - p_tv[rows]
            tv = tv + 0.5 * (wr * d.abs()).sum()
            sign = d.sign()
            g = grad[rows]
            torch.mul(q, sign - (q * sign).sum(-1, keepdim=True), out=g)
            g.mul_(0.5).add_(q).sub_(p[rows]).mul_(wr)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(tv)
        ctx.dtype = z.dtype
        return kl + tv, tv

    @staticmethod
    def backward(ctx, grad_loss, _grad_tv):
        (grad,) = ctx.saved_tensors
        return (grad * grad_loss).to(ctx.dtype), None, None, None, None


def target_p(final: torch.Tensor, lm_head: torch.Tensor, vocab: torch.Tensor | None):
    """The target's p at rows of final hidden states: (p on the draft vocabulary renormalised,
    its log, p there not renormalised, its mass there); the three the same for the full
    vocabulary (``vocab`` None)."""
    with torch.no_grad(), torch.autocast(final.device.type, enabled=False):
        log_p = F.log_softmax(final.float() @ lm_head.float().T, -1)
        if vocab is None:
            p = log_p.exp()
            return p, log_p, p, torch.ones(len(p), device=p.device)
        log_p = log_p[:, vocab]
        p_tv = log_p.exp()
        mass = p_tv.sum(-1)
        log_p = log_p - mass.log()[:, None]
        return log_p.exp(), log_p, p_tv, mass


def unrolled_loss(head: Head, embed: torch.Tensor, lm_head: torch.Tensor, tokens, final, streams,
                  unroll: int, step_decay: float, noise: float, mask: torch.Tensor | None = None,
                  vocab: torch.Tensor | None = None):  # fmt: skip
    """Loss over ``unroll`` draft steps. Step k at position i reads token i + 1 and (k = 1) the
    fc of the target's streams at i, else the head's step k-1 output at i - 1; it attends to the
    keys a drafting head has: step 1's (target features) up to i - k + 1, then step m's at
    i - k + m. Positions count where ``mask`` [b, t] is true (default all) and step k's inputs
    exist (i >= k - 1); ``vocab`` is the draft vocabulary's target ids (None: all of them).
    Returns the loss and the mean of sum_x min(p, q) (alpha) at each step."""
    b, t = tokens.shape[0], tokens.shape[1] - 1
    e = embed[tokens[:, 1:].long()]  # position i reads token i + 1
    dev = tokens.device
    pos = torch.arange(t, device=dev).expand(b, t).reshape(-1)
    if mask is None:
        rows = torch.arange(b * t, device=dev)
    else:
        rows = mask.reshape(-1).nonzero().squeeze(1)
    p, log_p, p_tv, mass = target_p(final[:, 1:].reshape(b * t, -1)[rows], lm_head, vocab)
    s_in = streams[:, :-1].float()
    if noise:
        s_in = s_in + torch.randn_like(s_in) * noise * s_in.pow(2).mean().sqrt()
    feat = head.fc(s_in)
    keys: list[tuple[torch.Tensor, torch.Tensor]] = []
    total, alphas = 0.0, []
    i, j = torch.arange(t, device=dev)[:, None], torch.arange(t, device=dev)[None, :]
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
        keep = pos[rows] >= k - 1  # the mean over positions whose inputs exist at step k
        if keep.any():
            n = int(keep.sum())
            weight = torch.full((n,), 1.0 / n, device=dev)
            z = head.logits(g.reshape(b * t, -1)[rows[keep]])
            loss, tv = DistillLoss.apply(z, p[keep], log_p[keep], weight, p_tv[keep])
            total = total + step_decay ** (k - 1) * loss
            # sum_x min(p, q) = (mass + 1) / 2 - TV-term, the TV-term over the draft vocabulary
            alphas.append(((1.0 + mass[keep]) / 2).mean().item() - tv.item())
        else:
            alphas.append(float("nan"))
        feat = torch.cat([feat[:, :1], g[:, :-1]], dim=1)  # step k + 1 at i reads g(i - 1)
    return total, alphas
