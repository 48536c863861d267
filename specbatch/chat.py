"""Chat messages: checked, and rendered into a prompt by the tokenizer's chat template.

Shared by ``LLM.chat`` and the server's ``/v1/chat/completions``. A message is
``{"role": str, "content": str | [{"type": "text", "text": str}, ...]}``, as in the OpenAI API.
The rendered text already holds whatever special tokens the template writes, so it is tokenized
with ``add_special_tokens=False``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specbatch.errors import InvalidInputError

Message = dict[str, Any]
ROLES = ("system", "developer", "user", "assistant")  # the roles of a text conversation


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise InvalidInputError(f"{where}.content[{i}]: only text parts are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidInputError(f"{where}.content[{i}].text must be a string")
            parts.append(text)
        return "".join(parts)
    raise InvalidInputError(f"{where}.content must be a string or a list of text parts")


def check_messages(messages: Any, where: str = "messages") -> list[dict[str, str]]:
    """One conversation as ``[{"role", "content"}]`` with text contents; raises naming the
    message at fault."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidInputError(f"{where} must be a non-empty list of {{role, content}} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidInputError(f"{where}[{i}] must be an object with a string role")
        if m["role"] not in ROLES:
            raise InvalidInputError(
                f"{where}[{i}].role must be one of {', '.join(ROLES)}, got {m['role']!r}"
            )
        out.append({"role": m["role"], "content": _text_of(m.get("content"), f"{where}[{i}]")})
    return out


def conversations_of(messages: Sequence[Any]) -> list[Any]:
    """``messages`` as a list of conversations: one conversation (a list of message dicts)
    or a list of them, as ``LLM.chat`` takes it."""
    if (
        isinstance(messages, (list, tuple))
        and messages
        and all(isinstance(c, (list, tuple)) for c in messages)
    ):
        return list(messages)
    return [messages]


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, str]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text of a conversation, by ``chat_template`` or else the tokenizer's."""
    if tokenizer is None:
        raise InvalidInputError(
            "messages: the model has no tokenizer, so it cannot chat", "messages"
        )
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidInputError(
            "messages: the model's tokenizer has no chat template; pass chat_template, or "
            "give plain prompts to generate (/v1/completions on the server)",
            "messages",
        )
    try:
        text = tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
    except Exception as e:  # a template may raise on roles it does not know (jinja's errors)
        raise InvalidInputError(
            f"messages: the chat template rejected them: {e}", "messages"
        ) from None
    if not isinstance(text, str):
        raise InvalidInputError("messages: the chat template did not render to text", "messages")
    return text
