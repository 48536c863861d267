"""Chat: the built-in pair's template, ``LLM.chat`` and ``/v1/chat/completions`` out of the box."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from specbatch import LLM, SamplingParams
from specbatch.config import EngineArgs
from specbatch.entrypoints.openai_server import build_app
from specbatch.errors import InvalidInputError
from tests.test_server import ServerThread

openai = pytest.importorskip("openai")

CONVERSATION = [
    {"role": "system", "content": "Answer in Python."},
    {"role": "user", "content": "Reverse a string.\nKeep it short."},
    {"role": "assistant", "content": "def reverse(s):\n    return s[::-1]\n"},
    {"role": "user", "content": [{"type": "text", "text": "Now a list."}]},
]
RENDERED = (
    "# system:\n# Answer in Python.\n"
    "# user:\n# Reverse a string.\n# Keep it short.\n"
    "# assistant:\ndef reverse(s):\n    return s[::-1]\n"
    "# user:\n# Now a list.\n"
    "# assistant:\n"
)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(max_model_len=256, num_kv_blocks=64) as engine:  # the built-in pair
        yield engine


def test_the_builtin_template_renders_plain_role_tagged_turns(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in CONVERSATION[:3]]
        + [{"role": "user", "content": "Now a list."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == RENDERED


def test_llm_chat_is_generate_on_the_rendered_conversation(llm: LLM) -> None:
    (one,) = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    ids = llm.get_tokenizer().encode(RENDERED, add_special_tokens=False)
    (plain,) = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert one.prompt == RENDERED and one.prompt_token_ids == ids
    assert one.outputs[0].token_ids == plain.outputs[0].token_ids
    assert len(one.outputs[0].token_ids) == 8
    hello = [{"role": "user", "content": "hello"}]
    two = llm.chat([CONVERSATION, hello], GREEDY, use_tqdm=False)  # a list of conversations
    assert [o.prompt for o in two] == [RENDERED, "# user:\n# hello\n# assistant:\n"]
    assert two[0].outputs[0].token_ids == one.outputs[0].token_ids
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "messages must be a non-empty list"),
        ([{"content": "x"}], "messages[0] must be an object with a string role"),
        ([{"role": "user", "content": 3}], "messages[0].content must be a string"),
        ([[{"role": "user", "content": "a"}], [{"role": "user"}]], "messages[1][0].content"),
    ],
)
def test_bad_messages_name_the_message(llm: LLM, messages: list, message: str) -> None:
    with pytest.raises(InvalidInputError) as e:
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert str(e.value).startswith(message)


def test_chat_completions_answer_with_the_builtin_pair() -> None:
    app = build_app(EngineArgs(max_model_len=256, num_kv_blocks=64))
    with ServerThread(app) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(
            model="specbatch-default",
            messages=[{"role": "user", "content": "Write a function that adds two numbers."}],
            max_tokens=8,
            temperature=0,
        )
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 0 and 1 <= reply.usage.completion_tokens <= 8
