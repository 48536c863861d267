"""The server's limits: neutral penalties, output room in the context, non-finite values, and a
huge prompt that must neither be tokenized whole nor delay the other requests."""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from specbatch.config import EngineArgs
from specbatch.entrypoints.openai_server import build_app
from tests.test_server import MODEL, ServerThread, engine_kwargs, wait_pool_full

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server(make_checkpoint: Callable[..., Path]) -> Iterator[ServerThread]:
    target = make_checkpoint("llama", with_tokenizer=True)
    draft = make_checkpoint("llama", with_tokenizer=True, seed=1)
    args = EngineArgs(**engine_kwargs(target, draft, max_model_len=MAX_MODEL_LEN))
    with ServerThread(build_app(args, served_model_name=MODEL)) as s:
        yield s


def post(server: ServerThread, body: dict[str, Any] | bytes, path: str = "completions") -> Any:
    kw: dict[str, Any] = {"json": body} if isinstance(body, dict) else {"content": body}
    return httpx.post(
        f"{server.url}/v1/{path}",
        headers={"content-type": "application/json"},
        timeout=60,
        **kw,
    )


@pytest.mark.parametrize(
    "extra",
    [
        {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1},
        {"logprobs": None, "best_of": 1, "echo": False, "logit_bias": {}, "suffix": ""},
    ],
)
def test_default_values_clients_send_are_accepted(
    server: ServerThread, extra: dict[str, Any]
) -> None:
    r = post(server, {"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("name", "value", "limit"),
    [
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", -3, "[-2, 2]"),
        ("repetition_penalty", 0, "> 0"),
        ("min_tokens", -1, ">= 0"),
        ("n", 0, "[1, 128]"),
        ("n", 129, "[1, 128]"),
        ("logprobs", 21, "[0, 20]"),
        ("prompt_logprobs", -2, "[0, 20]"),
        ("best_of", 2, "not supported"),
    ],
)
def test_out_of_range_values_are_400_naming_the_field_and_the_limit(
    server: ServerThread, name: str, value: float, limit: str
) -> None:
    r = post(server, {"model": MODEL, "prompt": "hi", name: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == name and limit in err["message"], err


def test_max_tokens_past_the_context_is_400_naming_the_limit(server: ServerThread) -> None:
    prompt = list(range(3, 3 + 250))  # 250 tokens: room for 6 more in a 256-token context
    r = post(server, {"model": MODEL, "prompt": prompt, "max_tokens": 7})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_tokens"
    assert "256" in err["message"] and "at most 6" in err["message"], err
    r = post(server, {"model": MODEL, "prompt": prompt, "max_tokens": 100_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    ok = post(server, {"model": MODEL, "prompt": prompt, "max_tokens": 6, "ignore_eos": True})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 6
    # chat: max_completion_tokens is checked the same way
    msgs = [{"role": "user", "content": "hi"}]
    r = post(
        server,
        {"model": MODEL, "messages": msgs, "max_completion_tokens": 10**6},
        "chat/completions",
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    wait_pool_full(server.engine)


@pytest.mark.parametrize(
    "raw",
    [
        b'"temperature": Infinity',
        b'"temperature": NaN',
        b'"temperature": -Infinity',
        b'"top_p": NaN',
        b'"min_p": Infinity',
    ],
)
def test_non_finite_sampling_values_are_400(server: ServerThread, raw: bytes) -> None:
    body = b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", ' + raw + b"}"
    r = post(server, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == raw.split(b'"')[1].decode()


def _latency(server: ServerThread, client: httpx.Client) -> float:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0}
    start = time.perf_counter()
    r = client.post(f"{server.url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return time.perf_counter() - start


def test_a_huge_prompt_is_refused_unread_and_stalls_no_one(server: ServerThread) -> None:
    """A small request's latency beside a stream of 5 MB prompts, as a ratio to its latency
    alone: tokenizing one such prompt takes seconds, refusing it by its length a few ms."""
    huge = json.dumps({"model": MODEL, "prompt": "def f(x):\n    return x\n" * 200_000})
    huge_bytes = huge.encode()  # encoded once: the client's own work must not hold the GIL
    with httpx.Client(timeout=120) as client:
        for _ in range(3):
            _latency(server, client)  # warm up
        alone = statistics.median(_latency(server, client) for _ in range(9))
        stop, answers = threading.Event(), []

        def flood() -> None:
            with httpx.Client(timeout=120) as c:
                while not stop.is_set():
                    answers.append(
                        c.post(
                            f"{server.url}/v1/completions",
                            content=huge_bytes,
                            headers={"content-type": "application/json"},
                        )
                    )

        t = threading.Thread(target=flood)
        t.start()
        try:
            time.sleep(0.2)  # the first huge prompt is in
            beside = statistics.median(_latency(server, client) for _ in range(9))
        finally:
            stop.set()
            t.join(120)
    assert answers, "no huge prompt was answered"
    err = answers[0].json()["error"]
    assert answers[0].status_code == 400 and err["param"] == "prompt", err
    assert "characters" in err["message"]
    ratio = beside / alone
    assert ratio < 10, f"a small request took {ratio:.1f}x its time alone beside 5 MB prompts"
    wait_pool_full(server.engine)
