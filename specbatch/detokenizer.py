"""Incremental detokenization: turn a growing list of token ids into text deltas."""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 5  # prompt tokens decoded with the output, so a leading space survives


class IncrementalDetokenizer:
    """Text of a request's output, one token at a time, never splitting a UTF-8 character.

    Decodes only a short window of recent tokens per step. The deltas returned by ``append`` and
    ``flush`` add up to the request's whole output text; ``token_texts`` holds each token's own
    share of it (a token holding part of a character gets "" and the one completing it the
    character; what ``flush`` releases goes to the last token), so they join into ``text``.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""
        self.token_texts: list[str] = []

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> str:
        self._ids.append(token_id)
        prev = self._decode(self._ids[self._prefix : self._read])
        new = self._decode(self._ids[self._prefix :])
        delta = ""
        if len(new) > len(prev) and not new.endswith("\ufffd"):  # else half a character
            delta = new[len(prev) :]
            self._prefix, self._read = self._read, len(self._ids)
            self.text += delta
        self.token_texts.append(delta)
        return delta

    def flush(self) -> str:
        """Whatever is still held back (e.g. an incomplete character at the end)."""
        prev = self._decode(self._ids[self._prefix : self._read])
        new = self._decode(self._ids[self._prefix :])
        delta = new[len(prev) :] if len(new) > len(prev) else ""
        self._prefix = self._read = len(self._ids)
        self.text += delta
        if delta and self.token_texts:
            self.token_texts[-1] += delta
        return delta


def token_texts(tokenizer: Any, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    """Each token's share of the text of ``ids`` (which they join into)."""
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens)
    for t in ids:
        detok.append(t)
    detok.flush()
    return detok.token_texts
