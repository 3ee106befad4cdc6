"""The event loop stays free: a co-located coroutine keeps ticking while the CPU model
decodes, and an idle scheduler burns no CPU and wakes on arrival."""

from __future__ import annotations

import asyncio
import pytest

from omni_async import Engine, SamplingParams

from .conftest import LOOPS, save_random_checkpoint


@pytest.fixture(scope="module")
def heavier_checkpoint(tmp_path_factory):
    return save_random_checkpoint(
        "llama", tmp_path_factory.mktemp("heavy"), hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2
    )


@pytest.mark.parametrize("loop", LOOPS)
async def test_ticker_keeps_ticking_while_model_decodes(heavier_checkpoint, loop):
    engine = Engine.from_pretrained(str(heavier_checkpoint), loop=loop)
    ticks = 0
    stop = asyncio.Event()

    async def ticker():
        nonlocal ticks
        while not stop.is_set():
            await asyncio.sleep(0.001)
            ticks += 1

    async with engine:
        t = asyncio.create_task(ticker())
        await asyncio.gather(
            *[engine.generate(input_ids=[i + 2] * 40, sampling=SamplingParams(max_new_tokens=24, ignore_eos=True)) for i in range(8)]
        )
        stop.set()
        await t
        steps = engine.scheduler.stats.steps
    # A loop blocked by the forward would let the ticker run only between steps.
    assert steps > 10
    assert ticks > 2 * steps, f"ticker ran {ticks} times over {steps} model steps"


async def test_idle_scheduler_sleeps_and_wakes_on_arrival():
    engine = Engine.from_pretrained("tiny")
    async with engine:
        await engine.generate(input_ids=[1], sampling=SamplingParams(max_new_tokens=1))
        iterations = engine.scheduler.stats.iterations
        await asyncio.sleep(0.3)
        # No polling: an idle loop is parked on its wake event, so it does not iterate
        # (a 1 ms polling loop would have run hundreds of iterations here).
        assert engine.scheduler.stats.iterations - iterations <= 1
        steps_before = engine.scheduler.stats.steps
        res = await engine.generate(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2))
        assert len(res.output_ids) == 2
        assert engine.scheduler.stats.steps > steps_before
