"""Grammars that fail after they were accepted: llguidance compiles lazily, so a regex such
as ``a{1000000}`` passes validation and fails when the first mask is computed. Such a
grammar is refused before the first token (an InvalidRequestError), every time (the failure
is what the cache keeps), and a grammar that fails later ends its request with a typed
error, never as a clean "stop". The schema text is serialised once per SamplingParams, and
an oversize schema is refused before any compile."""

from __future__ import annotations

import pytest

pytest.importorskip("llguidance")

from omni_async import Engine, SamplingParams, errors  # noqa: E402
from omni_async.structured.grammar import GrammarCompiler  # noqa: E402

LAZY_FAILURE = "a{1000000}"


@pytest.mark.parametrize("loop", ["normal", "async_decode"])
async def test_a_grammar_that_fails_lazily_is_an_invalid_request_each_time(loop):
    async with Engine.from_pretrained("tiny", loop=loop) as engine:
        for stream in (False, True, False):  # then refused at admission: the cache holds the failure
            with pytest.raises(errors.InvalidRequestError, match="too many expressions") as info:
                sampling = SamplingParams(max_new_tokens=8, regex=LAZY_FAILURE)
                if stream:
                    async for delta in engine.stream(prompt="x", sampling=sampling):
                        assert not delta.token_ids, "no token of a failed grammar is streamed"
                else:
                    await engine.generate(prompt="x", sampling=sampling)
        assert str(info.value).startswith("invalid regex")
        ok = await engine.generate(prompt="x", sampling=SamplingParams(max_new_tokens=3, regex="[ab]{3}"))
        assert ok.finish_reason == "stop" and len(ok.output_ids) == 3


def test_a_failed_matcher_is_reported_not_taken_as_complete():
    """The matcher's own view: once the library reports an error, ``failed`` names it and
    accepting a token says the grammar ended (the stage turns that into an error)."""
    from omni_async.structured.grammar import GrammarMatcher

    class Broken:
        def consume_token(self, token):
            return False

        def is_stopped(self):
            return True

        def is_error(self):
            return True

        def get_error(self):
            return "too many expressions"

    m = GrammarMatcher(Broken())
    assert m.accept(5) and m.failed == "too many expressions"


def test_an_oversize_schema_is_refused_before_any_serialisation(monkeypatch):
    import json

    from omni_async import sampling_controls

    calls = []
    real = json.dumps
    monkeypatch.setattr(sampling_controls.json, "dumps", lambda *a, **k: calls.append(1) or real(*a, **k))
    huge = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(100_000)}}
    with pytest.raises(errors.InvalidRequestError, match="too large"):
        SamplingParams(json_schema=huge)
    with pytest.raises(errors.InvalidRequestError, match="too large"):
        SamplingParams(json_schema="{" + " " * 200_000 + "}")
    deep: dict = {}
    node = deep
    for _ in range(100_000):  # nested past the recursion limit: counted, not overflowed
        node["items"] = {}
        node = node["items"]
    with pytest.raises(errors.InvalidRequestError, match="too large"):
        SamplingParams(json_schema=deep)
    assert calls == []


def test_the_schema_is_serialised_once(monkeypatch):
    import json

    from omni_async import sampling_controls

    calls = []
    real = json.dumps
    monkeypatch.setattr(sampling_controls.json, "dumps", lambda *a, **k: calls.append(1) or real(*a, **k))
    sp = SamplingParams(json_schema={"type": "object", "properties": {"a": {"type": "integer"}}})
    keys = {sp.grammar for _ in range(5)}
    assert keys == {("json_schema", '{"type":"object","properties":{"a":{"type":"integer"}}}')} and len(calls) == 1
    sp.json_schema = {"type": "object"}  # assigned after validation: serialised again, once
    assert sp.grammar == ("json_schema", '{"type":"object"}') and sp.grammar == ("json_schema", '{"type":"object"}')
    assert len(calls) == 2
