"""xgrammar behind the grammar gate (``OMNI_ASYNC_GRAMMAR_BACKEND=xgrammar``,
structured/xgrammar_backend.py): on a byte vocabulary its masks admit nothing llguidance
refuses, it stops and fails where llguidance does, and through the engine every output is
valid and accepted by llguidance's grammar, the loops agree token for token, EBNF rows
(llguidance's) share steps with its rows, and a bad grammar fails its request alone."""

from __future__ import annotations

import asyncio
import json
import random
import re

import numpy as np
import pytest

pytest.importorskip("llguidance")
pytest.importorskip("xgrammar")

from omni_async import Engine, SamplingParams, errors  # noqa: E402
from omni_async.structured.grammar import GrammarCompiler  # noqa: E402
from omni_async.text.tokenizer import ByteTokenizer  # noqa: E402

from .conftest import assert_kv_free  # noqa: E402
from .test_constrained import EBNF, EBNF_AS_REGEX, REGEX, SCHEMA, validate  # noqa: E402

ENV = "OMNI_ASYNC_GRAMMAR_BACKEND"
# The loops, four forwards a step, and jump-forward (xgrammar gives no forced runs: a position
# whose mask admits one token is the run, found from the mask).
CONFIGS = [{"loop": "normal"}, {"loop": "overlap"}, {"loop": "async_decode"}, {"loop": "normal", "decode_steps": 4},
           {"loop": "overlap", "jump_forward": True, "decode_steps": 4}]


def allowed(mask: np.ndarray, vocab: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab])


def mask_of(matcher, words: int) -> np.ndarray:
    buf = np.empty(words, dtype=np.int32)
    matcher.handle.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
    return buf


@pytest.mark.parametrize("key", [("json_schema", json.dumps(SCHEMA)), ("regex", REGEX)], ids=["schema", "regex"])
def test_masks_within_llguidances_and_stops_equal_along_random_walks(key):
    tok = ByteTokenizer()
    vocab, words = tok.vocab_size, (tok.vocab_size + 31) // 32
    xg = GrammarCompiler(tok, vocab, backend="xgrammar")
    ll = GrammarCompiler(tok, vocab, backend="llguidance")
    try:
        rng = random.Random(0)
        positions = same = 0
        for _ in range(12):
            a, b = xg.matcher(key), ll.matcher(key)
            assert type(a.handle).__name__ == "XGrammarHandle" and type(b.handle).__name__ == "LLMatcher"
            while True:
                ma, mb = allowed(mask_of(a, words), vocab), allowed(mask_of(b, words), vocab)
                # xgrammar admits nothing llguidance refuses (it may admit less: no escapes in
                # a string with a length bound), and never nothing.
                assert len(ma) and set(ma.tolist()) <= set(mb.tolist()), f"position {positions}"
                same += ma.tolist() == mb.tolist()
                positions += 1
                token = int(rng.choice(ma))
                ended_a, ended_b = a.accept(token, prefetch=False), b.accept(token, prefetch=False)
                assert ended_a == ended_b and a.complete == b.complete and a.failed is None and b.failed is None
                if ended_a:
                    break
        assert positions > 100 and same > 0.8 * positions
        # A token outside the mask fails the grammar, in both.
        a, b = xg.matcher(key), ll.matcher(key)
        assert a.accept(ord("}"), prefetch=False) and b.accept(ord("}"), prefetch=False)
        assert a.failed and b.failed
        assert xg.xgrammar_templates == 1 and ll.xgrammar_templates == 0
    finally:
        xg.close()
        ll.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_one_batch_call_fills_what_row_calls_fill(threads):
    """The mask worker's one xgrammar call a ticket (``xgrammar_backend.fill_masks``) against a
    call per row, rows in any order, a stopped matcher admitting nothing; on one thread or
    several (``batch_mask.XGRAMMAR_THREADS``)."""
    from omni_async.structured.xgrammar_backend import fill_masks

    tok = ByteTokenizer()
    words = (tok.vocab_size + 31) // 32
    xg = GrammarCompiler(tok, tok.vocab_size, backend="xgrammar")
    try:
        rng = random.Random(1)
        matchers = [xg.matcher(("regex", REGEX))] + [xg.matcher(("json_schema", json.dumps(SCHEMA))) for _ in range(5)]
        for j, m in enumerate(matchers):  # each to another position (the schema's objects are longer than 12 bytes)
            for _ in range(3 * j):
                m.accept(int(rng.choice(allowed(mask_of(m, words), tok.vocab_size))), prefetch=False)
        stopped = xg.matcher(("regex", "[0-9]{2}"))
        assert not stopped.accept(ord("4"), prefetch=False) and stopped.accept(ord("2"), prefetch=False) and stopped.complete
        handles = [m.handle for m in matchers + [stopped]]
        rows = [3, 0, 6, 1, 5, 2, 4]
        batch = np.full((7, words), -1, dtype=np.int32)
        fill_masks(handles, batch, rows, threads)
        for h, row in zip(handles, rows):
            one = np.empty(words, dtype=np.int32)
            h.unsafe_compute_mask_ptr(one.ctypes.data, one.nbytes)
            assert (batch[row] == one).all()
        assert not batch[4].any() and all(batch[r].any() for r in rows[:-1])
    finally:
        xg.close()


@pytest.mark.parametrize("schema", [SCHEMA, {"type": "object", "properties": {"s": {"type": "string"}}}], ids=["bounded", "unbounded"])
def test_a_json_string_takes_no_surrogate_as_llguidance_takes_none(schema):
    """0xED opens a three-byte character whose second byte is 0x80-0x9F in UTF-8; 0xA0-0xBF
    would encode a UTF-16 surrogate (U+D800-DFFF), which is not UTF-8 (xgrammar 0.2.9's
    negated classes admit it: on an H100, 3 of 320 outputs held one). Both libraries now
    admit exactly the continuation bytes UTF-8 allows there."""
    tok = ByteTokenizer()
    vocab, words = tok.vocab_size, (tok.vocab_size + 31) // 32
    key = ("json_schema", json.dumps(schema))
    prefix = '{"name": "a' if schema is SCHEMA else '{"s": "a'
    for backend in ("xgrammar", "llguidance"):
        compiler = GrammarCompiler(tok, vocab, backend=backend)
        try:
            m = compiler.matcher(key)
            for t in tok.encode(prefix, add_special_tokens=False) + [0xED]:  # (a byte's id is the byte)
                m.accept(t, prefetch=False)
            assert m.failed is None
            admitted = set(allowed(mask_of(m, words), vocab).tolist())
            assert admitted == set(range(0x80, 0xA0)), (backend, sorted(admitted))
        finally:
            compiler.close()


# Well-formed UTF-8 (the Unicode standard's table 3-7): each lead byte and the bytes allowed
# after it, one set per continuation position. Anything else (a lone continuation byte,
# C0/C1 overlong leads, F5-FF, an overlong or surrogate second byte, a code point past
# U+10FFFF) is not UTF-8.
CONT = frozenset(range(0x80, 0xC0))
UTF8_LEADS = {**{b: (CONT,) for b in range(0xC2, 0xE0)}, 0xE0: (frozenset(range(0xA0, 0xC0)), CONT),
              **{b: (CONT, CONT) for b in (*range(0xE1, 0xED), 0xEE, 0xEF)}, 0xED: (frozenset(range(0x80, 0xA0)), CONT),
              0xF0: (frozenset(range(0x90, 0xC0)), CONT, CONT), **{b: (CONT, CONT, CONT) for b in range(0xF1, 0xF4)},
              0xF4: (frozenset(range(0x80, 0x90)), CONT, CONT)}


@pytest.mark.parametrize("schema", [SCHEMA, {"type": "object", "properties": {"s": {"type": "string"}}}], ids=["bounded", "unbounded"])
def test_a_json_strings_bytes_follow_utf8s_table_in_both_libraries(schema):
    """Every byte a string character may start with, and after each lead byte every byte
    admitted at each continuation position (the smallest allowed byte taken to go on), is
    exactly what UTF-8 allows: a byte vocabulary can spell any byte sequence, so the
    grammar alone keeps outputs UTF-8 (xgrammar's classes once admitted surrogates: 3 of
    320 H100 outputs). The surrogate test above checks 0xED alone; this is the whole table."""
    tok = ByteTokenizer()
    vocab, words = tok.vocab_size, (tok.vocab_size + 31) // 32
    key = ("json_schema", json.dumps(schema))
    prefix = tok.encode('{"name": "a' if schema is SCHEMA else '{"s": "a', add_special_tokens=False)
    for backend in ("xgrammar", "llguidance"):
        compiler = GrammarCompiler(tok, vocab, backend=backend)
        try:
            def admitted_after(extra: list[int]) -> set[int]:
                m = compiler.matcher(key)
                for t in prefix + extra:  # (a byte's id is the byte)
                    m.accept(t, prefetch=False)
                assert m.failed is None, (backend, extra)
                return {t for t in allowed(mask_of(m, words), vocab).tolist() if t < 256}
            first = admitted_after([])
            assert {b for b in first if b >= 0x80} == set(UTF8_LEADS), backend
            assert not {b for b in first if b < 0x20 or b == 0x7F}, backend
            for lead, follows in UTF8_LEADS.items():
                seq = [lead]
                for allowed_here in follows:
                    assert admitted_after(seq) == set(allowed_here), (backend, [hex(b) for b in seq])
                    seq.append(min(allowed_here))
        finally:
            compiler.close()


@pytest.mark.parametrize("regex", ["a.b", "a[^x]b"])
def test_a_regexs_any_character_takes_no_surrogate(regex):
    """A regex's ``.`` and its negated classes, after a character's first byte 0xED: the
    continuation bytes UTF-8 allows there, under both libraries."""
    tok = ByteTokenizer()
    vocab, words = tok.vocab_size, (tok.vocab_size + 31) // 32
    for backend in ("xgrammar", "llguidance"):
        compiler = GrammarCompiler(tok, vocab, backend=backend)
        try:
            m = compiler.matcher(("regex", regex))
            for t in (ord("a"), 0xED):
                m.accept(t, prefetch=False)
            assert m.failed is None
            assert set(allowed(mask_of(m, words), vocab).tolist()) == set(range(0x80, 0xA0)), backend
        finally:
            compiler.close()


def test_what_xgrammar_does_not_take_stays_with_llguidance():
    tok = ByteTokenizer()
    xg = GrammarCompiler(tok, tok.vocab_size, backend="xgrammar")
    try:
        pattern = {"type": "object", "properties": {"p": {"type": "string", "pattern": "^[^x]+$"}}}  # (a surrogate's way in)
        for key in [("ebnf", EBNF), ("json_schema", json.dumps({**SCHEMA, "x-guidance": {"whitespace_flexible": False}})),
                    ("json_schema", json.dumps(pattern))]:
            assert type(xg.matcher(key).handle).__name__ == "LLMatcher"
        assert xg.xgrammar_templates == 0
        with pytest.raises(errors.InvalidRequestError):
            xg.matcher(("regex", "(("))
    finally:
        xg.close()


def requests() -> list[tuple[str, SamplingParams]]:
    out = [("json", SamplingParams(max_new_tokens=200, json_schema=SCHEMA))]
    out += [("json", SamplingParams(max_new_tokens=200, json_schema=SCHEMA, temperature=1.0, seed=s)) for s in range(6)]
    out += [("regex", SamplingParams(max_new_tokens=32, regex=REGEX, temperature=1.0, seed=s)) for s in range(3)]
    out += [("ebnf", SamplingParams(max_new_tokens=32, ebnf=EBNF, temperature=1.0, seed=s)) for s in range(2)]
    out += [("free", SamplingParams(max_new_tokens=24, temperature=1.0, seed=7, ignore_eos=True))]
    return out


async def outputs(config: dict, reqs) -> tuple[list, dict]:
    async with Engine.from_pretrained("tiny", device="cpu", **config) as engine:
        results = await asyncio.gather(*[engine.generate(prompt="Reply in JSON:", sampling=sp) for _, sp in reqs])
        info = engine.scheduler.info()
    assert_kv_free(engine)
    return results, info


async def test_engine_outputs_valid_and_identical_across_loops(monkeypatch):
    reqs = requests()
    monkeypatch.setenv(ENV, "xgrammar")
    tok = ByteTokenizer()
    replay = GrammarCompiler(tok, tok.vocab_size, backend="llguidance")
    reference = None
    for config in CONFIGS:
        results, info = await outputs(config, reqs)
        assert info["grammar_backend"] == "xgrammar"
        assert info["grammar_xgrammar_compiles"] == 2  # the schema and the regex; EBNF stays with llguidance
        assert (info["grammar_jumps"] > 0) == bool(config.get("jump_forward")), info["grammar_jumps"]
        for (kind, _), r in zip(reqs, results):
            if kind == "json":
                assert r.finish_reason == "stop", r.text
                validate(json.loads(r.text), SCHEMA)
            elif kind == "regex":
                assert r.finish_reason == "stop" and re.fullmatch(REGEX, r.text), r.text
            elif kind == "ebnf":
                assert r.finish_reason == "stop" and re.fullmatch(EBNF_AS_REGEX, r.text), r.text
            if kind in ("json", "regex"):  # llguidance's grammar takes every token xgrammar's admitted
                key = ("json_schema", json.dumps(SCHEMA)) if kind == "json" else ("regex", REGEX)
                m = replay.matcher(key)
                assert all(not m.accept(t, prefetch=False) for t in r.output_ids[:-1])
                assert m.accept(r.output_ids[-1], prefetch=False) and m.complete and m.failed is None
        reference = reference or results
        assert [r.output_ids for r in results] == [r.output_ids for r in reference], config
    replay.close()
    assert len({tuple(r.output_ids) for (k, _), r in zip(reqs, reference) if k == "json"}) > 3


@pytest.mark.parametrize("loop", ["normal", "overlap"])
async def test_bad_grammar_under_xgrammar_fails_its_request_alone(loop, monkeypatch):
    monkeypatch.setenv(ENV, "xgrammar")
    bad = [SamplingParams(max_new_tokens=8, json_schema={"type": "strnig"}), SamplingParams(max_new_tokens=8, regex="((")]
    good = [SamplingParams(max_new_tokens=32, regex=REGEX, temperature=1.0, seed=1),
            SamplingParams(max_new_tokens=16, temperature=1.0, seed=3, ignore_eos=True)]
    async with Engine.from_pretrained("tiny", device="cpu", loop=loop) as engine:
        alone = await asyncio.gather(*[engine.generate(prompt="x", sampling=sp) for sp in good])
        mixed = await asyncio.gather(*[engine.generate(prompt="x", sampling=sp) for sp in bad + good], return_exceptions=True)
    assert_kv_free(engine)
    for result in mixed[:len(bad)]:
        assert isinstance(result, errors.InvalidRequestError), result
    assert [r.output_ids for r in mixed[len(bad):]] == [r.output_ids for r in alone]
    assert re.fullmatch(REGEX, mixed[len(bad)].text)


async def test_rows_sampling_first_are_checked_by_xgrammar(monkeypatch):
    """``optimistic_grammar`` (CUDA's default): rows sample first and xgrammar's matcher takes
    the tokens it admits (``try_consume_tokens``), refusing the rest; outputs stay valid."""
    monkeypatch.setenv(ENV, "xgrammar")
    reqs = [SamplingParams(max_new_tokens=200, json_schema=SCHEMA, temperature=0.0 if i % 2 else 1.0, seed=i)
            for i in range(6)]
    reqs += [SamplingParams(max_new_tokens=32, regex=REGEX, temperature=1.0, seed=i) for i in range(3)]
    async with Engine.from_pretrained("tiny", device="cpu", loop="overlap", optimistic_grammar=True, decode_steps=4) as engine:
        results = await asyncio.gather(*[engine.generate(prompt="Reply:", sampling=sp) for sp in reqs])
        info = engine.scheduler.info()
    assert_kv_free(engine)
    assert info["grammar_xgrammar_compiles"] == 2
    assert info["grammar_optimistic_tokens"] > 0 and info["grammar_optimistic_refused"] > 0
    for sp, r in zip(reqs, results):
        assert r.finish_reason == "stop", r.text
        if sp.json_schema is not None:
            validate(json.loads(r.text), SCHEMA)
        else:
            assert re.fullmatch(REGEX, r.text), r.text
