"""Readers of one step are woken a slice at a time: other tasks run between slices, and
every wake-up still happens, in order, exactly once."""

from __future__ import annotations

import asyncio
import functools

import pytest

from omni_async import SamplingParams
from omni_async.client.wakeups import SlicedWaker


async def test_other_tasks_run_between_slices():
    order: list = []
    waker = SlicedWaker(slice_size=4)

    async def other() -> None:
        order.append("other")

    waker.wake([functools.partial(order.append, i) for i in range(10)])
    assert order == [0, 1, 2, 3]  # the first slice at once
    assert waker.pending == 6
    task = asyncio.create_task(other())
    await task
    assert order.index("other") < order.index(8), order  # it ran before the last slice
    while waker.pending:
        await asyncio.sleep(0)
    assert [x for x in order if x != "other"] == list(range(10))


async def test_a_second_batch_queues_behind_the_first():
    order: list = []
    waker = SlicedWaker(slice_size=3)
    waker.wake([functools.partial(order.append, ("a", i)) for i in range(5)])
    waker.wake([functools.partial(order.append, ("b", i)) for i in range(5)])
    assert order == [("a", 0), ("a", 1), ("a", 2)]
    for _ in range(10):
        await asyncio.sleep(0)
    assert order == [("a", i) for i in range(5)] + [("b", i) for i in range(5)]


async def test_a_failing_wake_does_not_cost_the_others_theirs():
    woken: list[int] = []

    def bad() -> None:
        raise RuntimeError("boom")

    waker = SlicedWaker(slice_size=2)
    waker.wake([bad, functools.partial(woken.append, 1), bad, functools.partial(woken.append, 2)])
    for _ in range(5):
        await asyncio.sleep(0)
    assert woken == [1, 2] and waker.pending == 0


def test_without_a_running_loop_everything_is_woken_at_once():
    woken: list[int] = []
    SlicedWaker(slice_size=2).wake([functools.partial(woken.append, i) for i in range(7)])
    assert woken == list(range(7))


def test_slice_size_must_be_positive():
    with pytest.raises(ValueError):
        SlicedWaker(slice_size=0)


async def test_many_concurrent_readers_each_get_every_token(tiny_engine):
    """More readers than one slice: every stream still sees all its tokens and its end,
    the same tokens as the request alone."""
    n, new = 80, 6
    sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
    engine = tiny_engine()

    async def read(i: int) -> tuple[list[int], bool]:
        got: list[int] = []
        finished = False
        async for d in engine.stream(input_ids=[3 + i % 50, 4, 5], sampling=sp):
            got.extend(d.token_ids)
            finished = finished or d.finished
        return got, finished

    async with engine:
        results = await asyncio.gather(*(read(i) for i in range(n)))
        alone = await engine.generate(input_ids=[3 + 7, 4, 5], sampling=sp)
    assert all(len(got) == new and fin for got, fin in results)
    assert results[7][0] == alone.output_ids
