"""Chat messages as the OpenAI API sends them, and as the chat template receives them.

A message may carry ``name``, ``tool_calls`` (assistant) and ``tool_call_id`` (tool);
they go to the template, as transformers' ``apply_chat_template`` passes them, and each
message records the keys the template looked up while rendering: a field the template
ignored is refused with a 400 naming it, so a client never gets an answer to a
conversation the model did not see.
Unknown keys are refused the same way (by the model's ``extra="forbid"``), except the
fields the openai client's ``message.model_dump()`` writes on an answer it received
(``refusal``, ``annotations``, ``audio``, ``function_call``): agent loops send the answer
back as it came, so those are taken when null (a refusal's text is what the assistant
said; annotations only describe the content).
``content`` may be null only where OpenAI allows it: an assistant message with tool calls
or a refusal. Its parts are text, and ``input_audio`` for a model that hears (``hears``:
a Qwen3-Omni server, :mod:`.audio_input`): a message with audio goes to the template as
a list of parts, each audio one ``{"type": "audio"}``.

A template that does not read ``tool_calls`` still gets tool turns: the calls and their
results are written as text in the Hermes format the tool prompt teaches
(:func:`tool_turns_as_text`), so an agent's second turn works on any model.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict

from .. import errors

# the message fields the template receives
TEMPLATE_FIELDS = ("name", "tool_calls", "tool_call_id")
# those it must read for the request to be served (a template that renders tool results in
# order, as Qwen's does, need not print the id of the call each one answers)
MUST_READ = ("name", "tool_calls")


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
    # what the openai client's message.model_dump() adds to an answer it received
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None


class TrackedMessage(dict):  # type: ignore[type-arg]
    """A message for the template that records which of its keys the template read
    (looked up, or all of them when it iterated or serialised the message)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def derived(self, fields: dict[str, Any]) -> "TrackedMessage":
        """A message the template gets in this one's place (the tool prompt added, a call
        written as text): what the template reads of it counts as read of this one."""
        out = TrackedMessage(fields)
        out.read = self.read
        return out

    def fields(self) -> dict[str, Any]:
        """A plain copy of the message, without counting its keys as read."""
        return dict(dict.items(self))

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


def template_messages(messages: list[ChatMessage], *, hears: bool = False) -> list[TrackedMessage]:
    """The messages as template input; InvalidRequestError names a field that cannot go.
    ``hears``: ``input_audio`` parts are taken (the module's docstring)."""
    if not messages:
        raise errors.InvalidRequestError("messages is empty")
    return [_one(i, m, hears) for i, m in enumerate(messages)]


def check_fields_read(messages: list[TrackedMessage]) -> None:
    """After rendering: refuse a ``name`` or ``tool_calls`` the template never read (the
    prompt would be the same without it)."""
    for i, message in enumerate(messages):
        for name in MUST_READ:
            if dict.__contains__(message, name) and name not in message.read:
                raise errors.InvalidRequestError(f"messages[{i}].{name}: this model's chat template does not use it")


def _one(i: int, m: ChatMessage, hears: bool = False) -> TrackedMessage:
    where = f"messages[{i}]"
    if m.tool_calls is not None and m.role != "assistant":
        raise errors.InvalidRequestError(f"{where}.tool_calls: only an assistant message carries tool calls")
    if m.tool_call_id is not None and m.role != "tool":
        raise errors.InvalidRequestError(f"{where}.tool_call_id: only a tool message answers a tool call")
    if m.role == "tool" and m.tool_call_id is None:
        raise errors.InvalidRequestError(f"{where}.tool_call_id: a tool message needs the id of the call it answers")
    _check_answer_fields(where, m)
    if m.content is None and not (m.role == "assistant" and (m.tool_calls or m.refusal)):
        raise errors.InvalidRequestError(f"{where}.content: null only in an assistant message with tool_calls or a refusal")
    content = _content(where, m.content, hears) or (m.refusal if m.role == "assistant" and m.refusal else "")
    out = TrackedMessage(role=m.role, content=content)
    for name in TEMPLATE_FIELDS:
        value = getattr(m, name)
        if value is not None:
            out[name] = [_template_call(c) for c in value] if name == "tool_calls" else value
    return out


def _check_answer_fields(where: str, m: ChatMessage) -> None:
    """The fields of a received answer: taken on an assistant message, the legacy
    ``function_call`` and an ``audio`` reference only when null (neither can be served;
    a Qwen3-Omni server has replaced the audio references it holds before: audio_turns)."""
    extra = [name for name in ("refusal", "annotations", "audio", "function_call") if getattr(m, name) is not None]
    if extra and m.role != "assistant":
        raise errors.InvalidRequestError(f"{where}.{extra[0]}: only an assistant message carries it")
    if m.function_call is not None:
        raise errors.InvalidRequestError(f"{where}.function_call: the legacy function call is not supported; send tool_calls")
    if m.audio is not None:
        raise errors.InvalidRequestError(f"{where}.audio: an earlier answer's audio cannot be sent back here; send its transcript as content")


def tool_turns_as_text(messages: list[TrackedMessage]) -> list[TrackedMessage]:
    """Tool turns for a template that does not read ``tool_calls``, in the Hermes format
    the tool prompt teaches: an assistant's calls become ``<tool_call>`` blocks after its
    text, and each run of tool results one user turn of ``<tool_response>`` blocks (as
    Qwen's template writes them)."""
    out: list[TrackedMessage] = []
    run: list[TrackedMessage] = []  # the tool results since the last other message

    def end_run() -> None:
        if run:
            out.append(run[0].derived({"role": "user", "content": "\n".join(map(_response_block, run))}))
            run.clear()

    for message in messages:
        role = dict.get(message, "role")
        if role == "tool":
            message.read.update(k for k in ("tool_call_id", "name") if dict.__contains__(message, k))
            run.append(message)
            continue
        end_run()
        if role == "assistant" and dict.__contains__(message, "tool_calls"):
            message.read.add("tool_calls")
            fields = message.fields()
            blocks = "\n".join(_call_block(call) for call in fields.pop("tool_calls"))
            fields["content"] = f"{fields.get('content') or ''}\n{blocks}".lstrip("\n")
            out.append(message.derived(fields))
        else:
            out.append(message)
    end_run()
    return out


def _call_block(call: dict[str, Any]) -> str:
    function = call["function"]
    return f"<tool_call>\n{json.dumps({'name': function['name'], 'arguments': function['arguments']}, ensure_ascii=False)}\n</tool_call>"


def _response_block(message: TrackedMessage) -> str:
    """A tool result as Hermes writes it: the content, or with the tool's name
    ``{"name": ..., "content": ...}``."""
    content = dict.get(message, "content") or ""
    name = dict.get(message, "name")
    body = json.dumps({"name": name, "content": content}, ensure_ascii=False) if name else content
    return f"<tool_response>\n{body}\n</tool_response>"


def _template_call(call: ToolCall) -> dict[str, Any]:
    """OpenAI's call (arguments as a JSON string) as templates expect it: the Qwen and
    Llama templates write ``arguments | tojson``, so a JSON object goes in as a dict."""
    try:
        arguments: Any = json.loads(call.function.arguments)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's stack: kept as text
        arguments = call.function.arguments
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


def _content(where: str, content: Any, hears: bool) -> str | list[dict[str, Any]]:
    """The text, or with audio parts the list of parts the template reads."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for part in content:
        if part.get("type") == "input_audio":
            if not hears:
                raise errors.InvalidRequestError(f"{where}.content: input_audio parts need a model that hears "
                                                 "(a Qwen3-Omni model with an audio encoder)")
            parts.append({"type": "audio", "audio": None})
        elif part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise errors.InvalidRequestError(f"{where}.content: unsupported content part {part.get('type')!r}: only text "
                                             f"{'and input_audio are' if hears else 'is'} supported")
        else:
            parts.append({"type": "text", "text": part["text"]})
    if any(p["type"] == "audio" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)
