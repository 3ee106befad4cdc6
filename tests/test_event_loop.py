"""The event loop stays free: a co-located coroutine keeps ticking while the CPU model
decodes, and an idle scheduler burns no CPU and wakes on arrival."""

from __future__ import annotations

import asyncio
import pytest
import torch

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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: steps launched inline on the loop thread")
@pytest.mark.parametrize("loop", LOOPS)
async def test_other_tasks_run_between_any_two_inline_steps(loop):
    """With decode launched inline and a device that keeps up, every await of a loop
    iteration can return at once; the loop still yields once per iteration, so a task
    that only ever yields (``sleep(0)``) sees at most a couple of steps between its turns."""
    engine = Engine.from_pretrained("tiny", device="cuda", loop=loop, step_launch="inline", decode_steps=1)
    seen: list[int] = []
    stop = asyncio.Event()

    async def spinner():
        while not stop.is_set():
            seen.append(engine.scheduler.stats.steps)
            await asyncio.sleep(0)

    async with engine:
        task = asyncio.create_task(spinner())
        await asyncio.gather(
            *[engine.generate(input_ids=[i + 2] * 8, sampling=SamplingParams(max_new_tokens=64, ignore_eos=True)) for i in range(16)]
        )
        stop.set()
        await task
    gaps = [b - a for a, b in zip(seen, seen[1:])]
    assert engine.scheduler.stats.steps > 60
    assert max(gaps) <= 2, f"{max(gaps)} steps ran without the spinner getting a turn"
