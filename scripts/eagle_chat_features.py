"""Chat data for scripts/train_eagle.py: the target's features over its own answers
(scripts/chat_answers.py's JSON lines), computed by specbatch's own forward (the values a head
reads when drafting), stored ragged, batched padded with a mask over the answer positions, and
the draft vocabulary (the answers' most frequent tokens)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch


def load_chat(path: Path) -> dict[str, list[dict]]:
    """The answered conversations by split ('train', 'heldout'), empty answers left out."""
    out: dict[str, list[dict]] = {"train": [], "heldout": []}
    with path.open() as f:
        for line in f:
            rec = json.loads(line)
            if rec["answer_token_ids"]:
                out[rec["split"]].append(rec)
    return out


def draft_vocab(train: list[dict], size: int, vocab_size: int, always: list[int]) -> torch.Tensor:
    """The ``size`` tokens most frequent in the training answers (``always`` among them; ties
    and the rest filled by the lowest ids), sorted: draft id i stands for target id vocab[i]."""
    counts = Counter(t for rec in train for t in rec["answer_token_ids"])
    chosen = dict.fromkeys(always)
    for tok, _ in counts.most_common():
        if len(chosen) >= size:
            break
        chosen.setdefault(tok)
    for tok in range(vocab_size):
        if len(chosen) >= size:
            break
        chosen.setdefault(tok)
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def coverage(records: list[dict], vocab: torch.Tensor | None) -> float:
    """The share of the answers' tokens inside the draft vocabulary."""
    tokens = [t for rec in records for t in rec["answer_token_ids"]]
    if vocab is None or not tokens:
        return 1.0
    inside = set(vocab.tolist())
    return sum(t in inside for t in tokens) / len(tokens)


class Featuriser:
    """The target on specbatch's layers (and CPU kernels): for sequences, the final normed
    hidden states and the residual streams entering the layers ``streams``, concatenated."""

    BLOCK = 16

    def __init__(self, path: Path, streams: list[int]) -> None:
        from specbatch.model.loader import load_model

        self.model = load_model(path, torch.float32, "cpu")
        self.streams = tuple(streams)

    @torch.inference_mode()
    def __call__(self, seqs: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        from specbatch.model.layers.attention import AttentionMetadata

        lens = [len(s) for s in seqs]
        blocks = [-(-n // self.BLOCK) for n in lens]
        caches = self.model.allocate_kv_caches(sum(blocks), self.BLOCK, "cpu")
        firsts = [sum(blocks[:i]) for i in range(len(blocks))]
        tables = [list(range(f, f + b)) for f, b in zip(firsts, blocks, strict=True)]
        meta = AttentionMetadata.from_lists(lens, lens, tables, self.BLOCK)
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64)
        positions = torch.cat([torch.arange(n) for n in lens])
        final, kept = self.model.model(ids, positions, caches, meta, self.streams)
        streams = torch.cat(kept, dim=-1)
        return [(f.to(torch.bfloat16), s.to(torch.bfloat16))
                for f, s in zip(final.split(lens), streams.split(lens), strict=True)]  # fmt: skip


def featurise_chat(records: list[dict], featurise: Callable, batch_tokens: int = 4096) -> dict:
    """Every record's prompt + answer through the target (``featurise(seqs)`` -> [(final,
    streams)] per sequence), some ``batch_tokens`` at a time, stored flat: tokens, final,
    streams, offsets (the record r is rows offsets[r]:offsets[r + 1]) and prompt lengths."""
    seqs = [rec["prompt_token_ids"] + rec["answer_token_ids"] for rec in records]
    finals: list[torch.Tensor] = []
    streams: list[torch.Tensor] = []
    start = 0
    while start < len(seqs):
        end, total = start, 0
        while end < len(seqs) and (end == start or total + len(seqs[end]) <= batch_tokens):
            total += len(seqs[end])
            end += 1
        for final, stream in featurise(seqs[start:end]):
            finals.append(final)
            streams.append(stream)
        start = end
    lengths = torch.tensor([len(s) for s in seqs])
    return {
        "tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
        "final": torch.cat(finals),
        "streams": torch.cat(streams),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        "prompt_lens": torch.tensor([len(rec["prompt_token_ids"]) for rec in records]),
    }


def chat_batch(blob: dict, seqs: list[int]):
    """Records ``seqs`` padded to the longest: tokens [b, L], final [b, L, h], streams
    [b, L, n*h], and the loss mask [b, L - 1]: position i (which reads token i + 1 and learns
    the target's p after it) counts when token i + 1 is an answer token the target drafts after
    (not the last: nothing is drafted after the answer ends)."""
    off, plen = blob["offsets"], blob["prompt_lens"]
    lens = [int(off[r + 1] - off[r]) for r in seqs]
    width = max(lens)
    h, hs = blob["final"].shape[1], blob["streams"].shape[1]
    tokens = torch.zeros(len(seqs), width, dtype=torch.int64)
    final = torch.zeros(len(seqs), width, h, dtype=blob["final"].dtype)
    streams = torch.zeros(len(seqs), width, hs, dtype=blob["streams"].dtype)
    mask = torch.zeros(len(seqs), width - 1, dtype=torch.bool)
    for row, (r, n) in enumerate(zip(seqs, lens, strict=True)):
        rows = slice(int(off[r]), int(off[r]) + n)
        tokens[row, :n] = blob["tokens"][rows]
        final[row, :n] = blob["final"][rows]
        streams[row, :n] = blob["streams"][rows]
        mask[row, int(plen[r]) - 1 : n - 2] = True
    return tokens, final, streams, mask


def length_batches(blob: dict, batch_size: int, gen: torch.Generator) -> Callable[[], list[int]]:
    """A sampler of training batches: ``batch_size`` records of similar lengths (a random run
    of the records sorted by length), so little of a batch is padding."""
    lens = blob["offsets"][1:] - blob["offsets"][:-1]
    order = torch.argsort(lens).tolist()
    size = min(batch_size, len(order))

    def sample() -> list[int]:
        start = int(torch.randint(0, len(order) - size + 1, (1,), generator=gen))
        return order[start : start + size]

    return sample
