"""Mixed prefill and decode: prompts that arrive while others decode are prefilled in
steps that also carry the running requests' next tokens. Same tokens as separate
prefill and decode steps, in every loop; KV freed once through retraction and aborts."""

from __future__ import annotations

import asyncio
import random

import pytest

from omni_async import Engine, SamplingParams
from omni_async.errors import ConfigError, RequestAbortedError
from omni_async.runners.base import ModelRunner

from .conftest import LOOPS, assert_kv_free, hf_greedy, random_prompts


def _prompts(seed: int = 3) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    running = [[rng.randrange(1, 250) for _ in range(rng.randint(3, 12))] for _ in range(4)]
    arriving = [[rng.randrange(1, 250) for _ in range(rng.randint(50, 120))] for _ in range(3)]
    return running, arriving


async def _burst_while_decoding(engine: Engine, running, arriving, sampling, after_burst=None) -> list:
    """Start ``running``, wait for each one's first token, then submit ``arriving``:
    their prefill steps come while the first ones decode. ``after_burst``: awaited
    once the burst is submitted."""
    handles = [await engine.submit(input_ids=p, sampling=sampling(i)) for i, p in enumerate(running)]
    streams = [h.__aiter__() for h in handles]  # kept: a dropped stream aborts its request
    for s in streams:
        await s.__anext__()
    handles += [await engine.submit(input_ids=p, sampling=sampling(100 + i)) for i, p in enumerate(arriving)]
    if after_burst is not None:
        await after_burst()
    return [await h.result() for h in handles]


def _sampling(temperature: float):
    return lambda i: SamplingParams(max_new_tokens=24, temperature=temperature, seed=7 + i, ignore_eos=True)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("loop", LOOPS)
async def test_mixed_tokens_equal_unmixed(loop, temperature):
    running, arriving = _prompts()
    outs = {}
    for mixed in (False, True):
        engine = Engine.from_pretrained("tiny", loop=loop, mixed_prefill=mixed, chunked_prefill_size=32, page_size=8)
        async with engine:
            results = await _burst_while_decoding(engine, running, arriving, _sampling(temperature))
            rows = engine.stack.core.stats()["mixed_decode_rows"]
        assert_kv_free(engine)
        assert (rows > 0) == mixed, "the burst was meant to arrive while the first requests decode"
        outs[mixed] = [r.output_ids for r in results]
        assert all(len(o) == 24 for o in outs[mixed])
    assert outs[True] == outs[False]


async def test_mixed_loops_agree():
    running, arriving = _prompts(5)
    outs = []
    for loop in LOOPS:
        engine = Engine.from_pretrained("tiny", loop=loop, mixed_prefill=True, chunked_prefill_size=32, page_size=8)
        async with engine:
            results = await _burst_while_decoding(engine, running, arriving, _sampling(0.7))
            assert engine.stack.core.stats()["mixed_decode_rows"] > 0
        assert_kv_free(engine)
        outs.append([r.output_ids for r in results])
    assert outs[0] == outs[1] == outs[2]


@pytest.mark.parametrize("loop", LOOPS)
async def test_mixed_greedy_matches_transformers_under_pressure(hf_checkpoints, loop):
    """Mixed steps under KV pressure, and a retraction of everything mid-mix (pause
    with retract, then resume), still give transformers' tokens."""
    folder = hf_checkpoints["qwen2"]
    running = random_prompts(4, 512, 3, 20, seed=1)
    arriving = random_prompts(5, 512, 60, 120, seed=2)
    lengths = [24] * len(running) + [8] * len(arriving)
    expected = [hf_greedy(folder, p, n) for p, n in zip(running + arriving, lengths)]
    engine = Engine.from_pretrained(str(folder), loop=loop, mixed_prefill=True, page_size=8, kv_capacity_tokens=8 * 40,
                                    chunked_prefill_size=48, max_prefill_tokens=64)
    async def retract_mid_mix() -> None:
        for _ in range(10_000):  # until a mixed step was scheduled (bounded: never a hang)
            if engine.stack.core.stats()["mixed_decode_rows"]:
                break
            await asyncio.sleep(0.005)
        await engine.pause(mode="retract")
        await engine.resume()

    async with engine:
        results = await _burst_while_decoding(
            engine, running, arriving,
            lambda i: SamplingParams(max_new_tokens=lengths[i] if i < 100 else lengths[len(running) + i - 100]),
            retract_mid_mix)
        stats = engine.stack.core.stats()
    assert stats["mixed_decode_rows"] > 0
    assert stats["num_retractions"] > 0
    assert [r.output_ids for r in results] == expected
    assert_kv_free(engine)


@pytest.mark.parametrize("loop", LOOPS)
async def test_aborts_mid_mix(loop):
    """Aborting running and arriving requests while mixed steps run: one terminal
    message each, the others' tokens unchanged, KV freed exactly once."""
    running, arriving = _prompts(9)
    sp = _sampling(0.0)
    reference = Engine.from_pretrained("tiny", loop=loop, mixed_prefill=False, chunked_prefill_size=32, page_size=8)
    async with reference:
        want = [r.output_ids for r in await asyncio.gather(
            *[reference.generate(input_ids=p, sampling=sp(i)) for i, p in enumerate(running + arriving)])]
    engine = Engine.from_pretrained("tiny", loop=loop, mixed_prefill=True, chunked_prefill_size=32, page_size=8)
    async with engine:
        handles = [await engine.submit(input_ids=p, sampling=sp(i), request_id=f"r{i}") for i, p in enumerate(running)]
        streams = [h.__aiter__() for h in handles]
        for s in streams:
            await s.__anext__()
        handles += [await engine.submit(input_ids=p, sampling=sp(len(running) + i), request_id=f"a{i}")
                    for i, p in enumerate(arriving)]
        await asyncio.sleep(0)
        aborted = {"r1", "r4", "a0", "a3"}
        for rid in sorted(aborted):
            await engine.abort(rid)
        outcomes = await asyncio.gather(*[h.result() for h in handles], return_exceptions=True)
        assert engine.stack.core.stats()["mixed_decode_rows"] > 0
    ids = [f"r{i}" for i in range(len(running))] + [f"a{i}" for i in range(len(arriving))]
    for rid, got, exp in zip(ids, outcomes, want):
        if isinstance(got, RequestAbortedError):
            assert rid in aborted
        else:
            assert not isinstance(got, BaseException), got
            assert got.output_ids == exp  # an abort may come after a request finished
    assert_kv_free(engine)


def test_hooked_runner_is_not_mixed():
    """A runner that overrides a prefill or decode hook keeps prompt-only prefill steps."""

    class Hooked(ModelRunner):
        def post_decode(self, result, forward_batch, schedule_batch, requests) -> None:
            pass

    assert ModelRunner.mixed_prefill_allowed(object.__new__(ModelRunner))
    assert not Hooked.mixed_prefill_allowed(object.__new__(Hooked))


def test_mixed_prefill_must_be_bool():
    with pytest.raises(ConfigError, match="mixed_prefill"):
        Engine.from_pretrained("tiny", mixed_prefill="yes")
