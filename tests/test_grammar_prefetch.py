"""Grammar masks computed ahead on the mask worker (``structured.prefetch``): the mask a
step takes from the worker equals the one computed on the spot at every position, a
matcher accepting a token queues its next mask, forced positions are counted, and in an
engine every constrained row's mask came from the worker, not the launching thread.
Forced runs and the pool are llguidance's: those tests pin it (xgrammar, the default where
installed, gives no forced runs; its worker calls: tests/test_xgrammar_backend.py)."""

# These tests are about rows that sample under their masks: optimistic_grammar=False keeps every
# constrained row there (rows that sample first: tests/test_optimistic_grammar.py).

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

pytest.importorskip("llguidance")

from omni_async import Engine, SamplingParams  # noqa: E402
from omni_async.structured import prefetch  # noqa: E402
from omni_async.structured.grammar import GrammarCompiler, GrammarMatcher, prefetch_all  # noqa: E402
from omni_async.text.tokenizer import ByteTokenizer  # noqa: E402

REGEX = r"[a-c]{2}-x[0-9]"


def inline_mask(matcher: GrammarMatcher, words: int) -> np.ndarray:
    out = np.empty(words, dtype=np.int32)
    matcher.handle.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
    return out


def test_worker_masks_equal_masks_computed_on_the_spot():
    tok = ByteTokenizer()
    compiler = GrammarCompiler(tok, tok.vocab_size, backend="llguidance")
    words = (tok.vocab_size + 31) // 32
    try:
        ahead = compiler.matcher(("regex", REGEX))
        here = GrammarMatcher(ahead.handle.deep_copy())  # no worker: computed on the spot
        assert here.next_mask() is None
        for i, ch in enumerate(b"ab-x7"):
            got = ahead.next_mask()
            assert got is not None, f"position {i} was not computed ahead"
            assert np.array_equal(got, inline_mask(here, words)), f"position {i}"
            ended = ahead.accept(ch)
            assert here.accept(ch) == ended
        assert ended and ahead.complete
        stats = compiler.masks.stats()
        # '-' and 'x' are the grammar's alone: the worker found them as one forced run at '-',
        # so the mask at 'x' was known without it (4 rows computed for 5 positions).
        assert stats["grammar_mask_prefetched_rows"] == 4
        assert stats["grammar_forced_masks"] == 2
        assert stats["grammar_forced_from_runs"] == 1
    finally:
        compiler.close()


def test_a_closed_worker_leaves_masks_to_the_fill():
    tok = ByteTokenizer()
    compiler = GrammarCompiler(tok, tok.vocab_size)
    compiler.close()
    m = compiler.matcher(("regex", REGEX))
    assert m.next_mask() is None
    assert not m.accept(ord("a")) and m.next_mask() is None


@pytest.mark.usefixtures("llguidance")  # forced runs found by llguidance's compute_ff_tokens
@pytest.mark.parametrize("loop", ["normal", "async_decode"])
async def test_engine_masks_come_from_the_worker(loop):
    constrained = [SamplingParams(max_new_tokens=16, regex=REGEX, temperature=1.0, seed=s) for s in range(4)]
    free = [SamplingParams(max_new_tokens=12, ignore_eos=True) for _ in range(4)]
    async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu", loop=loop) as engine:
        results = await asyncio.gather(*[engine.generate(prompt="id:", sampling=sp) for sp in constrained + free])
        info = engine.scheduler.info()
    for r in results[:4]:
        assert r.finish_reason == "stop" and re.fullmatch(REGEX, r.text), r.text
    # Every position is masked, or forced and skipped by a jump-forward (no mask fill).
    assert info["grammar_mask_rows"] + info["grammar_forced_skipped"] >= 4 * 5
    assert info["grammar_mask_inline_rows"] == 0
    # ... by the worker, or known from a forced run it found (the 'x' after '-')
    assert info["grammar_mask_prefetched_rows"] + info["grammar_forced_from_runs"] >= info["grammar_mask_rows"]
    assert info["grammar_forced_from_runs"] >= 4
    assert info["grammar_forced_masks"] >= 4 * 2


@pytest.mark.parametrize("threads", [0, 2])
def test_a_steps_rows_go_to_the_worker_as_one_call(threads):
    """The rows a processed step accepted are queued together (``prefetch_all``, what the
    batch core does): one library call on the worker per step, through llguidance's pool
    or row by row, each row's mask equal to the one computed on the spot. Row by row the
    worker also asks for the forced run at '-' ('-', 'x'): the rows accepting '-' then know
    their next mask (one bit, 'x') and queue nothing; the pool computes masks only."""
    tok = ByteTokenizer()
    compiler = GrammarCompiler(tok, tok.vocab_size, backend="llguidance")
    compiler.masks.threads = threads  # the pool is the engine's choice on 8+ CPUs only
    words = (tok.vocab_size + 31) // 32
    try:
        ahead = [compiler.matcher(("regex", REGEX)) for _ in range(5)]
        here = [GrammarMatcher(m.handle.deep_copy()) for m in ahead]
        for i, ch in enumerate(b"ab-x"):
            calls = compiler.masks.stats()["grammar_mask_worker_calls"]
            later: list[GrammarMatcher] = []
            for m, h in zip(ahead, here):
                assert not m.accept(ch, later=later) and not h.accept(ch)
            known = ch == ord("-") and not threads
            assert later == ([] if known else ahead)
            prefetch_all(later)
            for j, (m, h) in enumerate(zip(ahead, here)):
                got = m.next_mask()
                assert got is not None and np.array_equal(got, inline_mask(h, words)), f"position {i + 1}, row {j}"
            assert compiler.masks.stats()["grammar_mask_worker_calls"] == calls + (not known)
    finally:
        compiler.close()


@pytest.mark.usefixtures("llguidance")  # llguidance's pool (xgrammar's rows take one call of their own)
@pytest.mark.parametrize("loop,threads", [("normal", None), ("overlap", 2)])
async def test_engine_queues_a_steps_masks_as_one(loop, threads, monkeypatch):
    """8 constrained requests side by side: the worker's calls are bounded by the steps
    and the admissions (one ticket each), not by the rows; also through llguidance's pool
    and the hand-over (the engine's choice on 8+ CPUs, forced here)."""
    if threads is not None:
        monkeypatch.setattr(prefetch, "mask_threads", lambda cpus=None: ("pool", threads))
    n = 8
    sps = [SamplingParams(max_new_tokens=16, regex=REGEX, temperature=1.0, seed=s) for s in range(n)]
    async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu", loop=loop) as engine:
        results = await asyncio.gather(*[engine.generate(prompt="id:", sampling=sp) for sp in sps])
        info = engine.scheduler.info()
    assert all(r.finish_reason == "stop" and re.fullmatch(REGEX, r.text) for r in results)
    assert info["grammar_mask_prefetched_rows"] + info["grammar_forced_from_runs"] >= n * 5
    assert info["grammar_mask_worker_calls"] <= info["steps"] + n
    assert info["grammar_mask_threads"] == (threads or prefetch.pool_threads())


def test_a_failed_computation_leaves_its_rows_to_the_fill_and_the_worker_running():
    tok = ByteTokenizer()
    compiler = GrammarCompiler(tok, tok.vocab_size)
    worker = compiler.masks
    real = worker._compute
    calls = []

    def first_fails(todo):
        calls.append(len(todo))
        if len(calls) == 1:
            raise RuntimeError("the library failed")
        real(todo)

    worker._compute = first_fails
    try:
        m = compiler.matcher(("regex", REGEX))
        assert m.next_mask() is None  # the fill computes this one itself
        assert not m.accept(ord("a"))
        assert m._ticket is not None and m._ticket.done.wait(timeout=30), "the worker stopped"
        assert m.next_mask() is not None and len(calls) == 2
    finally:
        compiler.close()


def test_the_mask_pool_is_off_unless_asked_for(monkeypatch):
    """One thread computes the masks by default (a pool was slower on both hosts measured);
    OMNI_ASYNC_GRAMMAR_THREADS=pool:N asks for a pool, at most every CPU but one (a plain N
    asks for the worker's slices, tests/test_mask_slices.py)."""
    monkeypatch.delenv("OMNI_ASYNC_GRAMMAR_THREADS", raising=False)
    assert prefetch.pool_threads(16) == 0
    for asked, want in (("pool:4", 4), ("pool:64", 15), ("pool:1", 0), ("pool:x", 0), ("4", 0)):
        monkeypatch.setenv("OMNI_ASYNC_GRAMMAR_THREADS", asked)
        assert prefetch.pool_threads(16) == want


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "role": {"enum": ["admin", "guest"]}, "n": {"type": "integer"}},
          "required": ["name", "role", "n"], "additionalProperties": False}


@pytest.mark.parametrize("seed", range(3))
def test_masks_known_from_forced_runs_equal_the_librarys(seed):
    """Along random admissible walks of a JSON schema (keys, punctuation and enum tails are
    forced runs), every mask the matcher hands out (the worker's, or one bit known from a
    run without the library) equals the library's mask computed on the spot, and most
    forced positions need no library call."""
    import json

    tok = ByteTokenizer()
    compiler = GrammarCompiler(tok, tok.vocab_size, backend="llguidance")
    words = (tok.vocab_size + 31) // 32
    rng = np.random.default_rng(seed)
    try:
        ahead = compiler.matcher(("json_schema", json.dumps(SCHEMA)))
        here = GrammarMatcher(ahead.handle.deep_copy())
        for i in range(200):
            got = ahead.next_mask()
            want = inline_mask(here, words)
            assert got is not None and np.array_equal(got, want), f"position {i}"
            allowed = np.flatnonzero(np.unpackbits(want.view(np.uint8), bitorder="little")[:tok.vocab_size])
            token = int(rng.choice(allowed))
            if ahead.accept(token):
                break
            assert not here.accept(token)
        assert ahead.complete
        stats = compiler.masks.stats()
        assert stats["grammar_forced_from_runs"] >= 10  # '"name": "' alone is a run of 9
        assert stats["grammar_forced_masks"] > stats["grammar_forced_from_runs"]
    finally:
        compiler.close()
