"""Tool-call blocks a model (or a hostile prompt) can write: nesting deep enough to exhaust
the parser's recursion, non-JSON numbers (NaN, Infinity), calls past the first when
``parallel_tool_calls`` is false. A block that does not parse stays content, arguments are
always strict JSON, and the whole-text and streamed parsers give the same split."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

from omni_async.server.tools import StreamParser, ToolPlan, parse_calls  # noqa: E402

PLAN = ToolPlan(parse=True, names=["f", "g"])
SINGLE = ToolPlan(parse=True, names=["f", "g"], parallel=False)


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def strict(text: str) -> object:
    def refuse(name: str) -> object:
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def streamed(text: str, plan: ToolPlan, size: int) -> tuple[str, list]:
    parser, said, got = StreamParser(plan), "", []
    for at in range(0, len(text), size):
        piece, new = parser.feed(text[at : at + size])
        said, got = said + piece, got + new
    return (said + parser.flush()).strip(), got


HOSTILE = [
    '{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}",
    '{"name": "f", "arguments": {"x": ' + '{"a": ' * 50_000 + "1" + "}" * 50_000 + "}}",
    '{"name": "f", "arguments": {"x": NaN}}',
    '{"name": "f", "arguments": {"x": -Infinity}}',
    '{"name": "f", "arguments": "{\\"x\\": Infinity}"}',
    '{"name": "f", "arguments": "' + "[" * 100_000 + '"}',
]


@pytest.mark.parametrize("body", HOSTILE, ids=["deep-list", "deep-object", "nan", "infinity", "nan-in-string", "deep-string"])
def test_a_block_that_does_not_parse_stays_content(body):
    text = "before " + block(body) + " after " + block('{"name": "g", "arguments": {"ok": 1.5}}')
    content, calls = parse_calls(text, PLAN)
    assert [c.name for c in calls] == ["g"] and strict(calls[0].arguments) == {"ok": 1.5}
    assert content == "before " + block(body) + " after"
    for size in (7, 4096, len(text)):
        said, got = streamed(text, PLAN, size)
        assert said == content and [(c.name, c.arguments) for c in got] == [(c.name, c.arguments) for c in calls]


def test_arguments_are_always_strict_json():
    for args in ['{"x": 1e400}', '{"x": [1, 2.5, "s", null, true]}', '"{\\"y\\": 2}"']:
        _, calls = parse_calls(block('{"name": "f", "arguments": ' + args + "}"), PLAN)
        for call in calls:
            strict(call.arguments)


def test_without_parallel_calls_a_second_call_is_content_whole_and_streamed():
    text = "a " + block('{"name": "f", "arguments": {}}') + " b " + block('{"name": "g", "arguments": {"y": 1}}') + " c"
    content, calls = parse_calls(text, SINGLE)
    assert [c.name for c in calls] == ["f"]
    assert content == "a  b " + block('{"name": "g", "arguments": {"y": 1}}') + " c"
    for size in (1, 5, len(text)):
        said, got = streamed(text, SINGLE, size)
        assert said == content and [c.name for c in got] == ["f"]


def test_unclosed_tags_stay_content_whole_and_streamed():
    """88,000 characters of opening tags that never close (and one closed block after them,
    which swallows them all and does not parse) stay content, split the same way whole and
    streamed in deltas of any size, including a closing tag cut across deltas. How long the
    split takes on the loop is tools/loop_stalls.py --scenarios tool_tags's business."""
    tags = "<tool_call>" * 8000
    ok = block('{"name": "f", "arguments": {"a": 1}}')
    # (text, its content): a block runs from an opening tag to the first closing tag after
    # it, so a closed block after the tags holds them all and does not parse
    cases = [(tags, tags), (tags + ok, tags + ok), (ok + tags, tags), ("x " + ok + tags + " y " + ok, "x " + tags + " y " + ok)]
    for text, expected in cases:
        content, calls = parse_calls(text, PLAN)
        assert content == expected and [c.name for c in calls] == ["f"] * (text.startswith(ok) or text.startswith("x "))
        for size in (1, 5, 11, 12, 13, 4096):
            said, got = streamed(text, PLAN, size)
            assert said == content and [(c.name, c.arguments) for c in got] == [(c.name, c.arguments) for c in calls]
