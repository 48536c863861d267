"""Chat messages: checked, and rendered into a prompt by the tokenizer's chat template.

Shared by ``LLM.chat`` and the server's ``/v1/chat/completions``. A message is
``{"role": str, "content": str | [{"type": "text", "text": str}, ...]}``, as in the OpenAI API;
an assistant's may carry ``tool_calls`` (its content then may be null) and a tool's result is
``{"role": "tool", "content": ..., "tool_call_id": ...}``. They reach the template as
transformers documents them: a call's ``arguments`` as an object, not JSON text.
The rendered text already holds whatever special tokens the template writes, so it is tokenized
with ``add_special_tokens=False``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from specbatch.errors import InvalidInputError

Message = dict[str, Any]
ROLES = ("system", "developer", "user", "assistant", "tool")  # the roles of a text conversation


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


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant's ``tool_calls``, each ``{"id", "type": "function", "function": {"name",
    "arguments": {...}}}`` (arguments given as JSON text or as an object)."""
    if not isinstance(calls, (list, tuple)):
        raise InvalidInputError(f"{where} must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}].function"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidInputError(f"{at} must be an object with a string name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as e:
                raise InvalidInputError(f"{at}.arguments: not valid JSON: {e}") from None
        if not isinstance(arguments, dict):
            raise InvalidInputError(f"{at}.arguments must be a JSON object")
        one = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            one["id"] = call["id"]
        out.append(one)
    return out


def check_messages(messages: Any, where: str = "messages") -> list[dict[str, Any]]:
    """One conversation as ``[{"role", "content"}]`` with text contents (an assistant's
    ``tool_calls`` and a tool's ``tool_call_id`` and ``name`` kept); raises naming the message
    at fault."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidInputError(f"{where} must be a non-empty list of {{role, content}} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidInputError(f"{where}[{i}] must be an object with a string role")
        role, at = m["role"], f"{where}[{i}]"
        if role not in ROLES:
            raise InvalidInputError(f"{at}.role must be one of {', '.join(ROLES)}, got {role!r}")
        calls = m.get("tool_calls") if role == "assistant" else None
        content = m.get("content")
        text = "" if content is None and calls else _text_of(content, at)
        one: dict[str, Any] = {"role": role, "content": text}
        if calls:
            one["tool_calls"] = _tool_calls(calls, f"{at}.tool_calls")
        if role == "tool":
            one.update({k: m[k] for k in ("tool_call_id", "name") if isinstance(m.get(k), str)})
        out.append(one)
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


def template_takes_tools(tokenizer: Any, chat_template: str | None = None) -> bool:
    """Whether the chat template reads a ``tools`` variable (has a tools section)."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: transformers picks "tool_use" for tools
        return "tool_use" in template
    if not isinstance(template, str):
        return False
    import jinja2
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(
            jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
        )
    except jinja2.TemplateError:  # a tag of transformers' own environment
        return re.search(r"\btools\b", template) is not None


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text of a conversation, by ``chat_template`` or else the tokenizer's;
    ``tools`` as transformers passes them to the template."""
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
            tools=tools,
        )
    except Exception as e:  # a template may raise on roles it does not know (jinja's errors)
        raise InvalidInputError(
            f"messages: the chat template rejected them: {e}", "messages"
        ) from None
    if not isinstance(text, str):
        raise InvalidInputError("messages: the chat template did not render to text", "messages")
    return text
