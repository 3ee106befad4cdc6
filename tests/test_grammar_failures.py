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


@pytest.mark.usefixtures("llguidance")  # llguidance's lazy failure (xgrammar compiles a{1000000} and serves it)
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
        SamplingParams(json_schema="{" + " " * (2 << 20) + "}")
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


class PanicException(BaseException):
    """What a Rust panic inside llguidance arrives as (pyo3's ``pyo3_runtime.PanicException``,
    a BaseException, not an Exception)."""


PanicException.__module__ = "pyo3_runtime"


@pytest.mark.usefixtures("llguidance")  # the panic is raised in llguidance's regex compile
async def test_a_panic_in_the_grammar_library_fails_the_request_and_is_cached(monkeypatch):
    """No input known to make llguidance 1.9 panic was found (the hostile schemas, regexes and
    Lark grammars tried are refused with its errors), so the panic is raised at the library
    boundary: ``llguidance.grammar_from``, which compiles a regex. The request fails at once
    with a typed error, the failure is cached (the library is not asked again: no
    resubmission loop), and other grammars carry on."""
    import anyio
    import llguidance

    calls = []
    real = llguidance.grammar_from

    class Unforeseen(BaseException):
        pass

    def grammar_from(kind, text, *rest, **kw):
        if text == "panic+":
            calls.append(text)
            raise PanicException("called `Option::unwrap()` on a `None` value")
        if text == "other+":  # any other BaseException out of a compile: the gate still caches a failure
            calls.append(text)
            raise Unforeseen()
        return real(kind, text, *rest, **kw)

    monkeypatch.setattr(llguidance, "grammar_from", grammar_from)
    async with Engine.from_pretrained("tiny", loop="normal") as engine:
        with anyio.fail_after(60):  # a hang guard: the unfixed gate resubmits the compile for ever
            for stream in (False, True, False):
                with pytest.raises(errors.InvalidRequestError, match="invalid regex: the grammar library failed"):
                    sampling = SamplingParams(max_new_tokens=4, regex="panic+")
                    if stream:
                        async for _ in engine.stream(prompt="x", sampling=sampling):
                            pass
                    else:
                        await engine.generate(prompt="x", sampling=sampling)
            for _ in range(2):
                with pytest.raises(errors.InvalidRequestError, match="could not be compiled"):
                    await engine.generate(prompt="x", sampling=SamplingParams(max_new_tokens=4, regex="other+"))
            ok = await engine.generate(prompt="x", sampling=SamplingParams(max_new_tokens=3, regex="[ab]{3}"))
    assert calls == ["panic+", "other+"]
    assert ok.finish_reason == "stop" and len(ok.output_ids) == 3


def test_a_panic_while_compiling_is_cached_as_the_grammars_failure(monkeypatch):
    """GrammarCompiler.compile itself: the panic is this grammar's error, kept in the cache
    like any other; an interrupt (KeyboardInterrupt, SystemExit) is not swallowed."""
    import llguidance

    from omni_async.text.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    compiler = GrammarCompiler(tok, tok.vocab_size, backend="llguidance")  # (its regex compile panics here)
    try:
        def grammar_from(kind, text, *rest, **kw):
            raise PanicException("index out of bounds") if text == "p" else KeyboardInterrupt()

        monkeypatch.setattr(llguidance, "grammar_from", grammar_from)
        compiler.compile(("regex", "p"))
        assert compiler.cached(("regex", "p"))
        with pytest.raises(errors.InvalidRequestError, match="PanicException: index out of bounds"):
            compiler.matcher(("regex", "p"))
        with pytest.raises(KeyboardInterrupt):
            compiler.compile(("regex", "q"))
        assert not compiler.cached(("regex", "q"))
    finally:
        compiler.close()


def flat(n: int, **extra) -> dict:
    """An object of ``n`` string properties as OpenAI clients write them (strict: all required)."""
    props = {f"field_{i}": {"type": "string", "description": f"the {i}th field"} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False, **extra}


def nested(levels: int) -> dict:
    node: dict = {"type": "string"}
    for _ in range(levels):
        node = {"type": "object", "properties": {"inner": node}, "required": ["inner"]}
    return node


def test_openai_size_schemas_are_accepted_and_past_openais_limits_refused_with_the_reason():
    """OpenAI's documented limits for structured outputs: 5,000 object properties in all, 10
    levels of nesting. Schemas within them are accepted (with room for descriptions and
    the JSON around them); past them, the error says which limit and why."""
    for body in (flat(1_000), flat(5_000), nested(10), {"type": "object", "properties": {"a": flat(2_499), "b": flat(2_499)}}):
        assert SamplingParams(json_schema=body).grammar[0] == "json_schema"
    import json

    assert SamplingParams(json_schema=json.dumps(flat(5_000))).grammar[0] == "json_schema"
    with pytest.raises(errors.InvalidRequestError, match="more than 5,000 object properties.*OpenAI"):
        SamplingParams(json_schema={"type": "object", "properties": {"a": flat(2_499), "b": flat(2_500)}})  # 5,001
    with pytest.raises(errors.InvalidRequestError, match="nested.*OpenAI"):
        SamplingParams(json_schema=nested(40))


async def test_a_1000_property_schema_constrains_a_request():
    async with Engine.from_pretrained("tiny", loop="normal") as engine:
        out = await engine.generate(prompt="x", sampling=SamplingParams(max_new_tokens=40, json_schema=flat(1_000)))
    assert out.text.startswith('{"field_0": "') and out.finish_reason == "length"
