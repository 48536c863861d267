"""``specbatch generate``'s results file: what a resumed run finds there, the record of one
finished prompt, and the file itself, whose every write failure names ``--output``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specbatch.errors import InvalidInputError
from specbatch.outputs import CompletionOutput, RequestOutput
from specbatch.prompts_file import PromptLine, PromptsFile


class ResultsFile:
    """OUT, open for appending: one JSON line per finished prompt, flushed as it is written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._failed = False
        try:
            self._file = path.open("a", encoding="utf-8")
        except OSError as e:
            raise self._error(e) from None

    def _error(self, e: OSError) -> InvalidInputError:
        self._failed = True
        return InvalidInputError(f"output: cannot write '{self.path}': {e.strerror or e}", "output")

    def clear(self) -> None:
        """Empty the file (a run without --resume)."""
        try:
            self._file.truncate(0)
        except OSError as e:
            if not self.path.is_char_device():  # /dev/null and the like cannot be truncated
                raise self._error(e) from None

    def write(self, record: dict[str, Any]) -> None:
        try:
            self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
            self._file.flush()
        except OSError as e:
            raise self._error(e) from None

    def close(self) -> None:
        try:
            self._file.close()
        except OSError as e:
            if not self._failed:  # else the write's own error is already on its way
                raise self._error(e) from None

    def __enter__(self) -> ResultsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _same_prompt(record: dict[str, Any], line: PromptLine) -> bool:
    if isinstance(line.prompt, str):
        return record.get("prompt") == line.prompt
    return record.get("prompt_token_ids") == line.prompt


def load_finished(out: Path, prompts: PromptsFile) -> set[int]:
    """Indices already in ``out``. Drops (truncates away) an unreadable last line, the trace of
    an interrupted write; any other unreadable line, or a line whose prompt is not the prompt
    file's at that index, is an error: appending to it would mix two runs."""
    if not out.exists():
        return set()
    data = out.read_bytes()
    by_index = {p.index: p for p in prompts.prompts}
    done: set[int] = set()
    offset = 0
    lines = data.split(b"\n")
    for n, raw in enumerate(lines, start=1):
        end = offset + len(raw) + 1
        if raw.strip():
            try:
                record = json.loads(raw)
                index = record["index"]
                if isinstance(index, bool) or not isinstance(index, int):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                if all(not rest.strip() for rest in lines[n:]):
                    with out.open("r+b") as f:  # the interrupted last write
                        f.truncate(offset)
                    break
                raise InvalidInputError(
                    f"resume: {out}:{n} is not a result line written by specbatch generate; "
                    "refusing to append to it",
                    "resume",
                ) from None
            line = by_index.get(index)
            if line is None and not any(e.index == index for e in prompts.errors):
                raise InvalidInputError(
                    f"resume: {out}:{n} has index {index}, but {prompts.path} has no prompt "
                    "there; was OUT written from another prompts file?",
                    "resume",
                )
            if line is not None and not _same_prompt(record, line):
                raise InvalidInputError(
                    f"resume: {out}:{n} holds another prompt than {prompts.where(line.line_no)} "
                    f"(index {index}); was OUT written from another prompts file?",
                    "resume",
                )
            done.add(index)
        offset = end
    if data and not data.endswith(b"\n") and out.stat().st_size == len(data):
        with out.open("ab") as f:  # a complete last line without its newline
            f.write(b"\n")
    return done


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def _completion(c: CompletionOutput, has_tokenizer: bool) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "text": c.text if has_tokenizer else None,
        "token_ids": list(c.token_ids),
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }
    if c.logprobs is not None:  # per token: its logprob; {id: logprob} of the top K and it
        fields["cumulative_logprob"] = _rounded(c.cumulative_logprob)
        fields["token_logprobs"] = [_rounded(e[t].logprob) for e, t in zip(c.logprobs, c.token_ids)]
        fields["top_logprobs"] = [
            {str(i): _rounded(v.logprob) for i, v in e.items()} for e in c.logprobs
        ]
    return fields


def result_record(
    line: PromptLine, out: RequestOutput, has_tokenizer: bool, speculative: bool
) -> dict[str, Any]:
    c, m = out.outputs[0], out.metrics
    record: dict[str, Any] = {
        "index": line.index,
        "id": line.id,
        "prompt": line.prompt if isinstance(line.prompt, str) else None,
    }
    if not isinstance(line.prompt, str):
        record["prompt_token_ids"] = list(line.prompt)
    record.update(_completion(c, has_tokenizer))
    if len(out.outputs) > 1:  # n > 1: every completion, the first one too
        record["completions"] = [_completion(o, has_tokenizer) for o in out.outputs]
    record.update(
        num_prompt_tokens=m.num_prompt_tokens,
        num_output_tokens=sum(len(o.token_ids) for o in out.outputs),
        ttft_s=_rounded(m.time_to_first_token),
        e2e_s=_rounded(m.e2e_latency),
        tpot_s=_rounded(m.time_per_output_token),
    )
    if speculative:
        record.update(
            spec_rounds=m.spec_rounds,
            draft_tokens_proposed=m.draft_tokens_proposed,
            draft_tokens_accepted=m.draft_tokens_accepted,
            acceptance_rate=_rounded(m.acceptance_rate),
            mean_tokens_per_round=_rounded(m.mean_tokens_per_round),
        )
    return record
