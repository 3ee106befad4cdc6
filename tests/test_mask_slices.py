"""A step's grammar masks split over the mask worker's own threads (``structured.prefetch``'s
``SlicePool``, ``OMNI_ASYNC_GRAMMAR_THREADS=N``): the same masks as one thread, with real
llguidance matchers on real threads; tickets from several submitters; close() while the
worker is busy; a row the library refuses left to the fill alone; and an engine's
constrained outputs unchanged under every loop."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import numpy as np
import pytest

pytest.importorskip("llguidance")

from omni_async import Engine, SamplingParams  # noqa: E402
from omni_async.structured import prefetch  # noqa: E402
from omni_async.structured.grammar import GrammarCompiler, GrammarMatcher, prefetch_all  # noqa: E402
from omni_async.text.tokenizer import ByteTokenizer  # noqa: E402

from .conftest import assert_kv_free  # noqa: E402
from .test_constrained import validate  # noqa: E402
from .test_late_masks import SCHEMA  # noqa: E402
REGEX = r"[a-c]{2}-x[0-9]{1,3}"
# Two grammars: rows of one share a lexer (a lock in llguidance), rows of the other do not.
KEYS = [("json_schema", json.dumps(SCHEMA)), ("regex", REGEX)]
LOOPS = ["normal", "overlap", "async_decode"]


def inline_mask(handle, words: int) -> np.ndarray:
    out = np.empty(words, dtype=np.int32)
    handle.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
    return out


def spread_matchers(compiler: GrammarCompiler, n: int, seed: int) -> list[GrammarMatcher]:
    """``n`` matchers of both grammars, each a random number of allowed tokens in."""
    rng = np.random.default_rng(seed)
    words = (compiler.vocab_size + 31) // 32
    out = []
    for j in range(n):
        m = compiler.matcher(KEYS[j % len(KEYS)])
        for _ in range(int(rng.integers(0, 6))):
            bits = np.unpackbits(inline_mask(m.handle, words).view(np.uint8), bitorder="little")
            allowed = np.flatnonzero(bits[: compiler.vocab_size])
            if m.accept(int(rng.choice(allowed))):
                break
        out.append(m)
    return out


@pytest.fixture
def compiler():
    tok = ByteTokenizer()
    c = GrammarCompiler(tok, tok.vocab_size, backend="llguidance")  # the slices serve llguidance's rows
    yield c
    c.close()


@pytest.mark.parametrize("threads,rows", [(2, 17), (3, 40), (4, 3)])
def test_slices_compute_the_masks_one_thread_does(compiler, threads, rows):
    words = (compiler.vocab_size + 31) // 32
    handles = [m.handle for m in spread_matchers(compiler, rows, seed=threads)]
    want = np.stack([inline_mask(h, words) for h in handles])
    pool = prefetch.SlicePool(threads)
    try:
        for _ in range(3):  # the same helpers, woken again for each job
            got = np.full((rows, words), 7, dtype=np.int32)
            ok = np.ones(rows, dtype=bool)
            pool.run(handles, got, ok)
            assert ok.all() and np.array_equal(got, want)
        assert pool.jobs == 3 and len(pool._helpers) == threads - 1
    finally:
        pool.close()
    for t in pool._helpers:
        t.join(timeout=30)
        assert not t.is_alive(), "a helper outlived close()"


class Refusing:
    """A row the library refuses (llguidance raises on a bad target; a real matcher in
    error does not raise, so the refusal is made here)."""

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        raise ValueError("refused")


def test_a_refused_row_fails_alone_and_the_helpers_carry_on(compiler):
    words = (compiler.vocab_size + 31) // 32
    handles: list = [m.handle for m in spread_matchers(compiler, 9, seed=1)]
    want = np.stack([inline_mask(h, words) for h in handles])
    handles[4] = Refusing()  # with 2 threads a row of the calling thread (rows 0, 2, 4, ...)
    handles[5] = Refusing()  # and one of the helper's (rows 1, 3, 5, ...)
    pool = prefetch.SlicePool(2)
    try:
        for _ in range(2):
            got = np.empty((9, words), dtype=np.int32)
            ok = np.ones(9, dtype=bool)
            pool.run(handles, got, ok)
            assert list(np.flatnonzero(~ok)) == [4, 5]
            keep = [j for j in range(9) if j not in (4, 5)]
            assert np.array_equal(got[keep], want[keep])
    finally:
        pool.close()


def test_worker_tickets_from_several_submitters_over_slices(compiler, monkeypatch):
    """Threads queue their own matchers' masks at once, as one ticket each step: every
    ticket's masks equal those computed on the spot, whichever tickets were merged."""
    compiler.masks.slices = prefetch.SlicePool(3)
    words = (compiler.vocab_size + 31) // 32
    groups = [spread_matchers(compiler, 7, seed=s) for s in range(4)]
    here = [[GrammarMatcher(m.handle.deep_copy()) for m in g] for g in groups]
    failures: list[str] = []
    start = threading.Barrier(len(groups))

    def submitter(i: int) -> None:
        rng = np.random.default_rng(100 + i)
        start.wait()
        for step in range(6):
            live = [(m, h) for m, h in zip(groups[i], here[i]) if not m.complete]
            if not live:
                return
            later: list[GrammarMatcher] = []
            for m, h in live:
                mask = m.next_mask()
                if mask is None or not np.array_equal(mask, inline_mask(h.handle, words)):
                    failures.append(f"submitter {i}, step {step}")
                    return
                bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[: compiler.vocab_size]
                token = int(rng.choice(np.flatnonzero(bits)))
                ended = m.accept(token, later=later)
                assert h.accept(token, prefetch=False) == ended
            prefetch_all(later)

    threads = [threading.Thread(target=submitter, args=(i,)) for i in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a submitter was left waiting for its masks"
    assert not failures, failures
    stats = compiler.masks.stats()
    assert stats["grammar_mask_slices"] == 3 and stats["grammar_mask_sliced_calls"] > 0
    assert stats["grammar_mask_prefetched_rows"] >= 4 * 7


def test_close_while_busy_finishes_every_queued_ticket(compiler):
    compiler.masks.slices = prefetch.SlicePool(2)
    words = (compiler.vocab_size + 31) // 32
    batches = [spread_matchers(compiler, 6, seed=s) for s in range(8)]
    for b in batches:  # their first masks were queued at creation: take them, then queue the next together
        for m in b:
            m.next_mask()
    tickets = []
    for b in batches:
        later: list[GrammarMatcher] = []
        for m in b:
            if not m.complete:
                bits = np.unpackbits(m.next_mask().view(np.uint8), bitorder="little")[: compiler.vocab_size]
                m.accept(int(np.flatnonzero(bits)[0]), later=later)
        prefetch_all(later)
        tickets.append(later)
    compiler.close()  # while the worker has tickets queued or in flight
    for later in tickets:
        for m in later:
            assert m._ticket is not None and m._ticket.done.wait(timeout=30), "a queued ticket was dropped"
            got = m.next_mask()
            assert got is not None and np.array_equal(got, inline_mask(m.handle, words))
    assert compiler.masks.submit([batches[0][0].handle]) is None  # closed: no new work
    compiler.masks._thread.join(timeout=30)
    assert not compiler.masks._thread.is_alive()
    for t in compiler.masks.slices._helpers:
        t.join(timeout=30)
        assert not t.is_alive()


def test_the_setting(monkeypatch):
    monkeypatch.delenv("OMNI_ASYNC_GRAMMAR_THREADS", raising=False)
    assert prefetch.mask_threads(16) == ("one", 1)
    for asked, want in (("4", ("slices", 4)), ("slices:3", ("slices", 3)), ("64", ("slices", 16)),
                        ("pool:4", ("pool", 4)), ("pool:64", ("pool", 15)), ("1", ("one", 1)), ("x", ("one", 1)),
                        ("other:4", ("one", 1)), ("", ("one", 1))):
        monkeypatch.setenv("OMNI_ASYNC_GRAMMAR_THREADS", asked)
        assert prefetch.mask_threads(16) == want, asked
        assert prefetch.pool_threads(16) == (want[1] if want[0] == "pool" else 0)
    monkeypatch.setenv("OMNI_ASYNC_GRAMMAR_THREADS", "4")
    assert prefetch.mask_threads(1) == ("one", 1)


def engine_requests() -> list[SamplingParams]:
    out = []
    for i in range(8):
        grammar = {"json_schema": SCHEMA} if i % 2 else {"regex": REGEX}
        temp = {"temperature": 0.8, "seed": i} if i % 4 >= 2 else {}
        out.append(SamplingParams(max_new_tokens=48, **grammar, **temp))
    return out


async def generate_all(loop: str) -> tuple[list, dict]:
    async with Engine.from_pretrained("tiny", device="cpu", loop=loop) as engine:
        results = await asyncio.gather(*[engine.generate(prompt=f"record {i}:", sampling=sp)
                                         for i, sp in enumerate(engine_requests())])
        info = engine.scheduler.info()
    assert_kv_free(engine)
    return results, info


@pytest.mark.usefixtures("llguidance")  # the slices serve llguidance's rows (xgrammar's: one call of its own)
async def test_engine_outputs_unchanged_with_slices_under_every_loop(monkeypatch):
    monkeypatch.delenv("OMNI_ASYNC_GRAMMAR_THREADS", raising=False)
    reference, info = await generate_all("normal")
    assert info["grammar_mask_slices"] == 0
    monkeypatch.setenv("OMNI_ASYNC_GRAMMAR_THREADS", "3")
    monkeypatch.setattr(prefetch, "host_cpus", lambda: 8)
    for loop in LOOPS:
        results, info = await generate_all(loop)
        assert info["grammar_mask_slices"] == 3 and info["grammar_mask_sliced_calls"] > 0, loop
        assert info["grammar_mask_inline_rows"] == 0, loop
        for i, r in enumerate(results):
            assert r.finish_reason == "stop", (loop, i, r.text)
            if i % 2:
                validate(json.loads(r.text), SCHEMA)
            else:
                assert re.fullmatch(REGEX, r.text), r.text
        assert [r.output_ids for r in results] == [r.output_ids for r in reference], loop
