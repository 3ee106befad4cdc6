"""Grammar masks computed ahead on the mask worker (``structured.prefetch``): the mask a
step takes from the worker equals the one computed on the spot at every position, a
matcher accepting a token queues its next mask, forced positions are counted, and in an
engine every constrained row's mask came from the worker, not the launching thread."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

pytest.importorskip("llguidance")

from omni_async import Engine, SamplingParams  # noqa: E402
from omni_async.structured.grammar import GrammarCompiler, GrammarMatcher  # noqa: E402
from omni_async.text.tokenizer import ByteTokenizer  # noqa: E402

REGEX = r"[a-c]{2}-x[0-9]"


def inline_mask(matcher: GrammarMatcher, words: int) -> np.ndarray:
    out = np.empty(words, dtype=np.int32)
    matcher.handle.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
    return out


def test_worker_masks_equal_masks_computed_on_the_spot():
    tok = ByteTokenizer()
    compiler = GrammarCompiler(tok, tok.vocab_size)
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
        assert stats["grammar_mask_prefetched_rows"] == 5
        assert stats["grammar_forced_masks"] == 2  # '-' and 'x' are the grammar's alone
    finally:
        compiler.close()


def test_a_closed_worker_leaves_masks_to_the_fill():
    tok = ByteTokenizer()
    compiler = GrammarCompiler(tok, tok.vocab_size)
    compiler.close()
    m = compiler.matcher(("regex", REGEX))
    assert m.next_mask() is None
    assert not m.accept(ord("a")) and m.next_mask() is None


@pytest.mark.parametrize("loop", ["normal", "async_decode"])
async def test_engine_masks_come_from_the_worker(loop):
    constrained = [SamplingParams(max_new_tokens=16, regex=REGEX, temperature=1.0, seed=s) for s in range(4)]
    free = [SamplingParams(max_new_tokens=12, ignore_eos=True) for _ in range(4)]
    async with Engine.from_pretrained("tiny", device="cpu", loop=loop) as engine:
        results = await asyncio.gather(*[engine.generate(prompt="id:", sampling=sp) for sp in constrained + free])
        info = engine.scheduler.info()
    for r in results[:4]:
        assert r.finish_reason == "stop" and re.fullmatch(REGEX, r.text), r.text
    # Every position is masked, or forced and skipped by a jump-forward (no mask fill).
    assert info["grammar_mask_rows"] + info["grammar_forced_skipped"] >= 4 * 5
    assert info["grammar_mask_inline_rows"] == 0
    assert info["grammar_mask_prefetched_rows"] >= info["grammar_mask_rows"]
    assert info["grammar_forced_masks"] >= 4 * 2
