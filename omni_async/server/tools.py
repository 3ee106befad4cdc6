"""Tool calling: OpenAI ``tools`` / ``tool_choice`` in, Hermes/Qwen tool calls out.

The tools go to the chat template (which must read ``tools``); the model answers a call
as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (the format of the
Hermes and Qwen templates). ``tool_choice="required"`` or a named function is enforced
with a grammar over such blocks (the engine's constrained decoding), so even a model that
would not call a tool produces a well-formed call whose arguments follow the function's
``parameters`` schema; ``auto`` leaves the model free and
parses what it wrote; ``none`` parses nothing.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Union

from pydantic import BaseModel, ConfigDict

from .. import errors

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


@dataclass
class ToolPlan:
    """What one chat request does with tools: the template's ``tools``, whether to parse
    calls from the output, and the grammar that forces calls (None: the model is free)."""

    tools: list[dict[str, Any]] | None = None
    parse: bool = False
    parallel: bool = True
    ebnf: str | None = None
    names: list[str] = field(default_factory=list)


def plan_tools(tools: list[ToolDefinition] | None, choice: ToolChoice | None, parallel: bool | None, template_reads: frozenset[str]) -> ToolPlan:
    """Check the request's tool fields against each other and the template."""
    if not tools:
        if choice not in (None, "none"):
            raise errors.InvalidRequestError("tool_choice needs tools")
        return ToolPlan()
    if "tools" not in template_reads:
        raise errors.InvalidRequestError("tools: this model's chat template does not take tools")
    names = [t.function.name for t in tools]
    for name in names:
        if not _NAME.match(name):
            raise errors.InvalidRequestError(f"tools: function name {name!r} must be 1 to 64 letters, digits, '_' or '-'")
    if len(set(names)) != len(names):
        raise errors.InvalidRequestError("tools: function names must be unique")
    defs = [t.model_dump(exclude_none=True) for t in tools]
    parallel = True if parallel is None else parallel
    choice = choice or "auto"
    if choice == "none":
        return ToolPlan(tools=defs, names=names)
    if choice == "auto":
        return ToolPlan(tools=defs, parse=True, parallel=parallel, names=names)
    if choice == "required":
        return ToolPlan(tools=defs, parse=True, parallel=parallel, ebnf=calls_grammar(defs, several=parallel), names=names)
    if choice.function.name not in names:
        raise errors.InvalidRequestError(f"tool_choice: no tool named {choice.function.name!r} in tools")
    named = [d for d in defs if d["function"]["name"] == choice.function.name]
    return ToolPlan(tools=defs, parse=True, parallel=False, ebnf=calls_grammar(named, several=False), names=names)


# ---------------------------------------------------------------- the grammar

# Arguments come out as ``json.dumps`` writes them (", " and ": ", no other whitespace):
# a model cannot wander in blanks, and the call reads like the template's own.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def calls_grammar(tools: list[dict[str, Any]], *, several: bool) -> str:
    """The grammar (the engine's ``ebnf``: llguidance's Lark) of one ``<tool_call>`` block,
    or with ``several`` of one or more, each naming one of ``tools`` with arguments that
    follow that function's ``parameters`` schema (any JSON object when it has none)."""
    lines = ['start: call ("\\n" call)*' if several else "start: call"]
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    for i, tool in enumerate(tools):
        fn = tool["function"]
        head = OPEN + '\n{"name": ' + json.dumps(fn["name"]) + ', "arguments": '
        lines.append(f"call_{i}: {json.dumps(head)} args_{i} {json.dumps('}' + chr(10) + CLOSE)}")
        schema = {**(fn.get("parameters") or {"type": "object"}), "x-guidance": _JSON_LAYOUT}
        lines.append(f"args_{i}: %json {json.dumps(schema)}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- parsing


@dataclass
class ParsedCall:
    name: str
    arguments: str  # a JSON string, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def parse_block(body: str, names: list[str]) -> ParsedCall | None:
    """One block's JSON, or None when it is not a call of a known tool. Any failure to
    read the block (malformed, nested past the parser's recursion limit, a non-JSON number
    such as NaN) leaves it as text: what comes out as arguments is always strict JSON."""
    try:
        obj = _strict_json(body)
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            args = _strict_json(args)
        if not isinstance(args, dict):
            return None
        return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False, allow_nan=False))
    except (ValueError, RecursionError, MemoryError):
        return None


def _strict_json(text: str) -> Any:
    """``json.loads`` without Python's extensions: NaN, Infinity and numbers that
    overflow a float are refused (ValueError), as JSON has none of them."""
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows a float")
    return value


def parse_calls(text: str, plan: ToolPlan) -> tuple[str, list[ParsedCall]]:
    """(content, calls) of a whole output. Blocks that parse are taken out of the text;
    what is left (stripped) is the content. Without ``parallel`` only the first call counts."""
    calls: list[ParsedCall] = []
    kept: list[str] = []
    at = 0
    for start, end in _blocks(text):
        call = parse_block(text[start + len(OPEN) : end], plan.names)
        if call is None or (calls and not plan.parallel):
            continue
        kept.append(text[at:start])
        at = end + len(CLOSE)
        calls.append(call)
    kept.append(text[at:])
    return "".join(kept).strip(), calls


def _blocks(text: str) -> Iterator[tuple[int, int]]:
    """(start of ``<tool_call>``, start of its ``</tool_call>``) of each block, left to right:
    a block runs from an opening tag to the first closing tag after it, and the next one is
    looked for after that. One pass over the text: a search from every opening tag to the
    end (a lazy regex's way, when no tag closes) is quadratic in a model's answer, on the
    event loop."""
    at = 0
    while True:
        start = text.find(OPEN, at)
        if start < 0:
            return
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:  # no closing tag after this one: none after a later one either
            return
        yield start, end
        at = end + len(CLOSE)


class StreamParser:
    """Splits a streamed output into content and whole tool calls: text is passed on
    until a ``<tool_call>`` opens (a possible start of one is held back), a block is
    held until it closes, then given as a call (or, if it does not parse, as text)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.buffer = ""
        self.calls = 0
        self._searched = 0  # the held block (buffer[0] opens it) has no closing tag before this

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self.buffer += text
        content: list[str] = []
        calls: list[ParsedCall] = []
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = _open_prefix(self.buffer)
                content.append(self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            content.append(self.buffer[:start])
            # A held block is searched for its closing tag from where the last search ended
            # (less the tag's length, which may straddle two deltas), not from its start:
            # a long unclosed block costs each delta its own length, not the block's.
            end = self.buffer.find(CLOSE, max(start + len(OPEN), self._searched))
            if end < 0:
                self.buffer = self.buffer[start:]
                self._searched = max(len(OPEN), len(self.buffer) - len(CLOSE) + 1)
                break
            self._searched = 0
            call = parse_block(self.buffer[start + len(OPEN) : end], self.plan.names)
            if call is None or (self.calls and not self.plan.parallel):
                content.append(self.buffer[start : end + len(CLOSE)])  # text, as parse_calls leaves it
            else:
                calls.append(call)
                self.calls += 1
            self.buffer = self.buffer[end + len(CLOSE) :]
        return "".join(content), calls

    def flush(self) -> str:
        """What is held at the end (an unclosed block stays text)."""
        rest, self.buffer = self.buffer, ""
        return rest


def _open_prefix(text: str) -> int:
    """Length of the longest tail of ``text`` that begins ``<tool_call>``."""
    return tag_prefix(text, OPEN)


def tag_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that begins ``tag`` (shorter than the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
