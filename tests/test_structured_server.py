"""Structured outputs through the server and the ``openai`` client: OpenAI's ``response_format``
and vLLM's ``structured_outputs`` on completions and chat, whole and streamed; a bad schema,
regex or grammar is a 400 naming the field before anything is queued; the pool is whole after."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from specbatch.config import EngineArgs
from specbatch.entrypoints.openai_server import build_app
from tests.test_server import ServerThread, engine_kwargs, wait_pool_full
from tests.test_server_requests import CHAT, post, refused

openai = pytest.importorskip("openai")
xgr = pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
HI = [{"role": "user", "content": "answer in JSON"}]
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(make_checkpoint: Any) -> Iterator[ServerThread]:
    target = make_checkpoint("llama", with_tokenizer=True)
    draft = make_checkpoint("llama", with_tokenizer=True, seed=1)
    app = build_app(EngineArgs(**engine_kwargs(target, draft)), served_model_name=MODEL)
    with ServerThread(app) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def valid_or_cut(text: str, finish: str) -> None:
    """A complete output parses and fits SCHEMA; one cut by max_tokens is a prefix of one."""
    if finish == "stop":
        value = json.loads(text)
        assert (
            set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)
        )
        return
    assert finish == "length"
    info = xgr.TokenizerInfo(["a"])  # bytes are enough to check a prefix
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA)))
    assert matcher.accept_string(text), text


def json_schema_format() -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
    }


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_chat_with_a_json_schema_whole_and_streamed(server, client, seed):
    kw = dict(model=MODEL, messages=HI, max_tokens=40, temperature=1.0, seed=seed)
    full = client.chat.completions.create(**kw, response_format=json_schema_format())
    choice = full.choices[0]
    valid_or_cut(choice.message.content, choice.finish_reason)
    chunks = list(client.chat.completions.create(**kw, response_format=json_schema_format(),
                                                 stream=True))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    wait_pool_full(server.engine)


def test_json_object_and_structured_outputs_on_completions(server, client):
    out = client.completions.create(
        model=MODEL, prompt="{", max_tokens=30, temperature=0.8, seed=4,
        extra_body={"response_format": {"type": "json_object"}},
    )  # fmt: skip
    text, finish = out.choices[0].text, out.choices[0].finish_reason
    assert text.lstrip().startswith("{")
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    for stream in (False, True):
        got = client.completions.create(
            model=MODEL, prompt="yes or no?", max_tokens=8, temperature=1.0, seed=5, stream=stream,
            extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe not"]}},
        )  # fmt: skip
        chunks = list(got) if stream else [got]
        assert "".join(c.choices[0].text for c in chunks if c.choices) in ("yes", "no", "maybe not")
    chat = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=12, temperature=0,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
    )  # fmt: skip
    content = chat.choices[0].message.content
    assert len(content) == 6 and content[:3].isdigit() and content[3] == "-", content
    assert chat.choices[0].finish_reason == "stop"
    wait_pool_full(server.engine)


BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": 5}}}
BAD = [  # (fields, the param named, words of the message)
    ({"response_format": BAD_SCHEMA}, "response_format", ["json_schema.schema: invalid JSON"]),
    ({"response_format": {"type": "json_schema"}}, "response_format", ["json_schema: required"]),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
        "response_format",
        ["response_format.json_schema.schema: required"],
    ),
    ({"response_format": {"type": "structural_tag"}}, "response_format", ["type"]),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", ["regex: invalid regex"]),
    (
        {"structured_outputs": {"grammar": "root ::= nowhere"}},
        "structured_outputs",
        ["structured_outputs.grammar: invalid grammar", "nowhere"],
    ),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs", ["choice must be"]),
    (
        {"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
        "response_format",
        ["not both"],
    ),
    (
        {"structured_outputs": {"json_object": True}, "min_tokens": 2},
        "min_tokens",
        ["min_tokens must be 0 with structured_outputs"],
    ),
]


@pytest.mark.parametrize("path", ["completions", CHAT])
@pytest.mark.parametrize(("fields", "param", "words"), BAD)
def test_bad_structured_outputs_are_400_naming_the_field(server, path, fields, param, words):
    body = {"messages": HI} if path == CHAT else {"prompt": "x"}
    for stream in (False, True):
        refused(post(server, {**body, **fields, "max_tokens": 4, "stream": stream}, path), param,
                *words)  # fmt: skip
    assert server.engine.num_in_flight == 0
    wait_pool_full(server.engine)
