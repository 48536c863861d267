"""``IncrementalDetokenizer`` and the stop strings ``StopChecker`` cuts with it, on the built-in
byte-level tokenizer (where one character can span up to four tokens)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from specbatch.detokenizer import IncrementalDetokenizer
from specbatch.model.model_pair import default_model_path
from specbatch.request import Request
from specbatch.sampling_params import SamplingParams
from specbatch.stop_checker import StopChecker
from specbatch.tokenizer import load_tokenizer

TEXT = "naïve café — x = '日本' 😀 done\n    return s[::-1]"


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(default_model_path("target"))


def stream(tok: Any, ids: list[int], prompt: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.append(t) for t in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return deltas


def test_a_character_split_across_tokens_comes_out_whole(tok: Any) -> None:
    ids = tok.encode("😀")
    assert len(ids) == 4  # four byte tokens, none printable alone
    deltas = stream(tok, ids, tok.encode("x = "))
    assert deltas == ["", "", "", "😀", ""]
    deltas = stream(tok, tok.encode("é!"), [])
    assert "".join(deltas) == "é!" and "\ufffd" not in "".join(deltas)


def test_deltas_add_up_to_the_full_decode(tok: Any) -> None:
    ids = tok.encode(TEXT)
    for prompt in ([], tok.encode("def f(s):"), tok.encode("日")):
        deltas = stream(tok, ids, prompt)
        assert "".join(deltas) == tok.decode(ids) == TEXT
        assert all("\ufffd" not in d for d in deltas)  # never half a character
    rng = random.Random(0)
    vocab = len(tok.get_vocab())
    for _ in range(20):  # any ids at all, valid UTF-8 or not
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        assert "".join(stream(tok, ids, [5, 6])) == tok.decode(ids, skip_special_tokens=True)


def test_an_unfinished_character_is_flushed_at_the_end(tok: Any) -> None:
    ids = tok.encode("ok €")[:-1]  # the euro sign's last byte never comes
    deltas = stream(tok, ids, [])
    assert "".join(deltas[:-1]) == "ok "
    assert "".join(deltas) == tok.decode(ids) and deltas[-1].endswith("\ufffd")


def test_skip_special_tokens(tok: Any) -> None:
    eos = tok.eos_token_id
    ids = [*tok.encode("a = 1"), eos, *tok.encode("b")]
    assert "".join(stream(tok, ids, [], skip=True)) == "a = 1b"
    assert "".join(stream(tok, ids, [], skip=False)) == f"a = 1{tok.eos_token}b"


def finish(tok: Any, ids: list[int], params: SamplingParams) -> tuple[str, Request]:
    checker = StopChecker(tok)
    req = Request("r", tok.encode("x"), params, max_model_len=512)
    for t in ids:
        if checker.append(req, t):
            break
    return checker.finish_text(req), req


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_across_tokens_cuts_the_text(tok: Any, include: bool) -> None:
    ids = tok.encode(TEXT)
    params = SamplingParams(max_tokens=100, stop=["日本"], include_stop_str_in_output=include)
    text, req = finish(tok, ids, params)
    assert text == ("naïve café — x = '日本" if include else "naïve café — x = '")
    assert req.finish_reason is not None and req.finish_reason.value == "stop"
    assert req.stop_reason == "日本"
    # generation stopped at the token that completed the stop string
    assert tok.decode(req.output_token_ids).endswith("日本")
    assert len(req.output_token_ids) < len(ids)
