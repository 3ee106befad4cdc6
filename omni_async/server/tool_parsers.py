"""Tool calls in the formats models write them, and tools for templates that take none.

Three formats, chosen by ``--tool-call-parser`` (``auto``: from the chat template):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes,
  Qwen; :mod:`omni_async.server.tools`). Also what a template without ``tools`` support is
  taught by :func:`hermes_system_message`, and what a forced call's grammar writes.
- ``llama3_json``: Llama 3.x's JSON calls, ``{"name": ..., "parameters": {...}}``, optionally
  after ``<|python_tag|>``, several separated by ``;``. The whole output is the call.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, after any words
  (the content, as vLLM answers: "Sure, let me check.[TOOL_CALLS][...]").

A streamed Llama 3 output is passed on as text unless it starts like a call (``{`` or
``<|python_tag|>``); a streamed Mistral output is passed on up to ``[TOOL_CALLS]`` (a tail
that may be the tag's start is held back). From there on it is held and parsed when the
output ends, so the streamed answer says what the whole one says.
"""

from __future__ import annotations

import json
from typing import Any

from .. import errors
from .tools import ParsedCall, StreamParser, ToolPlan, parse_block, parse_calls, tag_prefix

PARSERS = ("auto", "hermes", "llama3_json", "mistral")
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"


def parser_for_template(choice: str, template: str) -> str:
    """The parser ``choice`` names; for ``auto``, the format the template teaches."""
    if choice not in PARSERS:
        raise errors.ConfigError(f"--tool-call-parser must be one of {', '.join(PARSERS)}, got {choice!r}")
    if choice != "auto":
        return choice
    if "<tool_call>" in template:
        return "hermes"
    if MISTRAL_TAG in template:
        return "mistral"
    if PYTHON_TAG in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def hermes_system_message(tools: list[dict[str, Any]]) -> str:
    """The Hermes tool prompt, for a template that does not read ``tools``."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def with_tools_message(messages: list[Any], tools: list[dict[str, Any]], make: Any) -> list[Any]:
    """``messages`` (TrackedMessage) with the Hermes tool prompt added to the system
    message (a new one first when there is none). ``make`` builds a message from a dict."""
    prompt = hermes_system_message(tools)
    if messages and dict.get(messages[0], "role") == "system":
        fields = messages[0].fields()
        fields["content"] = f"{fields.get('content') or ''}\n\n{prompt}".lstrip()
        return [messages[0].derived(fields), *messages[1:]]
    return [make({"role": "system", "content": prompt}), *messages]


# ---------------------------------------------------------------- whole outputs


def parse_output(text: str, plan: ToolPlan, fmt: str) -> tuple[str, list[ParsedCall]]:
    """(content, calls) of a whole output in format ``fmt``."""
    if fmt == "hermes" or plan.ebnf is not None:  # a forced call is written in Hermes blocks
        return parse_calls(text, plan)
    if fmt == "mistral":
        return _mistral_output(text, plan)
    stripped = text.strip()
    body = _llama3_body(stripped)
    if body is None:
        return text, []
    calls = _json_calls(body, plan, fmt)
    if not calls:
        return text, []
    return "", calls if plan.parallel else calls[:1]


def _mistral_output(text: str, plan: ToolPlan) -> tuple[str, list[ParsedCall]]:
    """The words before the first ``[TOOL_CALLS]`` as content (unstripped: what a stream
    passes on before the tag) and the list after it as calls; the whole text as content
    unless the list is all calls of known tools."""
    at = text.find(MISTRAL_TAG)
    if at < 0:
        return text, []
    calls = _json_calls(text[at + len(MISTRAL_TAG) :].strip(), plan, "mistral")
    if not calls:
        return text, []
    return text[:at], calls if plan.parallel else calls[:1]


def _llama3_body(text: str) -> str | None:
    if text.startswith(PYTHON_TAG):
        return text[len(PYTHON_TAG) :].strip()
    return text if text.startswith("{") else None


def _json_calls(body: str, plan: ToolPlan, fmt: str) -> list[ParsedCall]:
    """The calls in a Mistral list or in ``;``-separated Llama 3 objects; [] unless every
    part is a call of a known tool."""
    try:
        if fmt == "mistral":
            items = json.loads(body)
            items = items if isinstance(items, list) else [items]
        else:
            decoder = json.JSONDecoder()
            items, at = [], 0
            while at < len(body):
                obj, end = decoder.raw_decode(body, at)
                items.append(obj)
                at = end
                while at < len(body) and body[at] in " \n\t;":
                    at += 1
    except (ValueError, RecursionError):
        return []
    calls = [parse_block(json.dumps(item), plan.names) if isinstance(item, dict) else None for item in items]
    return [c for c in calls if c is not None] if all(calls) else []


# ---------------------------------------------------------------- streams


class ToolStream:
    """One streamed choice's tool parsing in any format: ``feed`` returns (content, calls)
    ready now, ``finish`` what is left at the end."""

    def __init__(self, plan: ToolPlan, fmt: str) -> None:
        self.plan = plan
        self.fmt = "hermes" if plan.ebnf is not None else fmt
        self.hermes = StreamParser(plan) if self.fmt == "hermes" else None
        self.held = ""
        self.holding: bool | None = None  # undecided until the first non-blank text
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        if self.hermes is not None:
            content, calls = self.hermes.feed(text)
            self.calls = self.hermes.calls
            return content, calls
        if self.fmt == "mistral":
            return self._feed_mistral(text), []
        if self.holding is False:
            return text, []
        self.held += text
        start = self.held.lstrip()
        if not start:
            return "", []
        if any(start.startswith(t) or t.startswith(start) for t in (PYTHON_TAG, "{")):
            self.holding = True
            return "", []
        self.holding = False
        out, self.held = self.held, ""
        return out, []

    def _feed_mistral(self, text: str) -> str:
        """The content ready now: everything before ``[TOOL_CALLS]``; from the tag on, the
        text is held for :meth:`finish` (and so is a tail that may begin the tag)."""
        if self.holding:
            self.held += text
            return ""
        self.held += text
        at = self.held.find(MISTRAL_TAG)
        if at >= 0:
            self.holding = True
            out, self.held = self.held[:at], self.held[at:]
            return out
        keep = tag_prefix(self.held, MISTRAL_TAG)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return out

    def finish(self) -> tuple[str, list[ParsedCall]]:
        if self.hermes is not None:
            return self.hermes.flush(), []
        held, self.held = self.held, ""
        if not held:
            return "", []
        content, calls = parse_output(held, self.plan, self.fmt)
        self.calls += len(calls)
        return content, calls
