"""The offline bench's workload: prompts of a fixed token length, from a file or from the
built-in pair's held-out stdlib files."""

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
from specbatch.sampling_params import SamplingParams

TRAINING_JSON = Path(__file__).resolve().parent.parent / "assets" / "default_pair" / "training.json"


@dataclass
class Workload:
    """Prompts of exactly ``input_len`` token ids; request ``i`` uses ``prompts[i % n]``, the
    temperature ``temperatures[i % n]`` when the workload sets one per prompt, and its
    ``max_tokens`` scaled by ``length_factors[i % n]`` when it sets those."""

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
        raise InvalidInputError("prompts: a prompt has no tokens")
    reps = -(-length // len(ids))
    return (list(ids) * reps)[:length]


def heldout_token_stream(tokenizer: Any) -> tuple[list[int], str]:
    """The built-in pair's held-out stdlib files (training.json), read from this interpreter's
    stdlib and tokenized end to end."""
    meta = json.loads(TRAINING_JSON.read_text())
    paths = meta["data"]["heldout_files"]["paths"]
    root = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    found = 0
    for rel in paths:
        f = root / rel
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        found += 1
        try:  # whole files are longer than the models' context: no warning for that
            ids.extend(tokenizer.encode(text, verbose=False))
        except TypeError:
            ids.extend(tokenizer.encode(text))
    if not ids:
        raise InvalidInputError(f"prompts: none of the held-out stdlib files is under {root}")
    return ids, f"held-out stdlib files ({found}/{len(paths)} under {root})"


def build_workload(
    engine: LLMEngine,
    *,
    input_len: int,
    output_len: int,
    num_prompts: int,
    prompts_file: str | None = None,
    seed: int = 0,
) -> Workload:
    """The prompts: from ``prompts_file`` (.txt or .jsonl, each cut or repeated to
    ``input_len`` tokens), else windows of ``input_len`` tokens at random offsets of the held-out
    stdlib text, else (a model without a tokenizer) random token ids."""
    rng = random.Random(seed)
    tok = engine.tokenizer
    if prompts_file is not None:
        from specbatch.entrypoints.prompts_file import read_prompts

        pf = read_prompts(prompts_file)
        if pf.errors:
            e = pf.errors[0]
            raise InvalidInputError(f"prompts: {pf.where(e.line_no)}: {e.message}")
        if not pf.prompts:
            raise InvalidInputError(f"prompts: '{prompts_file}' holds no prompt")
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
