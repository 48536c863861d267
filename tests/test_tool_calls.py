"""OpenAI tool calls on /v1/chat/completions.

The parsers (hermes, llama3_json, the forced JSON) on whole outputs and on every way a stream may
cut them; the server through the ``openai`` client: a two-turn tool conversation, forced calls
(``required`` and a named function) streamed and not, ``auto`` reading the model's own markup,
every bad-tools case a 400 naming the field; 200 forced calls on the built-in pair, without a
drafter and with each of three, each valid against its schema; and the law of a forced call
under speculation, by a chi-square test as tests/test_structured_law.py does it.

``reassemble`` is the client's view of a stream: a call's first delta carries its index (the
next one), id, type, name and empty arguments, later ones only argument fragments; the
fragments concatenate to the unstreamed arguments. The planted bugs (a fragment before its
call's header, two fragments swapped) are caught by it.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from typing import Any

import pytest

from specbatch import LLM, SamplingParams
from specbatch.chat import check_messages, render_chat, template_takes_tools
from specbatch.config import EngineArgs
from specbatch.entrypoints.openai_replies import ToolCallStream
from specbatch.entrypoints.openai_server import build_app
from specbatch.entrypoints.openai_tools import ToolDef, ToolPlan, template_messages
from specbatch.entrypoints.tool_parsers import FORCED, PARSERS, Parsed, ToolCall
from specbatch.tokenizer import load_tokenizer
from tests.grammar_helpers import compile_reference, masked_law
from tests.helpers import make_perturbed_draft
from tests.test_exactness import assert_matches
from tests.test_server import ServerThread, engine_kwargs, wait_pool_full
from tests.test_server_requests import CHAT, post, refused

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

MODEL = "tiny"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "A city's weather",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def valid(calls: list[dict[str, Any]]) -> None:
    """Each call names a tool and its arguments (JSON text) fit the tool's schema."""
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def reassemble(deltas: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """The content and the calls of a stream's deltas, the order of OpenAI's stream asserted."""
    content, calls = "", []
    for delta in deltas:
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls") or []:
            i, function = tc["index"], tc["function"]
            if i == len(calls):  # a new call: its header
                assert str(tc.get("id")).startswith("call_") and tc.get("type") == "function", tc
                assert function.get("name") and function.get("arguments") == "", tc
                calls.append({"id": tc["id"], "name": function["name"], "arguments": ""})
                continue
            assert i < len(calls), f"a delta of call {i} before call {len(calls)}'s header: {tc}"
            assert set(tc) == {"index", "function"} and set(function) == {"arguments"}, tc
            assert function.get("arguments"), tc
            calls[i]["arguments"] += function["arguments"]
    return content, calls


# ---- the parsers --------------------------------------------------------------------------------

HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, "}"]}}\n</tool_call>'  # noqa: E501
HERMES = [  # (output, content, [(name, arguments)])
    (HERMES_CALL, "", [("get_weather", '{"city": "Paris", "n": [1, "}"]}')]),
    (
        f'Let me look.\n{HERMES_CALL}\n<tool_call>{{"name": "add", "arguments": {{}}}}</tool_call>',
        "Let me look.",
        [("get_weather", '{"city": "Paris", "n": [1, "}"]}'), ("add", "{}")],
    ),
    (  # arguments before the name; arguments as JSON text
        '<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call>'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 2}"}</tool_call> done',
        "done",
        [("add", '{"a": 1}'), ("add", '{"a": 2}')],
    ),
    ("no calls at all, < tool_call >", "no calls at all, < tool_call >", []),
    ("  spaces kept  \n", "  spaces kept  \n", []),
]
MALFORMED = [  # hermes blocks that are not calls: the whole text comes back as content
    "<tool_call>not json</tool_call>",
    '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": 1}',  # cut
    "<tool_call>",
]
# Outputs whose call fails only after its name and arguments began: a stream has sent them.
BEGUN = {
    MALFORMED[1],
    MALFORMED[4],
    '{"name": "add", "parameters": {"a": 1}',
    '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "ad',
}
LLAMA = [
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [("add", '{"a": 1, "b": 2}')]),
    (
        '<|python_tag|>{"name": "add", "parameters": {}}; {"name": "get_weather", '
        '"parameters": {"city": "Rome"}}',
        "",
        [("add", "{}"), ("get_weather", '{"city": "Rome"}')],
    ),
    ('{"name": "add", "parameters": {}}\nI added.', "I added.", [("add", "{}")]),
    ('{"answer": 4}', '{"answer": 4}', []),
    ("It is 4.", "It is 4.", []),
    ('{"name": "add", "parameters": {"a": 1}', '{"name": "add", "parameters": {"a": 1}', []),
    ('{"name": "add", "parameters": 5}', '{"name": "add", "parameters": 5}', []),
]
FORCED_OUT = [
    ('{"name": "add", "arguments": {"a": 1, "b": 2}}', "", [("add", '{"a": 1, "b": 2}')]),
    (
        '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": '
        '{"city": "Rome", "unit": "celsius"}}]',
        "",
        [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "Rome", "unit": "celsius"}')],
    ),
    ('[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "ad', None, []),  # cut
]
CASES = [
    *[("hermes", *c) for c in HERMES],
    *[("hermes", text, text, []) for text in MALFORMED],
    *[("llama3_json", *c) for c in LLAMA],
    *[("forced", *c) for c in FORCED_OUT],
]


def parser_of(name: str) -> Any:
    return FORCED if name == "forced" else PARSERS[name]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_a_whole_output_is_read(parser, text, content, calls):
    got = parser_of(parser).parse(text)
    assert got == Parsed(text if content is None else content, [ToolCall(*c) for c in calls])


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_any_cut_of_a_stream_adds_up_to_the_whole_output(parser, text, content, calls):
    """Fed in pieces of every size (and at random), the deltas are in OpenAI's order, the
    markup never shows in the content, and they reassemble to the whole output's reading."""
    whole = parser_of(parser).parse(text)
    rng = random.Random(0)
    cuts = [[size] * len(text) for size in (1, 2, 3, 7)] + [
        [rng.randint(1, 9) for _ in text] for _ in range(20)
    ]
    for sizes in cuts:
        stream, deltas, i = ToolCallStream(parser_of(parser).parse), [], 0
        for size in sizes:
            if i >= len(text):
                break
            deltas += stream.feed(text[i : i + size], False)
            i += size
        deltas += stream.feed("", True)
        got_content, got_calls = reassemble(deltas)
        if text in BEGUN and stream.called:  # the stream ends with what it sent
            assert not whole.calls and "<tool_call" not in got_content
            assert all(c["arguments"] in text for c in got_calls)
            continue
        assert got_content == (whole.content if whole.calls else text)
        assert [(c["name"], c["arguments"]) for c in got_calls] == [
            (c.name, c.arguments) for c in whole.calls
        ]
        if whole.calls and "<tool_call>" not in whole.content:
            assert "<tool_call" not in got_content


def test_descriptions_and_histories_in_the_parsers_formats():
    """Each format's description tells its markup; a call written back reads as itself."""
    tools = [TOOLS[1]]
    for name, markup in (("hermes", "<tool_call>"), ("llama3_json", '"parameters"')):
        parser = PARSERS[name]
        assert markup in parser.describe(tools) and '"name": "add"' in parser.describe(tools)
        calls = [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "f", "arguments": {}}]
        got = parser.parse(parser.render(calls))
        assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [
            (c["name"], c["arguments"]) for c in calls
        ]


# ---- the request side ---------------------------------------------------------------------------


def plan_of(tools: list[dict[str, Any]], choice: Any, parallel: bool | None = None) -> ToolPlan:
    plan = ToolPlan.of([ToolDef(**t) for t in tools], choice, parallel, "hermes")
    assert plan is not None
    return plan


def test_the_forced_grammar_is_the_calls_schema():
    """A named function: its call object; required: an array of calls (one at most without
    parallel calls); every forced output the parser reads validates against it."""
    one = plan_of(TOOLS, named("add")).schema()
    assert one["properties"]["name"] == {"const": "add"} and one["properties"]["arguments"] == ADD
    many = plan_of(TOOLS, "required").schema()
    assert many["minItems"] == 1 and "maxItems" not in many and len(many["items"]["anyOf"]) == 2
    assert plan_of(TOOLS, "required", parallel=False).schema()["maxItems"] == 1
    assert plan_of(TOOLS, "auto").structured() is None
    assert plan_of(TOOLS, "none").reader is None
    text = '[{"name": "add", "arguments": {"a": 1, "b": 2}}]'
    jsonschema.validate(json.loads(text), many)
    assert FORCED.parse(text).calls == [ToolCall("add", '{"a": 1, "b": 2}')]


def test_without_parallel_calls_auto_reads_the_first_call_only():
    text = HERMES[1][0]
    assert len(plan_of(TOOLS, "auto").read(text).calls) == 2
    assert plan_of(TOOLS, "auto", parallel=False).read(text) == Parsed(
        "Let me look.", [ToolCall("get_weather", '{"city": "Paris", "n": [1, "}"]}')]
    )


TOOL_TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}"
    "{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
)
HISTORY = [
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees"},
]  # fmt: skip


def test_the_history_reaches_the_template(tiny_tools_checkpoint):
    """A template with a tools section gets the tools and the calls' arguments as objects, as
    transformers passes them; one without gets the tools described in a system message and
    the calls written into the assistant's text in the parser's format."""
    tok = load_tokenizer(str(tiny_tools_checkpoint))
    messages = check_messages(HISTORY)
    plan = plan_of(TOOLS, "auto")
    assert template_takes_tools(tok, TOOL_TEMPLATE) and not template_takes_tools(tok)
    msgs, tools = template_messages(messages, plan, PARSERS["hermes"], True)
    text = render_chat(tok, msgs, chat_template=TOOL_TEMPLATE, tools=tools)
    assert text.startswith("TOOLS [{") and '"name": "add"' in text
    assert 'CALL get_weather {"city": "Paris", "unit": "celsius"}' in text
    assert "tool: 22 degrees [call_1]" in text
    msgs, tools = template_messages(messages, plan, PARSERS["hermes"], False)
    assert tools is None and msgs[0]["role"] == "system" and "<tools>" in msgs[0]["content"]
    text = render_chat(tok, msgs)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in text
    assert "<|tool|>22 degrees" in text
    system = [{"role": "system", "content": "Be brief."}, *messages]
    msgs, _ = template_messages(system, plan_of(TOOLS, named("add")), PARSERS["hermes"], False)
    head = msgs[0]["content"]
    assert head.startswith("Be brief.\n\n") and "Call the function add" in head
    msgs, _ = template_messages(messages, plan_of(TOOLS, "none"), PARSERS["hermes"], False)
    assert msgs[0]["role"] == "user"  # "none": no tools in the prompt


# ---- the server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_tools_checkpoint(make_checkpoint: Any) -> Any:
    return make_checkpoint("llama", with_tokenizer=True, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def server(make_checkpoint: Any, tiny_tools_checkpoint: Any) -> Iterator[ServerThread]:
    draft = make_checkpoint("llama", with_tokenizer=True, seed=1, max_position_embeddings=2048)
    kw = engine_kwargs(tiny_tools_checkpoint, draft, max_model_len=2048, num_kv_blocks=1024)
    app = build_app(EngineArgs(**kw), served_model_name=MODEL)
    with ServerThread(app) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def ask(client: Any, stream: bool, **kw: Any) -> tuple[str | None, list[dict[str, Any]], str]:
    """The reply's content, calls and finish reason, whole or reassembled from the stream."""
    if not stream:
        choice = client.chat.completions.create(model=MODEL, **kw).choices[0]
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls or []]  # fmt: skip
        return choice.message.content, calls, choice.finish_reason
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kw))
    deltas = [c.choices[0].delta.model_dump(exclude_none=True) for c in chunks if c.choices]
    content, calls = reassemble(deltas)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert all(f is None for f in finishes[:-1])
    return content or None, calls, finishes[-1]


@pytest.mark.parametrize("stream", [False, True])
def test_a_two_turn_tool_conversation_with_the_openai_client(server, client, stream):
    first = dict(messages=ASK, tools=TOOLS, tool_choice=named("get_weather"), max_tokens=120,
                 temperature=1.0, seed=3)  # fmt: skip
    content, calls, finish = ask(client, stream, **first)
    assert content is None and finish == "tool_calls" and len(calls) == 1
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    valid(calls)
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls
        ]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "22 degrees, sunny"},
    ]  # fmt: skip
    content, calls, finish = ask(client, stream, messages=history, tools=TOOLS, max_tokens=16,
                                 temperature=1.0, seed=4)  # fmt: skip
    assert isinstance(content, str) and content and not calls and finish == "length"
    wait_pool_full(server.engine)


@pytest.mark.parametrize(
    ("choice", "parallel"), [("required", None), ("required", False), (named("add"), None)]
)
def test_streamed_forced_calls_are_the_unstreamed_ones(server, client, choice, parallel):
    """Seeded, a forced call streams as its header then argument fragments that add up to the
    unstreamed arguments; the reply is tool_calls, without content. Parallel calls may run
    past max_tokens (the random model goes on calling): then the whole reply is the text, and
    the stream the calls it began."""
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    finishes = []
    for seed in range(6):
        kw = dict(messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=300,
                  temperature=1.0, seed=seed, **extra)  # fmt: skip
        whole = ask(client, False, **kw)
        streamed = ask(client, True, **kw)
        assert whole[2] == streamed[2]
        finishes.append(whole[2])
        if whole[2] == "length":  # the stream's calls: those the text had begun
            assert parallel is None and choice == "required" and not whole[1]
            begun = FORCED.parse(whole[0], final=False).calls
            assert len(begun) - 1 <= len(streamed[1]) <= len(begun) and len(begun) > 1
            for b, c in zip(begun, streamed[1], strict=False):
                assert b.name == c["name"] and b.arguments.startswith(c["arguments"])
            continue
        pairs = [(c["name"], c["arguments"]) for c in whole[1]]
        assert [(c["name"], c["arguments"]) for c in streamed[1]] == pairs
        assert whole[0] is streamed[0] is None and whole[2] == "tool_calls"
        valid(whole[1])
        if parallel is False or choice != "required":
            assert len(whole[1]) == 1
    if parallel is False or choice != "required":
        assert finishes == ["tool_calls"] * len(finishes), finishes
    wait_pool_full(server.engine)


CALL_REGEX = (
    r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
    r'"unit": "(celsius|fahrenheit)"\}\}\n</tool_call>'
)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_models_own_markup(server, client, stream, monkeypatch):
    """Under ``auto`` (the model's output held to a regex, as a model writing markup would),
    the text before a call is content and the markup is not; a block that is not a call
    comes back as content; llama3_json reads Llama 3's JSON."""
    kw = dict(messages=ASK, tools=TOOLS, max_tokens=200, temperature=1.0, seed=5)
    regex = {"structured_outputs": {"regex": CALL_REGEX}}
    content, calls, finish = ask(client, stream, extra_body=regex, **kw)
    assert content == "Sure." and finish == "tool_calls" and len(calls) == 1
    assert calls[0]["name"] == "get_weather"
    valid(calls)
    bad = {"structured_outputs": {"regex": r"Hm <tool_call>\{oops\}</tool_call>"}}
    content, calls, finish = ask(client, stream, extra_body=bad, **kw)
    assert content == "Hm <tool_call>{oops}</tool_call>" and not calls and finish == "stop"
    none = ask(client, stream, extra_body=regex, tool_choice="none", **kw)
    assert none[0] is not None and none[0].startswith("Sure.\n<tool_call>") and not none[1]
    monkeypatch.setattr(server.app.state.server, "tool_call_parser", "llama3_json")
    llama = {"structured_outputs": {"regex": r'\{"name": "add", "parameters": \{"a": [1-9]\}\}'}}
    content, calls, finish = ask(client, stream, extra_body=llama, **kw)
    assert content is None and finish == "tool_calls" and calls[0]["name"] == "add"
    wait_pool_full(server.engine)


def tool(name: str = "f", parameters: Any = None, **extra: Any) -> dict[str, Any]:
    function = {"name": name, **({} if parameters is None else {"parameters": parameters})}
    return {"type": "function", "function": function, **extra}


BAD = [  # (fields, the param named, words of the message)
    ({"tools": [tool(parameters={"type": "string"})]}, "tools",
     ["tools[0].function.parameters must be a JSON schema of type object"]),
    ({"tools": [tool(parameters=[1])]}, "tools", ["tools[0].function.parameters"]),
    ({"tools": [tool("g"), tool("f"), tool("g")]}, "tools",
     ["tools[2].function.name: 'g' is the name of tools[0] too"]),
    ({"tools": [tool()], "tool_choice": named("g")}, "tool_choice",
     ["tool_choice.function.name: 'g' is not among the tools (f)"]),
    ({"tool_choice": "required"}, "tool_choice", ["needs tools"]),
    ({"tool_choice": named("f")}, "tool_choice", ["not among the tools"]),
    ({"tools": [tool()], "tool_choice": "sometimes"}, "tool_choice", ["tool_choice must be"]),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools", ["tools[0].type"]),
    ({"tools": [{"type": "function"}]}, "tools", ["tools[0].function"]),
    ({"tools": [tool("two words")]}, "tools", ["tools[0].function.name must be"]),
    ({"tools": [tool(parameters={"type": "object", "properties": {"x": {"type": 5}}})],
      "tool_choice": "required"}, "tools", ["tools[0].function.parameters: invalid JSON schema"]),
    ({"tools": [tool()], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", ["cannot be combined with response_format"]),
    ({"messages": [*ASK, {"role": "tool", "content": "22"}]}, "messages", ["tool_call_id"]),
    ({"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages", ["messages[1].tool_calls[0].function.arguments: not valid JSON"]),
    ({"functions": [{"name": "f"}]}, "functions", ["not supported", "tools"]),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param", "words"), BAD)
def test_bad_tools_are_400_naming_the_field(server, fields, param, words):
    for stream in (False, True):
        body = {"messages": ASK, "max_tokens": 4, "stream": stream, **fields}
        refused(post(server, body, CHAT), param, *words)
    assert server.engine.num_in_flight == 0
    wait_pool_full(server.engine)


def out_of_order(feed: Any) -> Any:
    """A planted bug: a call's first argument fragment sent before its header."""

    def planted(stream: ToolCallStream, text: str, final: bool) -> list[dict[str, Any]]:
        deltas = feed(stream, text, final)
        for i, d in enumerate(deltas[:-1]):
            if "id" in (d.get("tool_calls") or [{}])[0]:
                deltas[i], deltas[i + 1] = deltas[i + 1], deltas[i]
        return deltas

    return planted


def swapped(feed: Any) -> Any:
    """A planted bug: each argument fragment held back and sent after the next one."""
    held: list[dict[str, Any]] = []

    def planted(stream: ToolCallStream, text: str, final: bool) -> list[dict[str, Any]]:
        out = []
        for d in feed(stream, text, final):
            if "id" in (d.get("tool_calls") or [{"id": 0}])[0]:
                out.append(d)
            elif held:
                out += [d, held.pop()]
            else:
                held.append(d)
        return out + (held if final else [])

    return planted


@pytest.mark.parametrize("plant", [out_of_order, swapped])
def test_a_tool_call_delta_out_of_order_is_caught(server, client, monkeypatch, plant):
    kw = dict(messages=ASK, tools=TOOLS, tool_choice=named("add"), max_tokens=100,
              temperature=1.0, seed=7)  # fmt: skip
    whole = [(c["name"], c["arguments"]) for c in ask(client, False, **kw)[1]]
    assert [(c["name"], c["arguments"]) for c in ask(client, True, **kw)[1]] == whole
    monkeypatch.setattr(ToolCallStream, "feed", plant(ToolCallStream.feed))
    with pytest.raises(AssertionError):
        assert [(c["name"], c["arguments"]) for c in ask(client, True, **kw)[1]] == whole
    wait_pool_full(server.engine)


# ---- 200 forced calls on the built-in pair ------------------------------------------------------

N_CALLS = 200
DRAFTERS = {
    "none": {"num_speculative_tokens": 0},
    "draft_model": {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 3}},
    "ngram": {
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                               "prompt_lookup_max": 3}
    },
    "eagle": {"speculative_config": {"method": "eagle", "num_speculative_tokens": 3}},
}  # fmt: skip


async def forced_calls(url: str) -> list[Any]:
    """N_CALLS forced calls at once (one batch): half ``required`` (one call), half a named
    function, each seeded."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    bodies = [
        dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris? And 2 + 3?"}],
             tools=TOOLS, max_tokens=160, temperature=1.0, seed=i,
             **({"tool_choice": "required", "parallel_tool_calls": False} if i % 2 else
                {"tool_choice": named(("get_weather", "add")[i // 2 % 2])}))
        for i in range(N_CALLS)
    ]  # fmt: skip
    try:
        return await asyncio.gather(*[client.chat.completions.create(**b) for b in bodies])
    finally:
        await client.close()


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_200_forced_calls_parse_and_fit_their_schemas(drafter):
    kw = dict(max_model_len=512, max_num_seqs=N_CALLS, num_kv_blocks=4096, block_size=16, seed=0)
    app = build_app(EngineArgs(**DRAFTERS[drafter], **kw), served_model_name=MODEL)
    with ServerThread(app) as s:
        replies = asyncio.run(forced_calls(s.url))
        spec = s.engine.engine.metrics.spec
        if drafter != "none":
            assert spec.proposed > 0 and spec.accepted > 0
        wait_pool_full(s.engine)
    parsed = 0
    for i, r in enumerate(replies):
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        calls = [{"name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls]  # fmt: skip
        valid(calls)
        assert len(calls) == 1 and (i % 2 or calls[0]["name"] == ("get_weather", "add")[i // 2 % 2])
        parsed += 1
    assert parsed == N_CALLS


# ---- the law of a forced call under speculation -------------------------------------------------

N = 2_000  # catches a TV error of 0.06 in the arguments' law with probability >= 0.9
TV = 0.06
EOS = 2  # the tiny tokenizer's </s>
PICK = {
    "type": "object",
    "properties": {"n": {"enum": ["yes", "no", "maybe"]}},
    "required": ["n"],
    "additionalProperties": False,
}
PICK_PLAN = ToolPlan.of(
    [ToolDef(type="function", function={"name": "pick", "parameters": PICK})],
    named("pick"),
    None,
    "hermes",
)
LAW_PROMPT = 'pick one: {"name": "pick", "arguments": {"n": "maybe"}}'  # n-gram lookup drafts


@pytest.fixture(scope="module")
def law_pair(make_checkpoint, tmp_path_factory):
    target = make_checkpoint(
        "llama", vocab_size=256, hidden_size=32, num_heads=2, num_kv_heads=1,
        intermediate_size=64, seed=7, max_position_embeddings=128, with_tokenizer=True,
    )  # fmt: skip
    draft = make_perturbed_draft(target, tmp_path_factory.mktemp("tool_draft"), 0.25, seed=1)
    prompt = load_tokenizer(str(target)).encode(LAW_PROMPT)
    assert PICK_PLAN is not None
    schema = PICK_PLAN.schema()
    exact = masked_law(target, prompt, compile_reference(target, "json", schema, EOS, False), 1.0)
    return target, draft, prompt, exact


@pytest.mark.parametrize("method", ["none", "draft_model", "ngram"])
def test_a_forced_calls_law_is_the_masked_targets(law_pair, method):
    """The arguments of a forced call follow the law of sampling the target masked by the
    call's grammar (and so, without a power claim at this N, do its token sequences)."""
    target, draft, prompt, exact = law_pair
    spec = {
        "none": None,
        "draft_model": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                  "prompt_lookup_max": 2},
    }[method]  # fmt: skip
    llm = LLM(str(target), speculative_config=spec, max_num_seqs=256, num_kv_blocks=2048,
              block_size=4, seed=23, max_model_len=128)  # fmt: skip
    assert PICK_PLAN is not None
    params = SamplingParams(temperature=1.0, max_tokens=60,
                            structured_outputs=PICK_PLAN.structured())  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": prompt}] * N, params, use_tqdm=False)
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
    if spec is not None:
        assert llm.engine.metrics.spec.proposed > 0 and llm.engine.metrics.spec.accepted > 0
    samples = [tuple(o.outputs[0].token_ids) for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert_matches(samples, exact, tv=None)
    tok = load_tokenizer(str(target))

    def argument(tokens: tuple[int, ...]) -> tuple[str]:
        (call,) = FORCED.parse(tok.decode(list(tokens), skip_special_tokens=True)).calls
        jsonschema.validate(json.loads(call.arguments), PICK)
        return (json.loads(call.arguments)["n"],)

    law: dict[tuple[str], float] = {}
    for tokens, p in exact.items():
        law[argument(tokens)] = law.get(argument(tokens), 0.0) + p
    assert_matches([argument(s) for s in samples], law, tv=TV)
