"""Request bodies: what is refused with a 400 naming the field, what is accepted and logged,
and the schema FastAPI publishes from the models."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from specbatch.config import EngineArgs
from specbatch.entrypoints.openai_server import build_app
from specbatch.sampling_params import SamplingParams
from tests.test_server import ServerThread, engine_kwargs, wait_pool_full

CHAT = "chat/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(make_checkpoint: Any) -> Iterator[ServerThread]:
    target = make_checkpoint("llama", with_tokenizer=True)
    draft = make_checkpoint("llama", with_tokenizer=True, seed=1)
    with ServerThread(build_app(EngineArgs(**engine_kwargs(target, draft)))) as s:
        yield s


def post(server: ServerThread, body: dict[str, Any] | bytes, path: str = "completions") -> Any:
    """``body`` sent as JSON with ASCII escapes (so a lone surrogate travels as ``\\ud800``)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{server.url}/v1/{path}",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=60,
    )


def refused(r: Any, param: str | None, *words: str) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    for w in words:
        assert w in err["message"], err
    return err


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("completions", {"prompt": "abc \ud800"}, "prompt"),
        ("completions", {"prompt": ["abc \udfff"]}, "prompt"),
        (CHAT, {"messages": [{"role": "user", "content": "a \ud800"}]}, "messages"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]},
            "messages",
        ),
    ],
)
def test_a_lone_surrogate_is_400_naming_the_field(
    server: ServerThread, path: str, body: dict[str, Any], param: str, stream: bool
) -> None:
    refused(post(server, {**body, "max_tokens": 2, "stream": stream}, path), param, "surrogate")
    wait_pool_full(server.engine)


def test_deeply_nested_json_is_400(server: ServerThread) -> None:
    refused(post(server, b"[" * 5000), None, "JSON")
    deep = b'{"prompt": "x", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    refused(post(server, deep), None, "JSON")
    nested = {"prompt": "x", "max_tokens": 2, "metadata": json.loads("[" * 200 + "]" * 200)}
    assert post(server, nested).status_code == 200  # deep but parsable: an ignored field


@pytest.mark.parametrize(
    ("name", "value"), [("functions", [{"name": "f"}]), ("function_call", "auto")]
)
def test_the_legacy_function_fields_are_refused(
    server: ServerThread, name: str, value: Any
) -> None:
    """OpenAI's deprecated ``functions``/``function_call``; ``tools`` is served
    (test_tool_calls.py)."""
    r = post(server, {"messages": HI, "max_tokens": 2, name: value}, CHAT)
    refused(r, name, "not supported")


def test_the_neutral_values_of_unsupported_fields_are_accepted(server: ServerThread) -> None:
    body = {"messages": HI, "max_tokens": 2, "tools": None, "tool_choice": "none"}
    r = post(server, {**body, "response_format": {"type": "text"}, "user": "u1"}, CHAT)
    assert r.status_code == 200, r.text


def test_an_unknown_role_is_refused(server: ServerThread) -> None:
    r = post(server, {"messages": [{"role": "wizard", "content": "x"}]}, CHAT)
    refused(r, "messages", "messages[0].role", "wizard")


def test_stop_token_ids_outside_the_vocabulary_are_refused(server: ServerThread) -> None:
    refused(post(server, {"prompt": "x", "stop_token_ids": [5, 256]}), "stop_token_ids", "[0, 256)")
    r = post(server, {"messages": HI, "stop_token_ids": [10**6]}, CHAT)
    refused(r, "stop_token_ids", "vocabulary")
    assert (
        post(server, {"prompt": "x", "max_tokens": 2, "stop_token_ids": [255]}).status_code == 200
    )


@pytest.mark.parametrize("path", ["completions", CHAT])
def test_stream_options_need_stream(server: ServerThread, path: str) -> None:
    body = {"prompt": "x", "messages": HI, "max_tokens": 2}
    options = {"include_usage": True}
    refused(post(server, {**body, "stream_options": options}, path), "stream_options", "stream")
    r = post(server, {**body, "stream": False, "stream_options": options}, path)
    refused(r, "stream_options")
    assert post(server, {**body, "stream_options": None}, path).status_code == 200


@pytest.mark.parametrize(
    ("field", "value", "start"),
    [
        ("max_completion_tokens", -3, "max_completion_tokens must be >= 1"),
        ("max_tokens", 0, "max_tokens must be >= 1"),
        ("top_logprobs", 21, "top_logprobs must be in [0, 20]"),
        ("max_completion_tokens", "3", "max_completion_tokens: "),
    ],
)
def test_chat_errors_name_the_field_as_the_client_wrote_it(
    server: ServerThread, field: str, value: Any, start: str
) -> None:
    r = post(server, {"messages": HI, "logprobs": True, field: value}, CHAT)
    assert refused(r, field)["message"].startswith(start)


def test_unknown_fields_are_accepted_and_logged_once(
    server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="specbatch.server"):
        for _ in range(2):
            r = post(server, {"prompt": "x", "max_tokens": 2, "frobnicate": 1, "best_of": 1})
            assert r.status_code == 200, r.text
        r = post(server, {"messages": HI, "max_tokens": 2, "frobnicate": {"a": 1}}, CHAT)
        assert r.status_code == 200, r.text
    said = [rec.getMessage() for rec in caplog.records if "frobnicate" in rec.getMessage()]
    assert len(said) == 1 and "unknown" in said[0]


def test_the_schema_is_published_with_sampling_params_defaults(server: ServerThread) -> None:
    assert httpx.get(f"{server.url}/docs").status_code == 200
    schema = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
    completion, chat = (
        schema["CompletionRequest"]["properties"],
        schema["ChatRequest"]["properties"],
    )
    for f in dataclasses.fields(SamplingParams):
        if f.init:
            assert completion[f.name].get("default") == f.default, f.name
    assert {"prompt", "echo", "stream", "stream_options"} <= set(completion)
    assert {"messages", "max_completion_tokens", "top_logprobs", "tools"} <= set(chat)
    assert completion["max_tokens"]["default"] == 16 and completion["temperature"]["default"] == 1
    assert chat["max_tokens"].get("default") is None  # chat: up to the context by default
    assert schema["CompletionRequest"]["required"] == ["prompt"]


def test_bad_bodies_keep_the_openai_shape(server: ServerThread, tmp_path: Path) -> None:
    refused(post(server, b"{not json"), None, "JSON")
    refused(post(server, b"[1, 2]"), None, "JSON object")
    r = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "x"}', timeout=30)
    assert r.status_code == 200, r.text  # no content-type: read as JSON
    refused(post(server, {"prompt": "x", "n": True}), "n", "integer")
    refused(post(server, {"prompt": "x", "stop": 5}), "stop", "a string or a list of strings")
    refused(post(server, {"prompt": ["a", "b"]}), "prompt", "one prompt per request")
    refused(post(server, {"prompt": [[1], [2]]}), "prompt", "one prompt per request")
