"""The OpenAI-compatible server, run for real on loopback with a tiny random model."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from specbatch.config import EngineArgs
from specbatch.engine.async_engine import AsyncLLMEngine
from specbatch.engine.llm import LLM
from specbatch.engine.prometheus import parse_metrics
from specbatch.entrypoints.openai_server import build_app
from specbatch.errors import EngineError
from specbatch.sampling_params import SamplingParams

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

API_KEY = "test-key"
MODEL = "tiny"


class ServerThread:
    """uvicorn in a daemon thread on a free loopback port."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive(), "the server thread died"
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()

    @property
    def engine(self) -> AsyncLLMEngine:
        return self.app.state.engine


def engine_kwargs(target: Path, draft: Path, **kw: Any) -> dict[str, Any]:
    base = dict(
        model=str(target),
        draft_model=str(draft),
        num_speculative_tokens=3,
        num_kv_blocks=160,
        block_size=16,
        max_model_len=256,
        max_num_seqs=8,
        seed=0,
    )
    base.update(kw)
    return base


@pytest.fixture(scope="module")
def models(make_checkpoint: Callable[..., Path]) -> tuple[Path, Path]:
    return (
        make_checkpoint("llama", with_tokenizer=True),
        make_checkpoint("llama", with_tokenizer=True, seed=1),
    )


@pytest.fixture(scope="module")
def server(models: tuple[Path, Path]) -> Iterator[ServerThread]:
    app = build_app(
        EngineArgs(**engine_kwargs(*models)),
        api_key=API_KEY,
        max_queue_len=64,
        served_model_name=MODEL,
    )
    with ServerThread(app) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        time.sleep(0.01)


def wait_pool_full(engine: AsyncLLMEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        e = engine.engine
        if e.num_free_kv_blocks == e.num_kv_blocks and engine.num_in_flight == 0:
            return
        time.sleep(0.02)
    e = engine.engine
    raise AssertionError(
        f"blocks leaked: {e.num_free_kv_blocks}/{e.num_kv_blocks} free, "
        f"{engine.num_in_flight} in flight"
    )


# ---- the openai client --------------------------------------------------------------------------


def test_models_and_health(server: ServerThread, client: Any) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_completion_and_stream_agree(server: ServerThread, client: Any) -> None:
    kw = dict(model=MODEL, prompt="hello world", max_tokens=24, temperature=1.0, seed=7)
    full = client.completions.create(**kw)
    choice = full.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert full.usage.completion_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == choice.finish_reason and all(f is None for f in finals[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == (
        full.usage.completion_tokens
    )
    wait_pool_full(server.engine)


def test_n_logprobs_echo_and_penalties_through_the_openai_client(
    server: ServerThread, client: Any
) -> None:
    kw = dict(
        model=MODEL,
        prompt="hello world",
        max_tokens=10,
        temperature=0.9,
        seed=5,
        n=3,
        logprobs=2,
        presence_penalty=0.4,
        frequency_penalty=0.3,
        extra_body={"repetition_penalty": 1.2, "min_tokens": 4, "ignore_eos": True},
    )
    full = client.completions.create(**kw, echo=True)
    assert [c.index for c in full.choices] == [0, 1, 2]
    n_prompt = full.usage.prompt_tokens
    assert full.usage.completion_tokens == 30  # 3 choices of 10 tokens
    for c in full.choices:
        assert c.text.startswith("hello world") and c.finish_reason == "length"
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == n_prompt + 10
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(v <= 0 for v in lp.token_logprobs[1:])
        for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:]):
            assert token in top and len(top) <= 3  # the top 2, and the sampled token
        assert lp.text_offset == sorted(lp.text_offset)
    assert len({c.text for c in full.choices}) > 1  # each completion has its own stream
    # the stream of the same seeded request: the same tokens and logprobs, choice by choice
    streamed: dict[int, list[float]] = {0: [], 1: [], 2: []}
    texts: dict[int, str] = {0: "", 1: "", 2: ""}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.logprobs is not None:
                streamed[c.index] += c.logprobs.token_logprobs
    for c in full.choices:
        assert "hello world" + texts[c.index] == c.text
        assert streamed[c.index] == c.logprobs.token_logprobs[n_prompt:]
    wait_pool_full(server.engine)


def test_chat_logprobs_and_n(server: ServerThread, client: Any) -> None:
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        n=2,
        seed=3,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kw)
    assert [c.index for c in full.choices] == [0, 1]
    for c in full.choices:
        content = c.logprobs.content
        assert len(content) == 6
        for item in content:
            assert len(item.top_logprobs) == 3 and item.logprob <= 0
            assert item.top_logprobs[0].logprob >= item.logprob - 1e-6
    chunks = list(client.chat.completions.create(**kw, stream=True))
    for c in full.choices:
        got = [
            i.logprob
            for ch in chunks
            for x in ch.choices
            if x.index == c.index and x.logprobs
            for i in x.logprobs.content
        ]
        assert got == [i.logprob for i in c.logprobs.content]
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(**{**kw, "logprobs": False})
    wait_pool_full(server.engine)


def test_stop_string_never_streamed(server: ServerThread, client: Any) -> None:
    base = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0]
    if len(base.text) < 6:
        pytest.skip("the random model's greedy text is too short to pick a stop string")
    stop = base.text[3:5]
    kw = dict(model=MODEL, prompt="abc", max_tokens=30, temperature=0, stop=[stop])
    full = client.completions.create(**kw).choices[0]
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    assert full.finish_reason == "stop" and stop not in full.text
    assert streamed == full.text


def test_token_id_prompt_and_raw_sse(server: ServerThread) -> None:
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 8, "stream": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=auth(), timeout=30
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert all(ln.startswith("data: ") for ln in lines)
    last = json.loads(lines[-2][6:])
    assert last["object"] == "text_completion" and last["choices"][0]["finish_reason"]


def test_greedy_equals_llm_generate(server: ServerThread, models: tuple[Path, Path]) -> None:
    prompts = ["hello world", "the cat sat", "a"]
    got = []
    for p in prompts:
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": MODEL, "prompt": p, "max_tokens": 12, "temperature": 0},
            headers=auth(),
            timeout=30,
        )
        assert r.status_code == 200, r.text
        got.append(r.json()["choices"][0]["text"])
    llm = LLM(**engine_kwargs(*models))
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    finally:
        llm.shutdown()
    assert got == [o.outputs[0].text for o in outs]


def test_chat(server: ServerThread, client: Any) -> None:
    msgs = [{"role": "user", "content": "hi there"}]
    full = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=10, temperature=0.8, seed=3
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=10, temperature=0.8, seed=3, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert full.choices[0].message.role == "assistant"


# ---- disconnects and errors ---------------------------------------------------------------------


def test_disconnect_frees_blocks(server: ServerThread) -> None:
    engine = server.engine.engine
    real_step, steps, held = engine.step, [0], threading.Event()

    def held_step() -> list[Any]:  # after the first token, the request waits for the client
        steps[0] += 1
        if steps[0] > 1:
            held.wait(30)
        return real_step()

    aborted = server.engine.num_aborted
    body = {
        "model": MODEL,
        "prompt": "tell me a long story",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    engine.step = held_step  # type: ignore[method-assign]
    try:
        with (
            httpx.Client(timeout=30) as c,
            c.stream("POST", f"{server.url}/v1/completions", json=body, headers=auth()) as r,
        ):
            assert r.status_code == 200
            next(r.iter_lines())
            wait_for(lambda: engine.num_free_kv_blocks < engine.num_kv_blocks, "blocks held")
        held.set()
        wait_pool_full(server.engine)
    finally:
        held.set()
        engine.step = real_step  # type: ignore[method-assign]
    assert server.engine.num_aborted == aborted + 1
    assert server.engine.engine.metrics.num_generated_tokens > 0
    r = httpx.get(f"{server.url}/metrics")
    m = parse_metrics(r.text)
    assert m["specbatch:kv_blocks_used"] == 0
    assert m['specbatch:request_success_total{finished_reason="abort"}'] >= 1


def test_non_streaming_disconnect_aborts(server: ServerThread) -> None:
    engine = server.engine.engine
    real_step = engine.step

    def slow_step() -> list[Any]:
        time.sleep(0.01)
        return real_step()

    aborted = server.engine.num_aborted
    body = {"model": MODEL, "prompt": "go on", "max_tokens": 200, "ignore_eos": True}
    engine.step = slow_step  # type: ignore[method-assign]
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=body, headers=auth(), timeout=0.3)
        wait_pool_full(server.engine)
    finally:
        engine.step = real_step  # type: ignore[method-assign]
    assert server.engine.num_aborted == aborted + 1


BAD_BODIES = [
    ({"model": "nope", "prompt": "x"}, "model"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 1.5}, "top_p"),
    ({"model": MODEL, "prompt": "x", "top_k": -3}, "top_k"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "seed": -1}, "seed"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": []}, "prompt"),
    ({"model": MODEL, "prompt": [1, 100000]}, "prompt"),
    ({"model": MODEL, "prompt": list(range(1, 250)) * 2}, "prompt"),
    ({"model": MODEL, "prompt": 42}, "prompt"),
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "prompt": "x", "n": -1}, "n"),
    ({"model": MODEL, "prompt": "x", "logprobs": 50}, "logprobs"),
    ({"model": MODEL, "prompt": "x", "echo": "yes"}, "echo"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": -2.5}, "presence_penalty"),
    ({"model": MODEL, "prompt": "x", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
]


@pytest.mark.parametrize(("body", "param"), BAD_BODIES)
def test_bad_input_is_400(server: ServerThread, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=auth(), timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param, err


def test_malformed_json_and_auth(server: ServerThread, client: Any) -> None:
    r = httpx.post(
        f"{server.url}/v1/completions",
        content=b"{not json",
        headers={**auth(), "content-type": "application/json"},
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    r = httpx.post(f"{server.url}/v1/completions", json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(
        f"{server.url}/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}
    )
    assert r.status_code == 401
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, top_p=7.0)
    # still serving
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text
    wait_pool_full(server.engine)


# ---- queue limit, engine failure, no chat template ----------------------------------------------


def test_queue_full_then_engine_failure(models: tuple[Path, Path]) -> None:
    app = build_app(
        EngineArgs(**engine_kwargs(*models, max_num_seqs=1)),
        max_queue_len=0,
        served_model_name=MODEL,
    )
    with ServerThread(app) as s:
        long = {"model": MODEL, "prompt": "a b c", "max_tokens": 8}
        engine = s.engine.engine
        real_step, gate = engine.step, threading.Event()

        def gated_step() -> list[Any]:
            gate.wait(10)  # holds the first request in flight until the 503 is seen
            return real_step()

        engine.step = gated_step  # type: ignore[method-assign]
        first: list[httpx.Response] = []
        t = threading.Thread(
            target=lambda: first.append(
                httpx.post(f"{s.url}/v1/completions", json=long, timeout=30)
            )
        )
        t.start()
        deadline = time.monotonic() + 10
        while s.engine.num_in_flight < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        r2 = httpx.post(f"{s.url}/v1/completions", json=long, timeout=30)
        gate.set()
        t.join(30)
        engine.step = real_step  # type: ignore[method-assign]
        assert r2.status_code == 503, r2.text
        assert r2.json()["error"]["type"] == "server_overloaded"
        assert first[0].status_code == 200, first[0].text
        wait_pool_full(s.engine)
        ok = httpx.post(f"{s.url}/v1/completions", json=long, timeout=30)
        assert ok.status_code == 200, ok.text

        def broken_step() -> list[Any]:
            raise EngineError("worker 0 died (injected)")

        engine.step = broken_step  # type: ignore[method-assign]
        r = httpx.post(f"{s.url}/v1/completions", json={**long, "max_tokens": 2}, timeout=30)
        assert r.status_code == 500, r.text
        assert "injected" in r.json()["error"]["message"]
        h = httpx.get(f"{s.url}/health")
        assert h.status_code == 503 and h.json()["status"] == "unhealthy"
        r = httpx.post(f"{s.url}/v1/completions", json={**long, "max_tokens": 2}, timeout=30)
        assert r.status_code == 500
        assert httpx.get(f"{s.url}/v1/models").status_code == 200  # still answering
        assert parse_metrics(httpx.get(f"{s.url}/metrics").text)["specbatch:healthy"] == 0


def test_chat_without_template_is_400(make_checkpoint: Callable[..., Path]) -> None:
    target = make_checkpoint("llama", with_tokenizer=True)
    app = build_app(EngineArgs(model=str(target), num_kv_blocks=32), served_model_name=MODEL)
    tok = app.state.engine.engine.tokenizer
    original = tok.chat_template  # the tokenizer is cached and shared with other tests
    tok.chat_template = None
    try:
        with ServerThread(app) as s:
            r = httpx.post(
                f"{s.url}/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            )
            assert r.status_code == 400, r.text
            assert "chat template" in r.json()["error"]["message"]
            r = httpx.post(
                f"{s.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
            )
            assert r.status_code == 200
    finally:
        tok.chat_template = original


def test_serve_cli_flag_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from specbatch.entrypoints.cli import main

    assert main(["serve", "--port", "70000"]) == 2
    assert "error: --port must be in [0, 65535]" in capsys.readouterr().err
    assert main(["serve", "--max-queue-len", "-1"]) == 2
    assert "error: --max-queue-len must be >= 0" in capsys.readouterr().err
    assert main(["serve", "--shutdown-timeout", "-1"]) == 2
    assert "error: --shutdown-timeout must be >= 0" in capsys.readouterr().err
