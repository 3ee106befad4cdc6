"""Constrained rows beside free rows: the free rows keep the fused multi-step launch and
the lookahead loops' run-ahead while rows under a grammar share their steps (those run
inside the fused launch, their first token sampled under their masks and the rest
discarded, and join a step only once the host has seen their last token). Free rows' tokens equal those of an all-free run, every
constrained output is valid, and the three loops agree."""

# These tests are about rows that sample under their masks: optimistic_grammar=False keeps every
# constrained row there (rows that sample first: tests/test_optimistic_grammar.py).

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from omni_async import Engine, SamplingParams

from .conftest import assert_kv_free
from .test_constrained import validate

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
    "required": ["id", "ok"],
    "additionalProperties": False,
}
LOOPS = ["normal", "overlap", "async_decode"]
PROMPTS = [f"record {i}:" for i in range(8)]
FREE = SamplingParams(max_new_tokens=24, ignore_eos=True)
CONSTRAINED = SamplingParams(max_new_tokens=64, json_schema=SCHEMA)


def mixed() -> list[SamplingParams]:
    """A quarter of the requests under the schema."""
    return [CONSTRAINED if i % 4 == 3 else FREE for i in range(len(PROMPTS))]


async def run(engine: Engine, sampling: list[SamplingParams]) -> list:
    return await asyncio.gather(*[engine.generate(prompt=p, sampling=sp) for p, sp in zip(PROMPTS, sampling)])


@pytest.mark.parametrize("loop", LOOPS)
async def test_free_rows_stay_fused_and_ahead_beside_constrained_rows(loop):
    async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu", loop=loop, decode_steps=4) as engine:
        all_free = await run(engine, [FREE] * len(PROMPTS))
        engine.scheduler.trace_enabled = True
        before = engine.scheduler.info()
        results = await run(engine, mixed())
        info = engine.scheduler.info()
        trace = list(engine.scheduler.stats.trace)
    assert_kv_free(engine)
    for i, (r, alone) in enumerate(zip(results, all_free)):
        if i % 4 == 3:
            assert r.finish_reason == "stop", r.text
            validate(json.loads(r.text), SCHEMA)
        else:
            assert r.output_ids == alone.output_ids, f"free request {i} changed beside constrained ones"
    # The rows under the grammar ran inside the free rows' fused launches, not beside them.
    assert info["fused_decode_with_grammar"] > before["fused_decode_with_grammar"]
    assert info["fused_decode_beside_grammar"] == before["fused_decode_beside_grammar"]
    if loop != "normal":
        # A step holding the constrained rows ran ahead (before: every such step in sync).
        assert f"launch:{len(PROMPTS)}" in trace, trace


async def test_loops_agree_on_constrained_and_free_tokens():
    outputs = {}
    for loop in LOOPS:
        async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu", loop=loop, decode_steps=4) as engine:
            outputs[loop] = [r.output_ids for r in await run(engine, mixed())]
    assert outputs["overlap"] == outputs["normal"] and outputs["async_decode"] == outputs["normal"]


SAMPLED = SamplingParams(max_new_tokens=64, json_schema=SCHEMA, temperature=0.8, seed=7, repetition_penalty=1.3)


def mixed_sampled() -> list[SamplingParams]:
    """A quarter under the schema, greedy and seeded (with a repetition penalty: the
    tokens of discarded forwards must not count as seen), beside free rows."""
    return [(CONSTRAINED if i % 8 == 3 else SAMPLED) if i % 4 == 3 else FREE for i in range(len(PROMPTS))]


@pytest.mark.parametrize("loop", LOOPS)
async def test_constrained_rows_in_the_fused_launch_match_one_forward_steps(loop):
    """A constrained row inside the fused launch keeps only its first token, sampled under
    its mask: its output equals that of one-forward steps (greedy and seeded), and its
    discarded forwards leave no trace (KV freed once, the free rows unchanged)."""
    async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu", loop=loop, decode_steps=1) as engine:
        single = [r.output_ids for r in await run(engine, mixed_sampled())]
    async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu", loop=loop, decode_steps=4) as engine:
        results = await run(engine, mixed_sampled())
        info = engine.scheduler.info()
    assert_kv_free(engine)
    assert info["fused_decode_with_grammar"] > 0 and info["fused_decode_beside_grammar"] == 0
    for i, r in enumerate(results):
        if i % 4 == 3:
            validate(json.loads(r.text), SCHEMA)
        assert r.output_ids == single[i], f"request {i} differs from one-forward steps"


def test_a_batch_rebuilt_after_a_drain_keeps_its_forwards_and_grammar_rows():
    """A multi-step decode scheduled while a step was in flight, some of whose rows ended
    meanwhile, is rebuilt without them: the rest keep their forward counts (their
    in-flight counts hold them) and the grammar rows their place."""
    from omni_async.core.batch import ForwardMode, ScheduledBatch
    from omni_async.core.request import Request

    reqs = [Request(rid=str(i), prompt_ids=[1, 2], sampling=FREE) for i in range(3)]
    batch = ScheduledBatch(mode=ForwardMode.DECODE, reqs=reqs, epochs=[0, 0, 0], prefix_lens=[2, 2, 2], extend_lens=[1, 1, 1],
                           samples_kept=[True] * 3, input_ids=[-1, -1, -1], sample_indices=[0, 0, 0],
                           page_tables=[[0], [1], [2]], page_counts=[1, 1, 1], row_steps=[4, 4, 1], grammar_rows=[2])
    reqs[0].finish_reason = "stop"
    out = batch.runnable_after_drain()
    assert out.reqs == reqs[1:] and out.row_steps == [4, 1] and out.grammar_rows == [1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("loop", LOOPS)
async def test_cuda_constrained_rows_replay_the_fused_graph_with_their_bitmask(loop):
    """On CUDA (float32, graphs): steps holding rows under a grammar replay a fused graph
    whose bitmask input is filled in place before each replay; every output equals that of
    one-forward steps, constrained outputs are valid, KV freed once."""
    limits = dict(device="cuda", dtype="float32", loop=loop, kv_capacity_tokens=8192)
    async with Engine.from_pretrained("tiny", optimistic_grammar=False, decode_steps=1, **limits) as engine:
        single = [r.output_ids for r in await run(engine, mixed_sampled())]
    async with Engine.from_pretrained("tiny", optimistic_grammar=False, decode_steps=4, **limits) as engine:
        results = await run(engine, mixed_sampled())
        info = engine.scheduler.info()
    assert_kv_free(engine)
    assert info["fused_decode_with_grammar"] > 0 and info["fused_decode_replays"] > 0
    for i, r in enumerate(results):
        if i % 4 == 3:
            validate(json.loads(r.text), SCHEMA)
        assert r.output_ids == single[i], f"request {i} differs from one-forward steps"


async def test_steps_of_constrained_rows_only_run_one_forward_per_row():
    """Every row under a grammar and none with forced tokens to compute: one forward per
    row (the one-forward decode path, whose graphs replay on CUDA), no fused launch."""
    async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu", loop="overlap", decode_steps=4, jump_forward=False) as engine:
        results = await run(engine, [CONSTRAINED] * len(PROMPTS))
        info = engine.scheduler.info()
    assert_kv_free(engine)
    assert info["fused_decode_launches"] == 0 and info["grammar_mask_steps"] > 0
    for r in results:
        validate(json.loads(r.text), SCHEMA)
