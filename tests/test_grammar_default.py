"""Which grammar library a request gets (``structured/xgrammar_backend.chosen``, issue 61):
xgrammar by default where it imports (its host time a constrained token is ~40% of
llguidance's), with a Lark grammar still going to llguidance in the same engine; llguidance
where xgrammar is missing or its import fails (simulated: no network); the environment's
``llguidance`` / ``xgrammar`` decide, ``GrammarCompiler(backend=)`` wins over it, and any
other name is a ConfigError when the engine is built."""

from __future__ import annotations

import asyncio
import json
import re
import sys

import pytest

pytest.importorskip("llguidance")

from omni_async import Engine, SamplingParams, errors  # noqa: E402
from omni_async.structured import xgrammar_backend  # noqa: E402
from omni_async.structured.grammar import GrammarCompiler  # noqa: E402
from omni_async.text.tokenizer import ByteTokenizer  # noqa: E402

from .conftest import assert_kv_free  # noqa: E402
from .test_constrained import REGEX, SCHEMA, validate  # noqa: E402

ENV = xgrammar_backend.BACKEND_ENV
# A Lark grammar (llguidance's own syntax: xgrammar takes GBNF only).
LARK = 'start: "answer: " ("yes" | "no" | DIGIT DIGIT?) "."\nDIGIT: /[0-9]/'
LARK_AS_REGEX = r"answer: (yes|no|[0-9][0-9]?)\."


def requests() -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=200, json_schema=SCHEMA, temperature=1.0, seed=s) for s in range(3)] + [
        SamplingParams(max_new_tokens=32, regex=REGEX, temperature=1.0, seed=5),
        SamplingParams(max_new_tokens=32, ebnf=LARK, temperature=1.0, seed=6)]


async def run_engine() -> tuple[list, dict]:
    """``requests()`` through one engine: every output valid under its grammar."""
    async with Engine.from_pretrained("tiny", device="cpu", loop="overlap") as engine:
        results = await asyncio.gather(*[engine.generate(prompt="Reply:", sampling=sp) for sp in requests()])
        info = engine.scheduler.info()
    assert_kv_free(engine)
    for r in results[:3]:
        assert r.finish_reason == "stop", r.text
        validate(json.loads(r.text), SCHEMA)
    assert results[3].finish_reason == "stop" and re.fullmatch(REGEX, results[3].text), results[3].text
    assert results[4].finish_reason == "stop" and re.fullmatch(LARK_AS_REGEX, results[4].text), results[4].text
    return results, info


@pytest.fixture
def fresh_checks():
    """The import checks are asked once a process: cleared around a test that fakes them."""
    xgrammar_backend.installed.cache_clear()
    xgrammar_backend.loaded.cache_clear()
    yield
    xgrammar_backend.installed.cache_clear()
    xgrammar_backend.loaded.cache_clear()


async def test_the_default_is_xgrammar_and_a_lark_grammar_still_goes_to_llguidance(monkeypatch):
    """Unset (or empty), a JSON schema and a regex compile with xgrammar, the Lark grammar
    with llguidance, in the same engine."""
    pytest.importorskip("xgrammar")
    for unset in (None, " "):
        if unset is None:
            monkeypatch.delenv(ENV, raising=False)
        else:
            monkeypatch.setenv(ENV, unset)
        assert xgrammar_backend.chosen() == "xgrammar"
    _, info = await run_engine()
    assert info["grammar_backend"] == "xgrammar"
    assert info["grammar_compiles"] == 3 and info["grammar_xgrammar_compiles"] == 2  # the schema and the regex


@pytest.mark.usefixtures("llguidance")
async def test_llguidance_asked_for_takes_every_grammar():
    _, info = await run_engine()
    assert info["grammar_backend"] == "llguidance"
    assert info["grammar_compiles"] == 3 and info["grammar_xgrammar_compiles"] == 0


async def test_without_xgrammar_the_default_is_llguidance(fresh_checks, monkeypatch):
    """xgrammar not importable (``sys.modules`` holding None for it: ``find_spec`` finds
    nothing and an import fails): the default is llguidance, the engine serves every grammar."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    assert xgrammar_backend.chosen() == "llguidance" and not xgrammar_backend.installed()
    _, info = await run_engine()
    assert info["grammar_backend"] == "llguidance" and info["grammar_xgrammar_compiles"] == 0


def test_an_xgrammar_found_that_fails_to_import_leaves_every_grammar_to_llguidance(fresh_checks, monkeypatch):
    """Found by ``find_spec`` but its import raising (a broken wheel): no error reaches the
    request; llguidance compiles the schema and every grammar after it, and says so."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(xgrammar_backend, "installed", lambda: True)
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    tok = ByteTokenizer()
    compiler = GrammarCompiler(tok, tok.vocab_size)
    try:
        assert compiler.backend == "xgrammar"
        m = compiler.matcher(("json_schema", json.dumps(SCHEMA)))
        assert type(m.handle).__name__ == "LLMatcher" and m.failed is None
        assert compiler.backend == "llguidance" and compiler.xgrammar_templates == 0
        assert type(compiler.matcher(("regex", REGEX)).handle).__name__ == "LLMatcher"
    finally:
        compiler.close()


def test_the_compilers_option_wins_over_the_environment(monkeypatch):
    pytest.importorskip("xgrammar")
    tok = ByteTokenizer()
    monkeypatch.setenv(ENV, "llguidance")
    assert xgrammar_backend.chosen() == "llguidance" and xgrammar_backend.chosen("xgrammar") == "xgrammar"
    monkeypatch.setenv(ENV, "XGrammar")  # any case
    assert xgrammar_backend.chosen() == "xgrammar" and xgrammar_backend.chosen("llguidance") == "llguidance"
    compiler = GrammarCompiler(tok, tok.vocab_size, backend="llguidance")
    try:
        assert type(compiler.matcher(("json_schema", json.dumps(SCHEMA))).handle).__name__ == "LLMatcher"
    finally:
        compiler.close()


async def test_an_unknown_name_is_a_config_error_at_the_engines_build(monkeypatch):
    """A misspelt library would otherwise pick one quietly (before: llguidance for any name)."""
    tok = ByteTokenizer()
    with pytest.raises(errors.ConfigError, match="GrammarCompiler"):
        GrammarCompiler(tok, tok.vocab_size, backend="outlines")
    monkeypatch.setenv(ENV, "xgrammer")
    with pytest.raises(errors.ConfigError, match=f"{ENV} must be one of llguidance, xgrammar"):
        GrammarCompiler(tok, tok.vocab_size)
    with pytest.raises(errors.ConfigError, match="xgrammer"):
        async with Engine.from_pretrained("tiny", device="cpu"):
            pass
