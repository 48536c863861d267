"""Appends emitted tokens to a request and decides when it is done."""

from __future__ import annotations

from typing import Any

from specbatch.detokenizer import IncrementalDetokenizer
from specbatch.request import FinishReason, Request


class StopChecker:
    """EOS, stop token ids, stop strings, max_tokens and max_model_len, checked token by token.

    Tokens are appended one at a time, so a stop condition inside a run of accepted drafts ends
    the request exactly there and the later tokens are dropped.
    """

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._detok: dict[str, IncrementalDetokenizer] = {}

    def text(self, req: Request) -> str:
        detok = self._detok.get(req.request_id)
        return detok.text if detok else ""

    def token_texts(self, req: Request) -> list[str] | None:
        """Each output token's share of the text (see ``IncrementalDetokenizer``)."""
        detok = self._detok.get(req.request_id)
        return detok.token_texts if detok else None

    def forget(self, request_id: str) -> None:
        self._detok.pop(request_id, None)

    def append(self, req: Request, token_id: int) -> bool:
        """Append one token; True (with ``req.finish_reason`` set) when the request is done."""
        req.output_token_ids.append(token_id)
        sp = req.sampling_params
        detok = self._detokenizer(req)
        delta = detok.append(token_id) if detok else ""
        if len(req.output_token_ids) < sp.min_tokens:  # min_tokens: only the length stops it
            return self._length(req)
        if token_id in req.eos_token_ids and not sp.ignore_eos:
            return self._done(req, FinishReason.STOP, None)
        if token_id in sp.stop_token_ids:
            return self._done(req, FinishReason.STOP, token_id)
        if delta and sp.stop_strings and self._stop_string(req, detok, len(delta)):
            return True
        return self._length(req)

    def _length(self, req: Request) -> bool:
        if len(req.output_token_ids) >= req.max_output_tokens:
            return self._done(req, FinishReason.LENGTH, None)
        return False

    def _detokenizer(self, req: Request) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        detok = self._detok.get(req.request_id)
        if detok is None:
            detok = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, req.sampling_params.skip_special_tokens
            )
            self._detok[req.request_id] = detok
        return detok

    def _stop_string(self, req: Request, detok: IncrementalDetokenizer, delta_len: int) -> bool:
        sp = req.sampling_params
        text = detok.text
        for stop in sp.stop_strings:
            start = max(0, len(text) - delta_len - len(stop) + 1)
            idx = text.find(stop, start)
            if idx >= 0:
                end = idx + len(stop) if sp.include_stop_str_in_output else idx
                detok.text = text[:end]
                return self._done(req, FinishReason.STOP, stop)
        return False

    def finish_text(self, req: Request) -> str:
        """The request's final text (flushing held-back bytes unless a stop string cut it)."""
        detok = self._detok.get(req.request_id)
        if detok is None:
            return ""
        if req.stop_reason is None or not isinstance(req.stop_reason, str):
            detok.flush()
        return detok.text

    @staticmethod
    def _done(req: Request, reason: FinishReason, stop_reason: str | int | None) -> bool:
        req.finish_reason = reason
        req.stop_reason = stop_reason
        return True
