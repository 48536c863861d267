"""The offline bench's agentic workload (``--workload agentic``): sessions of a coding agent,
built offline from this interpreter's stdlib sources, for comparing drafters on the repetitive
multi-turn traffic agents send.

A session works on one file: a few consecutive held-out stdlib functions. Its first turn is the
task, the agent's ``read_file`` call and the file as the tool returned it; each later turn
re-quotes the file as the agent last wrote it (the previous edit applied), the test run's
output (which quotes lines of it) and the next small edit (a rename, a changed literal, a
comment added or dropped). Every prompt ends where the agent's reply opens a code block, so a
reply writes the file out again: what it writes recurs in its own prompt, in its earlier
replies and in the other turns of its session. Each turn's prompt extends the previous one
token for token (the prefix cache sees what a server would), and turns come in order, eight
sessions interleaved, so later turns run after earlier ones. Seeded: the same prompts for
every cell and every run.
"""

from __future__ import annotations

import keyword
import random
import re
import textwrap
from typing import Any

from specbatch.bench.workload import Workload, functions, heldout_texts
from specbatch.errors import InvalidInputError
from specbatch.tokenizer import encode_text

SESSIONS_AT_ONCE = 8  # sessions whose turns are interleaved
MAX_TURNS = 6  # a session's turns at most (fewer where input_len is reached)
OPEN = "```python\n"  # where every prompt ends: the reply's code block opened
SYSTEM = (
    "You are a coding agent working in a Python repository. Tools: read_file(path) returns a "
    "file; write_file(path) replaces it with the code block of your reply; run_tests(path) "
    "runs its tests. Answer every task with the whole updated file in one ```python block."
)
_WORD = re.compile(r"\b[a-z_][a-z0-9_]{2,}\b")
_NUMBER = re.compile(r"(?<![\w.])\d+(?![\w.])")
_SUFFIXES = ("_value", "_item", "_count", "_data", "_result")
_SKIP = set(keyword.kwlist) | {"self", "cls", "None", "True", "False", "len", "str", "int"}


def _edit(code: str, fname: str, rng: random.Random) -> tuple[str, str]:
    """One small edit of ``code``: (the edited code, the task asking for it)."""
    kinds = ["rename", "number", "comment"]
    rng.shuffle(kinds)
    lines = code.splitlines(keepends=True)
    for kind in kinds:
        if kind == "rename":
            words = sorted({w for w in _WORD.findall(code) if w not in _SKIP and w[:2] != "__"})
            words = [w for w in words if len(re.findall(rf"\b{w}\b", code)) >= 2]
            if words:
                old = rng.choice(words)
                new = old + rng.choice(_SUFFIXES)
                return re.sub(rf"\b{old}\b", new, code), f"Rename `{old}` to `{new}` in `{fname}`."
        elif kind == "number":
            spots = list(_NUMBER.finditer(code))
            if spots:
                m = rng.choice(spots)
                new = str(int(m.group()) + rng.randint(1, 9))
                line = code.count("\n", 0, m.start()) + 1
                task = f"Change the {m.group()} on line {line} to {new}."
                return code[: m.start()] + new + code[m.end() :], task
        else:
            comments = [i for i, line in enumerate(lines) if line.lstrip().startswith("#")]
            if comments and rng.random() < 0.5:
                i = rng.choice(comments)
                return "".join(lines[:i] + lines[i + 1 :]), f"Drop the comment on line {i + 1}."
            i = rng.randrange(1, len(lines)) if len(lines) > 1 else 1
            indent = re.match(r"\s*", lines[i] if i < len(lines) else "    ").group()
            note = f"{indent or '    '}# checked by run_tests\n"
            task = f"Add a comment `# checked by run_tests` above line {i + 1}."
            return "".join([*lines[:i], note, *lines[i:]]), task
    return code + "\n", f"Add a blank line at the end of `{fname}`."


def _test_output(code: str, path: str, fname: str, rng: random.Random) -> str:
    """A failing test run whose traceback quotes two lines of ``code``."""
    lines = [(i, line) for i, line in enumerate(code.splitlines(), 1) if line.strip()]
    picked = sorted(rng.sample(lines, min(2, len(lines))))
    frames = "".join(
        f'  File "{path}", line {i}, in {fname}\n    {line.strip()}\n' for i, line in picked
    )
    module = path.rsplit("/", 1)[-1].removesuffix(".py")
    return (
        f"[run_tests] $ python -m pytest -q tests/test_{module}.py\n"
        f"F.. [100%]\n___ test_{fname} ___\nTraceback (most recent call last):\n{frames}"
        f"AssertionError\n1 failed, 2 passed in 0.{rng.randint(10, 99)}s"
    )


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The conversation's prompt text up to the reply's opened code block: by the tokenizer's
    chat template, or ChatML written out when it has none."""
    if getattr(tokenizer, "chat_template", None):
        from specbatch.chat import render_chat

        return render_chat(tokenizer, messages) + OPEN
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + "<|im_start|>assistant\n" + OPEN


def _session(
    tokenizer: Any, path: str, code: str, input_len: int, rng: random.Random
) -> list[list[int]]:
    """The prompts of one session's turns that fit in ``input_len`` tokens, each extending
    the one before."""
    fname = re.match(r"\s*def (\w+)", code).group(1)  # type: ignore[union-attr]
    original = code
    code, task = _edit(original, fname, rng)  # the file the first reply should write
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"In `{path}`: {task}"},
        {"role": "assistant", "content": f'read_file("{path}")'},
        {"role": "user", "content": f"[read_file] {path}\n{OPEN}{original}```"},
    ]
    prompts: list[list[int]] = []
    text, ids = "", []
    for _ in range(MAX_TURNS):
        full = _render(tokenizer, messages)
        if full.startswith(text):  # the new text only: the prompt extends the last one
            ids = ids + encode_text(tokenizer, full[len(text) :], add_special_tokens=not text)
        else:
            ids = encode_text(tokenizer, full, add_special_tokens=True)
        if len(ids) > input_len:
            break
        prompts.append(ids)
        text = full
        # the agent wrote the file with the edit; the tests ran; the next edit is asked for
        tests = _test_output(code, path, fname, rng)
        edited, task = _edit(code, fname, rng)
        messages += [
            {"role": "assistant", "content": f"{OPEN}{code}```"},
            {"role": "user", "content": f"{tests}\n\n{task}"},
        ]
        code = edited
    return prompts


def _files(tokenizer: Any, low: int, high: int) -> tuple[list[tuple[str, str]], str]:
    """(path, code) pairs: runs of consecutive held-out functions, dedented, of ``low`` to
    ``high`` tokens (their own tokens summed)."""
    texts, source = heldout_texts()
    out = []
    for n, text in enumerate(texts):
        fns = [textwrap.dedent(f).rstrip() + "\n" for f in functions(text)]
        sizes = [len(encode_text(tokenizer, f, False)) for f in fns]
        i = 0
        while i < len(fns):
            j, size = i + 1, sizes[i]
            while size < low and j < len(fns):
                size, j = size + sizes[j] + 1, j + 1
            if low <= size <= high:
                out.append((f"src/module_{n}.py", "\n\n".join(fns[i:j])))
            i = j
    return out, source


def agentic_prompts(
    tokenizer: Any, input_len: int, output_len: int, num_prompts: int, seed: int = 0
) -> tuple[list[list[int]], str]:
    """``num_prompts`` prompts of at most ``input_len`` tokens: the turns of sessions in
    order, ``SESSIONS_AT_ONCE`` sessions interleaved (every session's first turn, then every
    second turn, ...), each session working on a file of ``output_len`` to 1.5 times as many
    tokens (what a reply writes out)."""
    if tokenizer is None:
        raise InvalidInputError("workload: the agentic workload needs a tokenizer", "workload")
    low, high = output_len, output_len * 3 // 2
    files, source = _files(tokenizer, low, high)
    if not files:
        raise InvalidInputError(
            f"output_len: no held-out stdlib functions make a file of {low} to {high} tokens",
            "output_len",
        )
    rng = random.Random(seed)
    rng.shuffle(files)
    prompts: list[list[int]] = []
    sessions = turns = 0
    while len(prompts) < num_prompts:
        group = []
        for _ in range(SESSIONS_AT_ONCE):
            path, code = files[sessions % len(files)]
            group.append(_session(tokenizer, path, code, input_len, rng))
            sessions += 1
        if not any(group):
            raise InvalidInputError(
                f"input_len: a session's first turn does not fit in {input_len} tokens (give "
                f"--input-len of {8 * output_len} or so)",
                "input_len",
            )
        turns = max(turns, *map(len, group))
        for t in range(max(map(len, group))):
            prompts += [s[t] for s in group if t < len(s)]
    return prompts[:num_prompts], (
        f"agentic: {sessions} coding-agent sessions of up to {turns} turns on files of "
        f"{low}-{high} tokens from {source}; each turn re-quotes the file as "
        f"last written, the test output and the next edit; {SESSIONS_AT_ONCE} sessions "
        "interleaved, turns in order"
    )


def agentic_workload(
    tokenizer: Any, input_len: int, output_len: int, num_prompts: int, seed: int = 0
) -> Workload:
    """``agentic_prompts`` as the bench's ``Workload``."""
    prompts, source = agentic_prompts(tokenizer, input_len, output_len, num_prompts, seed)
    return Workload(prompts, input_len, output_len, source)
