"""The offline bench's workload: prompts of a fixed token length, from a file or from the
built-in pair's held-out stdlib files; or an agent's sessions (``agentic_workload.py``)."""

from __future__ import annotations

import json
import random
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specbatch.engine.llm_engine import LLMEngine
from specbatch.errors import InvalidInputError
from specbatch.prompts_file import read_prompts
from specbatch.sampling_params import SamplingParams

TRAINING_JSON = Path(__file__).resolve().parent.parent / "assets" / "default_pair" / "training.json"
WORKLOADS = ("heldout", "grounded", "agentic")
GROUNDED_REPEAT = 16  # tokens of a function repeated after it in a grounded prompt


@dataclass
class Workload:
    """Prompts of exactly ``input_len`` token ids (the agentic workload's: at most); request
    ``i`` uses ``prompts[i % n]``, the temperature ``temperatures[i % n]`` when the workload
    sets one per prompt, and its ``max_tokens`` scaled by ``length_factors[i % n]`` when it
    sets those."""

    prompts: list[list[int]]
    input_len: int
    output_len: int  # the mean output length
    source: str
    temperatures: list[float] | None = None
    length_factors: list[float] | None = None

    def prompt(self, i: int) -> list[int]:
        return self.prompts[i % len(self.prompts)]

    def params(self, i: int, base: SamplingParams) -> SamplingParams:
        """Request ``i``'s sampling parameters: ``base``, with this prompt's temperature and
        length factor."""
        if self.temperatures is not None:
            base = replace(base, temperature=self.temperatures[i % len(self.temperatures)])
        if self.length_factors is not None and base.max_tokens is not None:
            factor = self.length_factors[i % len(self.length_factors)]
            base = replace(base, max_tokens=max(1, round(base.max_tokens * factor)))
        return base


def with_shared_prefix(workload: Workload, prefix: list[int]) -> Workload:
    """Every prompt preceded by the same ``prefix`` (a system prompt, few-shot examples): what
    the prefix cache is for."""
    if not prefix:
        return workload
    prompts = [prefix + p for p in workload.prompts]
    source = f"{workload.source}, each after one shared prefix of {len(prefix)} tokens"
    return replace(
        workload, prompts=prompts, input_len=workload.input_len + len(prefix), source=source
    )


def shared_prefix(engine: LLMEngine, length: int, seed: int = 0) -> list[int]:
    """``length`` tokens of the bench's default prompts (a window of the held-out text, or
    random ids), drawn apart from the prompts themselves."""
    if length < 1:
        return []
    return build_workload(
        engine, input_len=length, output_len=2, num_prompts=1, seed=seed + 1
    ).prompts[0]


def spread_output_lengths(workload: Workload, spread: float, seed: int = 0) -> Workload:
    """Each prompt's output length drawn uniformly from ``output_len * [1 - spread, 1 +
    spread]`` (seeded: the same for every draft length of a bench). With every request of one
    length, plain decoding runs in lockstep: a batch starts together, finishes in one step and
    is replaced by a batch prefilled in one pass, and a cell never drains. No server sees
    that; a spread of lengths desynchronises plain decoding as a speculative request's
    uneven progress does."""
    if spread == 0:
        return workload
    rng = random.Random(seed)
    factors = [rng.uniform(1 - spread, 1 + spread) for _ in workload.prompts]
    source = f"{workload.source}; output lengths spread +-{spread:.0%}"
    return replace(workload, length_factors=factors, source=source)


# Repetitive code: a draft model continues these as its target does (alpha near 1 for the
# built-in pair, greedy), unlike ordinary text (alpha about 0.6-0.7).
EASY_CODE = [f"import {m}\n" * 16 for m in ("os", "sys", "re", "json")] + [
    f"{name} = [" + f"{d}, " * 40 for name, d in (("x", 0), ("y", 1), ("zeros", 0), ("ones", 1))
]


def mixed(workload: Workload, tokenizer: Any, hard_temperature: float) -> Workload:
    """Easy and hard requests in turn: even ones are repetitive code (``EASY_CODE``) decoded
    greedily, odd ones keep their prompt (held-out text) and sample at ``hard_temperature``.
    Without a tokenizer an easy prompt repeats one token id."""
    prompts, temperatures = [], []
    for i, p in enumerate(workload.prompts):
        if i % 2:
            prompts.append(p)
            temperatures.append(hard_temperature)
            continue
        code = EASY_CODE[(i // 2) % len(EASY_CODE)]
        ids = tokenizer.encode(code) if tokenizer is not None else [p[0]]
        prompts.append(_fit(ids, workload.input_len))
        temperatures.append(0.0)
    source = (
        f"mixed: even requests repetitive code, greedy; odd ones {workload.source}, sampled at "
        f"temperature {hard_temperature}"
    )
    return Workload(prompts, workload.input_len, workload.output_len, source, temperatures)


def _fit(ids: Sequence[int], length: int) -> list[int]:
    """``ids`` cut to ``length`` tokens, or repeated until it is that long."""
    if not ids:
        raise InvalidInputError("prompts: a prompt has no tokens", "prompts")
    reps = -(-length // len(ids))
    return (list(ids) * reps)[:length]


def heldout_texts() -> tuple[list[str], str]:
    """The built-in pair's held-out stdlib files (training.json), read from this interpreter's
    stdlib, and where they were found."""
    meta = json.loads(TRAINING_JSON.read_text())
    paths = meta["data"]["heldout_files"]["paths"]
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for rel in paths:
        try:
            texts.append((root / rel).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    if not texts:
        raise InvalidInputError(
            f"prompts: none of the held-out stdlib files is under {root}", "prompts"
        )
    return texts, f"held-out stdlib files ({len(texts)}/{len(paths)} under {root})"


def _encode(tokenizer: Any, text: str) -> list[int]:
    try:  # whole files are longer than the models' context: no warning for that
        return list(tokenizer.encode(text, verbose=False))
    except TypeError:
        return list(tokenizer.encode(text))


def heldout_token_stream(tokenizer: Any) -> tuple[list[int], str]:
    """The held-out stdlib files tokenized end to end."""
    texts, source = heldout_texts()
    ids: list[int] = []
    for text in texts:
        ids.extend(_encode(tokenizer, text))
    return ids, source


def functions(text: str) -> list[str]:
    """The ``def`` blocks of a Python source: from a ``def`` line to the next line that is
    indented no deeper (blank lines aside)."""
    lines = text.splitlines(keepends=True)
    out = []
    for i, line in enumerate(lines):
        stripped = line.lstrip()
        if not stripped.startswith("def "):
            continue
        indent = len(line) - len(stripped)
        end = i + 1
        while end < len(lines):
            nxt = lines[end]
            if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                break
            end += 1
        out.append("".join(lines[i:end]))
    return out


def grounded_prompts(
    tokenizer: Any, input_len: int, num_prompts: int, seed: int = 0
) -> tuple[list[list[int]], str]:
    """Input-grounded prompts, whose natural continuation copies a span of the prompt: a
    held-out stdlib function's first ``input_len - GROUNDED_REPEAT - 2`` tokens, a blank line,
    then its first ``GROUNDED_REPEAT`` tokens again (a model that continues the repeat copies
    the function from there on)."""
    texts, source = heldout_texts()
    sep = _encode(tokenizer, "\n\n")
    body = input_len - GROUNDED_REPEAT - len(sep)
    if body <= GROUNDED_REPEAT:
        raise InvalidInputError(
            f"input_len: the grounded workload needs more than {2 * GROUNDED_REPEAT + len(sep)} "
            f"tokens, got {input_len}",
            "input_len",
        )
    pool = []
    for text in texts:
        for fn in functions(text):
            ids = _encode(tokenizer, fn)
            if len(ids) >= body:
                pool.append(ids[:body] + sep + ids[:GROUNDED_REPEAT])
    if not pool:
        raise InvalidInputError(f"input_len: no held-out function has {body} tokens", "input_len")
    rng = random.Random(seed)
    prompts = [pool[rng.randrange(len(pool))] for _ in range(num_prompts)]
    return prompts, (
        f"grounded: {len(pool)} functions of {source}, each cut to {body} tokens and followed "
        f"by a blank line and its first {GROUNDED_REPEAT} tokens again"
    )


def build_workload(
    engine: LLMEngine,
    *,
    input_len: int,
    output_len: int,
    num_prompts: int,
    prompts_file: str | None = None,
    seed: int = 0,
    grounded: bool = False,
) -> Workload:
    """The prompts: from ``prompts_file`` (.txt or .jsonl, each cut or repeated to
    ``input_len`` tokens), else ``grounded_prompts`` when ``grounded``, else windows of
    ``input_len`` tokens at random offsets of the held-out stdlib text, else (a model without
    a tokenizer) random token ids."""
    rng = random.Random(seed)
    tok = engine.tokenizer
    if grounded:
        if tok is None:
            raise InvalidInputError("workload: the grounded workload needs a tokenizer", "workload")
        prompts, source = grounded_prompts(tok, input_len, num_prompts, seed)
        return Workload(prompts, input_len, output_len, source)
    if prompts_file is not None:
        pf = read_prompts(prompts_file)
        if pf.errors:
            e = pf.errors[0]
            raise InvalidInputError(f"prompts: {pf.where(e.line_no)}: {e.message}", "prompts")
        if not pf.prompts:
            raise InvalidInputError(f"prompts: '{prompts_file}' holds no prompt", "prompts")
        prompts = [
            _fit(engine.prepare_prompt(p.prompt, field="prompts")[1], input_len) for p in pf.prompts
        ]
        return Workload(prompts, input_len, output_len, f"file {prompts_file}")
    if tok is not None:
        stream, source = heldout_token_stream(tok)
        if len(stream) <= input_len:
            stream = _fit(stream, input_len + 1)
        starts = [rng.randrange(len(stream) - input_len) for _ in range(num_prompts)]
        prompts = [stream[s : s + input_len] for s in starts]
        return Workload(prompts, input_len, output_len, source)
    vocab = engine.config.target.vocab_size
    low = 3 if vocab > 3 else 0  # random checkpoints keep 0-2 for unk/bos/eos
    prompts = [[rng.randrange(low, vocab) for _ in range(input_len)] for _ in range(num_prompts)]
    return Workload(prompts, input_len, output_len, f"random token ids (seed {seed})")
