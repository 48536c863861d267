"""Streams against whole replies: each choice's stream, assembled by its index, is its whole
reply; logprobs list the sampled token; tokens' texts join into the text."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from specbatch.config import EngineArgs
from specbatch.entrypoints.openai_server import build_app
from tests.test_server import MODEL, ServerThread, engine_kwargs, wait_pool_full


@pytest.fixture(scope="module")
def server(make_checkpoint: Any) -> Iterator[ServerThread]:
    target = make_checkpoint("llama", with_tokenizer=True)
    draft = make_checkpoint("llama", with_tokenizer=True, seed=1)
    app = build_app(EngineArgs(**engine_kwargs(target, draft)), served_model_name=MODEL)
    with ServerThread(app) as s:
        yield s


def events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[len("data: ") :]) for ln in lines[:-1]]


def merge_logprobs(into: dict[str, Any] | None, part: dict[str, Any] | None) -> Any:
    if part is None:
        return into
    if into is None:
        return {k: list(v) for k, v in part.items()}
    for k, v in part.items():
        into[k] += v
    return into


def assemble(chunks: list[dict[str, Any]], chat: bool) -> list[dict[str, Any]]:
    """Each choice of a stream, by its index, in the shape of the whole reply's choice."""
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            got = choices.setdefault(c["index"], {"index": c["index"], "logprobs": None})
            if chat:
                message = got.setdefault("message", {})
                for key, value in c["delta"].items():
                    message[key] = message.get(key, "") + value
            else:
                got["text"] = got.get("text", "") + c["text"]
            got["logprobs"] = merge_logprobs(got["logprobs"], c["logprobs"])
            if c["finish_reason"] is not None:
                assert "finish_reason" not in got, "a choice finished twice"
                got["finish_reason"] = c["finish_reason"]
    return [choices[i] for i in sorted(choices)]


def without_offsets(choices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Completions' ``text_offset`` counts from the start of each chunk's text."""
    for c in choices:
        if c["logprobs"] is not None:
            c["logprobs"].pop("text_offset", None)
    return choices


@pytest.mark.parametrize("chat", [False, True])
def test_each_choices_stream_is_its_whole_reply(server: ServerThread, chat: bool) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 12, "n": 3, "seed": 11}
    if chat:
        path = "chat/completions"
        body.update(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2)
    else:
        path = "completions"
        body.update(prompt="hello world", logprobs=2, stop=["e "])
    url = f"{server.url}/v1/{path}"
    whole = httpx.post(url, json=body, timeout=60).json()["choices"]
    streamed = assemble(events(url, body), chat)
    assert [c["index"] for c in whole] == [0, 1, 2]
    assert len({json.dumps(c) for c in whole}) == 3  # three different completions
    assert without_offsets(streamed) == without_offsets(whole)
    wait_pool_full(server.engine)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_list_the_sampled_token_beside_the_top_k(
    server: ServerThread, stream: bool
) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 24, "logprobs": 1, "seed": 4}
    url = f"{server.url}/v1/completions"
    body.update(temperature=1.5, ignore_eos=True)
    if stream:
        choice = assemble(events(url, body), chat=False)[0]
    else:
        choice = httpx.post(url, json=body, timeout=60).json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["top_logprobs"]) == 24
    sizes = []
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[token] == logprob
        assert len(top) == 1 or (len(top) == 2 and logprob <= min(top.values()))
        sizes.append(len(top))
    assert 2 in sizes  # at temperature 1.5 some sampled tokens are not the most likely


def test_token_texts_join_into_the_text_across_split_characters() -> None:
    """The built-in tokenizer is byte-level: a character can span several tokens, and at a
    high temperature sampled bytes split characters (or form none)."""
    app = build_app(EngineArgs(max_model_len=256, num_kv_blocks=96))
    split, prompt = 0, "# café 日本 😀 "
    with ServerThread(app) as s:
        url = f"{s.url}/v1/completions"
        echo = {"prompt": prompt, "max_tokens": 8, "logprobs": 1, "echo": True, "seed": 0}
        for choice in (
            httpx.post(url, json=echo, timeout=60).json()["choices"][0],
            assemble(events(url, echo), chat=False)[0],
        ):
            tokens = choice["logprobs"]["tokens"]
            assert choice["text"].startswith(prompt) and "".join(tokens) == choice["text"]
            assert "" in tokens  # the prompt's split characters: their first bytes
        for seed in range(4):
            body = {"prompt": prompt, "max_tokens": 64, "n": 4, "logprobs": 0}
            body.update(temperature=5.0, seed=seed, ignore_eos=True)
            for choice in assemble(events(url, body), chat=False):
                tokens, text = choice["logprobs"]["tokens"], choice["text"]
                assert "".join(tokens) == text
                split += "" in tokens and not text.isascii()  # a character's first bytes
            if split:
                break
    assert split, "no sampled token held part of a character: nothing was tested"
