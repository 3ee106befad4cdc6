"""Chat messages as the OpenAI API sends them, and as the chat template receives them.

A message may carry ``name``, ``tool_calls`` (assistant) and ``tool_call_id`` (tool);
they go to the template, as transformers' ``apply_chat_template`` passes them, and each
message records the keys the template looked up while rendering: a field the template
ignored is refused with a 400 naming it, so a client never gets an answer to a
conversation the model did not see.
Unknown keys are refused the same way (by the model's ``extra="forbid"``).
``content`` may be null only where OpenAI allows it: an assistant message with tool calls.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict

from .. import errors

# the message fields the template must read for the request to be served
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


class TrackedMessage(dict):  # type: ignore[type-arg]
    """A message for the template that records which of its keys the template read
    (looked up, or all of them when it iterated or serialised the message)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def _read_all(self) -> None:
        self.read.update(super().keys())

    def items(self) -> Any:
        self._read_all()
        return super().items()

    def keys(self) -> Any:
        self._read_all()
        return super().keys()

    def values(self) -> Any:
        self._read_all()
        return super().values()

    def __iter__(self) -> Any:
        self._read_all()
        return super().__iter__()


def template_messages(messages: list[ChatMessage]) -> list[TrackedMessage]:
    """The messages as template input; InvalidRequestError names a field that cannot go."""
    if not messages:
        raise errors.InvalidRequestError("messages is empty")
    return [_one(i, m) for i, m in enumerate(messages)]


def check_fields_read(messages: list[TrackedMessage]) -> None:
    """After rendering: refuse a ``name``/``tool_calls``/``tool_call_id`` the template never
    read (the prompt would be the same without it)."""
    for i, message in enumerate(messages):
        for name in TEMPLATE_FIELDS:
            if dict.__contains__(message, name) and name not in message.read:
                raise errors.InvalidRequestError(f"messages[{i}].{name}: this model's chat template does not use it")


def _one(i: int, m: ChatMessage) -> TrackedMessage:
    where = f"messages[{i}]"
    if m.tool_calls is not None and m.role != "assistant":
        raise errors.InvalidRequestError(f"{where}.tool_calls: only an assistant message carries tool calls")
    if m.tool_call_id is not None and m.role != "tool":
        raise errors.InvalidRequestError(f"{where}.tool_call_id: only a tool message answers a tool call")
    if m.role == "tool" and m.tool_call_id is None:
        raise errors.InvalidRequestError(f"{where}.tool_call_id: a tool message needs the id of the call it answers")
    if m.content is None and not (m.role == "assistant" and m.tool_calls):
        raise errors.InvalidRequestError(f"{where}.content: null only in an assistant message with tool_calls")
    out = TrackedMessage(role=m.role, content=_text_content(where, m.content))
    for name in TEMPLATE_FIELDS:
        value = getattr(m, name)
        if value is not None:
            out[name] = [_template_call(c) for c in value] if name == "tool_calls" else value
    return out


def _template_call(call: ToolCall) -> dict[str, Any]:
    """OpenAI's call (arguments as a JSON string) as templates expect it: the Qwen and
    Llama templates write ``arguments | tojson``, so a JSON object goes in as a dict."""
    try:
        arguments: Any = json.loads(call.function.arguments)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's stack: kept as text
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
