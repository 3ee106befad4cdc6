"""Jump-forward of the tokens a grammar forces: appended at once, their KV computed in the
request's next step (fed into the fused launch, or as an extend row of a one-forward
step). Every token equals token-by-token constrained decoding (greedy and seeded, all
three loops, with and without multi-step decodes), the skipped tokens are counted in
``info()``, outputs are valid, KV is freed once."""

# These tests are about rows that sample under their masks: optimistic_grammar=False keeps every
# constrained row there (rows that sample first: tests/test_optimistic_grammar.py).

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
