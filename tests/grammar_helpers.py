"""References for structured outputs, built with transformers' logits and xgrammar's matcher
directly (not through specbatch's worker): the exact law of sampling the grammar-masked
target, and its masked greedy output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specbatch.worker.sampler import SamplingTensors, logits_to_probs
from tests.helpers import hf_model


def compile_reference(
    model_dir: Path | str, kind: str, value: Any, eos: int, any_whitespace: bool = True
) -> Any:
    """``value`` compiled by xgrammar itself for the checkpoint's tokenizer (EOS ends it)."""
    import json

    import xgrammar as xgr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    if kind == "regex":
        return compiler.compile_regex(value)
    if kind == "choice":
        return compiler.compile_regex("|".join(_regex_literal(c) for c in value))
    if kind == "json":
        return compiler.compile_json_schema(json.dumps(value), any_whitespace=any_whitespace)
    raise ValueError(kind)


def _regex_literal(text: str) -> str:
    return "".join(c if c.isalnum() else f"\\{c}" for c in text)


def _mask(logits: torch.Tensor, matcher: Any) -> torch.Tensor:
    import xgrammar as xgr

    bits = xgr.allocate_token_bitmask(1, logits.shape[-1])
    matcher.fill_next_token_bitmask(bits)
    out = logits.float().clone().view(1, -1)
    xgr.apply_token_bitmask_inplace(out, bits)
    return out[0]


def _matcher(compiled: Any, tokens: tuple[int, ...]) -> Any:
    import xgrammar as xgr

    m = xgr.GrammarMatcher(compiled)
    for t in tokens:
        assert m.accept_token(t), f"reference: token {t} outside the grammar"
    return m


@torch.inference_mode()
def masked_law(
    model_dir: Path | str, prompt: list[int], compiled: Any, temperature: float
) -> dict[tuple[int, ...], float]:
    """P(output) of sampling the target masked by the grammar at every token, over every
    complete output (its EOS included), by enumeration."""
    model = hf_model(model_dir)
    done: dict[tuple[int, ...], float] = {}
    frontier: dict[tuple[int, ...], float] = {(): 1.0}
    while frontier:
        seqs = list(frontier)
        logits = torch.stack([model(torch.tensor([prompt + list(s)])).logits[0, -1] for s in seqs])
        nxt: dict[tuple[int, ...], float] = {}
        for s, row in zip(seqs, logits, strict=True):
            st = SamplingTensors.from_lists([temperature], [0], [1.0], [0.0])
            probs = logits_to_probs(_mask(row, _matcher(compiled, s)).view(1, -1), st)[0]
            for tok in probs.nonzero()[:, 0].tolist():
                seq, mass = (*s, tok), frontier[s] * float(probs[tok])
                if _matcher(compiled, seq).is_terminated():
                    done[seq] = mass
                else:
                    nxt[seq] = mass
        frontier = nxt
    total = sum(done.values())
    return {s: m / total for s, m in done.items()}


@torch.inference_mode()
def masked_greedy(
    model_dir: Path | str, prompt: list[int], compiled: Any, max_tokens: int
) -> list[int]:
    """The argmax of the grammar-masked target, token by token, until the grammar ends (its
    EOS included) or ``max_tokens``."""
    model = hf_model(model_dir)
    out: list[int] = []
    matcher = _matcher(compiled, ())
    while len(out) < max_tokens and not matcher.is_terminated():
        logits = model(torch.tensor([prompt + out])).logits[0, -1]
        tok = int(_mask(logits, matcher).argmax())
        assert matcher.accept_token(tok)
        out.append(tok)
    return out
