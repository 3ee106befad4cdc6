"""Chat messages as the OpenAI API sends them, and as the chat template receives them.

A message may carry ``name``, ``tool_calls`` (assistant) and ``tool_call_id`` (tool);
they go to the template, as transformers' ``apply_chat_template`` passes them, but only
when the template reads them: a field the template would ignore is refused with a 400
naming it, so a client never gets an answer to a conversation the model did not see.
Unknown keys are refused the same way (by the model's ``extra="forbid"``).
``content`` may be null only where OpenAI allows it: an assistant message with tool calls.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict

from .. import errors

# the message fields a template must read for the server to pass them on
TEMPLATE_FIELDS = ("name", "tool_calls", "tool_call_id")


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


def template_messages(messages: list[ChatMessage], template_reads: frozenset[str]) -> list[dict[str, Any]]:
    """The messages as template input; InvalidRequestError names a field that cannot go."""
    if not messages:
        raise errors.InvalidRequestError("messages is empty")
    return [_one(i, m, template_reads) for i, m in enumerate(messages)]


def _one(i: int, m: ChatMessage, template_reads: frozenset[str]) -> dict[str, Any]:
    where = f"messages[{i}]"
    if m.tool_calls is not None and m.role != "assistant":
        raise errors.InvalidRequestError(f"{where}.tool_calls: only an assistant message carries tool calls")
    if m.tool_call_id is not None and m.role != "tool":
        raise errors.InvalidRequestError(f"{where}.tool_call_id: only a tool message answers a tool call")
    if m.role == "tool" and m.tool_call_id is None:
        raise errors.InvalidRequestError(f"{where}.tool_call_id: a tool message needs the id of the call it answers")
    if m.content is None and not (m.role == "assistant" and m.tool_calls):
        raise errors.InvalidRequestError(f"{where}.content: null only in an assistant message with tool_calls")
    out: dict[str, Any] = {"role": m.role, "content": _text_content(where, m.content)}
    for name in TEMPLATE_FIELDS:
        value = getattr(m, name)
        if value is None:
            continue
        if name not in template_reads:
            raise errors.InvalidRequestError(f"{where}.{name}: this model's chat template does not use it")
        out[name] = [_template_call(c) for c in value] if name == "tool_calls" else value
    return out


def _template_call(call: ToolCall) -> dict[str, Any]:
    """OpenAI's call (arguments as a JSON string) as templates expect it: the Qwen and
    Llama templates write ``arguments | tojson``, so a JSON object goes in as a dict."""
    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


def _text_content(where: str, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise errors.InvalidRequestError(f"{where}.content: unsupported content part {part.get('type')!r}: only text is supported")
        parts.append(part["text"])
    return "".join(parts)
