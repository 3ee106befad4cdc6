"""Jump-forward of the tokens a grammar forces: appended at once, their KV computed in the
request's next step (fed into the fused launch, or as an extend row of a one-forward
step). Every token equals token-by-token constrained decoding (greedy and seeded, all
three loops, with and without multi-step decodes), the skipped tokens are counted in
``info()``, outputs are valid, KV is freed once."""

# These tests are about rows that sample under their masks: optimistic_grammar=False keeps every
# constrained row there (rows that sample first: tests/test_optimistic_grammar.py).
# The forced runs are llguidance's (``compute_ff_tokens``): every test pins it (xgrammar, the
# default where installed, gives none; its jumps, found from one-token masks, are checked in
# tests/test_xgrammar_backend.py).

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from omni_async import Engine, SamplingParams
from omni_async.structured.jump import single_token

from .conftest import assert_kv_free
from .test_constrained import validate

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"},
                   "name": {"type": "string", "maxLength": 6}},
    "required": ["id", "ok", "name"],
    "additionalProperties": False,
}
LOOPS = ["normal", "overlap", "async_decode"]
pytestmark = pytest.mark.usefixtures("llguidance")
PROMPTS = [f"record {i}:" for i in range(8)]
FREE = SamplingParams(max_new_tokens=24, ignore_eos=True)
GREEDY = SamplingParams(max_new_tokens=64, json_schema=SCHEMA)
SEEDED = SamplingParams(max_new_tokens=64, json_schema=SCHEMA, temperature=0.9, seed=3)


def requests() -> list[SamplingParams]:
    """Half the requests under the schema (greedy and seeded), beside free ones."""
    return [(GREEDY if i % 4 == 1 else SEEDED) if i % 2 else FREE for i in range(len(PROMPTS))]


async def outputs(loop: str, decode_steps: int, jump: bool) -> tuple[list, dict]:
    async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu", loop=loop, decode_steps=decode_steps, jump_forward=jump) as engine:
        results = await asyncio.gather(*[engine.generate(prompt=p, sampling=sp) for p, sp in zip(PROMPTS, requests())])
        info = engine.scheduler.info()
    assert_kv_free(engine)
    return results, info


@pytest.mark.parametrize("decode_steps", [1, 4])
@pytest.mark.parametrize("loop", LOOPS)
async def test_jump_forward_emits_the_tokens_of_token_by_token_decoding(loop, decode_steps):
    one_by_one, before = await outputs(loop, decode_steps, jump=False)
    jumped, info = await outputs(loop, decode_steps, jump=True)
    assert before["grammar_forced_skipped"] == 0
    assert info["grammar_forced_skipped"] > 0 and info["grammar_jumps"] > 0
    if decode_steps == 1:
        assert info["grammar_jump_steps"] > 0  # forced tokens computed as extend rows of one-forward steps
    else:
        assert info["fused_decode_with_grammar"] > 0  # ... or fed into the fused launch
    for i, (r, ref) in enumerate(zip(jumped, one_by_one)):
        assert r.output_ids == ref.output_ids, f"request {i} differs from token-by-token decoding"
        assert r.finish_reason == ref.finish_reason
        if i % 2:
            validate(json.loads(r.text), SCHEMA)


async def test_jump_forward_streams_every_token_once():
    """A stream's deltas carry the forced tokens with the sampled ones, each once."""
    async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu", loop="overlap", decode_steps=4, jump_forward=True) as engine:
        streamed: list[int] = []
        async for delta in engine.stream(prompt="record 9:", sampling=GREEDY):
            streamed.extend(delta.token_ids)
        whole = await engine.generate(prompt="record 9:", sampling=GREEDY)
        info = engine.scheduler.info()
    assert streamed == whole.output_ids and info["grammar_forced_skipped"] > 0
    validate(json.loads(whole.text), SCHEMA)


def test_single_token_reads_a_one_bit_mask():
    mask = np.zeros(4, dtype=np.int32)
    assert single_token(mask) is None
    mask[2] = np.int32(-(2**31))  # bit 31 of word 2: token 95
    assert single_token(mask) == 95
    mask[0] = 1
    assert single_token(mask) is None
    mask[:] = 0
    mask[1] = 0b1010
    assert single_token(mask) is None


def test_a_jump_takes_its_run_from_the_parser_state_without_the_mask_worker():
    """A jump-forward asks the library for the forced run (one query, no mask per
    position) on the processing thread: it neither waits for the mask worker (stalled
    here) nor needs a mask queued. The run's tokens are the ones the masks force, the
    request's next mask is queued after the run and equals the library's."""
    import threading
    from types import SimpleNamespace

    from omni_async.structured.grammar import GrammarCompiler, GrammarMatcher, prefetch_all
    from omni_async.structured.jump import jump_forward
    from omni_async.text.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    compiler = GrammarCompiler(tok, tok.vocab_size, backend="llguidance")
    words = (tok.vocab_size + 31) // 32
    release = threading.Event()
    real = compiler.masks._compute

    def stalled(todo):
        release.wait(timeout=60)
        real(todo)

    try:
        m = compiler.matcher(("regex", r"[a-c]{2}-x[0-9]"))
        assert m.next_mask() is not None  # the first mask, queued at creation
        compiler.masks._compute = stalled
        later: list[GrammarMatcher] = []
        assert not m.accept(ord("a"), later=later) and not m.accept(ord("b"), later=later)  # not queued yet
        req = SimpleNamespace(matcher=m, output_ids=[ord("a"), ord("b")], stop_ids=lambda: (),
                              tokens_left=lambda ctx, scheduling=True: 10)
        run, reason = jump_forward(req, 100, most=8)
        assert run == [ord("-"), ord("x")] and reason is None and req.output_ids[-2:] == run
        prefetch_all([m])  # what process_result does after the jump
        release.set()
        here = GrammarMatcher(m.handle.deep_copy())
        want = np.empty(words, dtype=np.int32)
        here.handle.unsafe_compute_mask_ptr(want.ctypes.data, want.nbytes)
        assert np.array_equal(m.next_mask(), want)  # the digits
        assert single_token(want) is None
    finally:
        release.set()
        compiler.close()
