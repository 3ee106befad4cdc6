"""The body of ``POST /v1/responses`` and its translation into a chat request
(:mod:`.responses_api` serves it): ``instructions`` a system message first, ``input`` (a
string, or message, ``function_call`` and ``function_call_output`` items) the
conversation, function ``tools`` and ``tool_choice`` the chat's, ``text.format`` the
``response_format``, ``max_output_tokens`` the ``max_completion_tokens``."""

from __future__ import annotations

from typing import Any, Union

import pydantic

from .. import errors
from .errors import ClientNames, invalid
from .protocol import ChatCompletionRequest, Lenient

_TEXT_PARTS = ("input_text", "output_text", "text")
_REFUSED = {
    "previous_response_id": "this server stores no responses; send the whole conversation in input",
    "conversation": "this server stores no conversations; send the whole conversation in input",
    "prompt": "stored prompts are not served here; send instructions and input",
}


class ResponsesRequest(Lenient):
    """The body of ``POST /v1/responses``."""

    model: str
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = pydantic.Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    user: str | None = None
    metadata: dict[str, Any] | None = None
    # accepted, and changing nothing here
    store: bool | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    max_tool_calls: int | None = None
    # refused: they need responses stored on the server
    previous_response_id: str | None = None
    conversation: Union[str, dict[str, Any], None] = None
    prompt: dict[str, Any] | None = None
    background: bool | None = None
    # extensions, as on the chat route
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request this response is served as; InvalidRequestError names what
        cannot be served."""
        for name, why in _REFUSED.items():
            if getattr(self, name) is not None:
                raise invalid(f"{name}: {why}", name)
        if self.background:
            raise invalid("background: responses run in the foreground here", "background")
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": chat_messages(self.input, self.instructions),
            "stream": self.stream,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tools": chat_tools(self.tools),
            "tool_choice": chat_tool_choice(self.tool_choice),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": chat_format(self.text),
            "user": self.user,
        }
        if self.top_logprobs is not None:
            chat.update(logprobs=True, top_logprobs=self.top_logprobs)
        for name in ("seed", "top_k", "min_p", "repetition_penalty", "ignore_eos"):
            chat[name] = getattr(self, name)
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise errors.InvalidRequestError(f"invalid request: {where}: {first['msg']}") from None


def responses_names() -> ClientNames:
    """Error messages in the Responses API's field names."""
    renames = {
        "max_new_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
        "min_new_tokens": "min_tokens", "return_logprob": "top_logprobs", "input_ids": "input", "messages": "input",
        "response_format": "text.format",
    }
    return ClientNames(renames, frozenset(ResponsesRequest.model_fields))


# ---------------------------------------------------------------- request translation


def chat_messages(given: Union[str, list[dict[str, Any]]], instructions: str | None) -> list[dict[str, Any]]:
    """The chat messages of ``instructions`` and ``input``: each message item one message,
    consecutive function calls one assistant message's ``tool_calls`` (after its text, when
    the same turn wrote both), each call's output a tool message; reasoning items are
    dropped (chat templates drop past reasoning too)."""
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(given, str):
        return [*out, {"role": "user", "content": given}]
    if not given:
        raise invalid("input is empty", "input")
    for i, item in enumerate(given):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{where}.role must be user, system, developer or assistant, got {role!r}", "input")
            out.append({"role": role, "content": _text(where, item.get("content"))})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function",
                    "function": {"name": _field(item, "name", where), "arguments": item.get("arguments") or "{}"}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _field(item, "output", where)
            text = output if isinstance(output, str) else _text(f"{where}.output", output)
            out.append({"role": "tool", "tool_call_id": _field(item, "call_id", where), "content": text})
        elif kind != "reasoning":
            raise invalid(f"{where}.type {kind!r} is not served here (message, function_call, function_call_output and reasoning items are)", "input")
    return out


def _field(item: dict[str, Any], name: str, where: str) -> Any:
    if item.get(name) is None:
        raise invalid(f"{where}.{name} is required in a {item.get('type')} item", "input")
    return item[name]


def _text(where: str, content: Any) -> str:
    """A message's text: a string, or its text parts joined (a refusal part is text too)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of content parts", "input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append(part["refusal"])
        else:
            raise invalid(f"{where}.content[{j}]: content part {kind!r} is not supported: only text is", "input")
    return "".join(parts)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools (the Responses API's flat form) in the chat API's nested one."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise invalid(f"tools[{i}].type {tool.get('type')!r}: only function tools are served here", "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Union[str, dict[str, Any], None]) -> Union[str, dict[str, Any], None]:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid(f"tool_choice {choice!r}: none, auto, required or {{'type': 'function', 'name': ...}}", "tool_choice")


def chat_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as the chat API's ``response_format``."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": {"name": "response", **schema}}
    raise invalid(f"text.format.type must be text, json_object or json_schema, got {kind!r}", "text")
