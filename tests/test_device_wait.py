"""Cooperative waiting for device completion markers (the CUDA path's mechanism, driven
here by stand-in events whose completion the test controls)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from omni_async.stage.executor import DeviceTimeoutError, EventWaiter


class StandInEvent:
    """Completes after ``n`` queries (poll mode) or when set (thread mode)."""

    def __init__(self, n: int | None) -> None:
        self.n = n
        self.queries = 0
        self._done = threading.Event()

    def query(self) -> bool:
        self.queries += 1
        if self.n is not None and self.queries > self.n:
            self._done.set()
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()

    def set(self) -> None:
        self._done.set()


async def test_poll_mode_yields_to_other_coroutines_while_waiting():
    waiter = EventWaiter("poll")
    ticks = 0

    async def other():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(other())
    ev = StandInEvent(200)
    await waiter.wait(ev)
    task.cancel()
    assert ev.queries == 201
    assert ticks >= 150, "the loop was not yielded to while polling"


async def test_thread_mode_wakes_the_loop_when_the_event_completes():
    waiter = EventWaiter("thread")
    ev = StandInEvent(None)
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, ev.set)
    await waiter.wait(ev)
    waiter.close()


@pytest.mark.parametrize("mode", ["poll", "thread"])
async def test_watchdog_catches_a_completion_that_never_signals(mode):
    waiter = EventWaiter(mode, watchdog_s=0.2)
    ev = StandInEvent(None)
    with pytest.raises(DeviceTimeoutError, match="did not complete"):
        await waiter.wait(ev)
    ev.set()  # release the waiter thread
    waiter.close()


class TimedEvent:
    """Completes ``seconds`` after it is made."""

    def __init__(self, seconds: float) -> None:
        self.at = time.perf_counter() + seconds

    def query(self) -> bool:
        return time.perf_counter() >= self.at


async def test_poll_estimate_follows_steps_that_got_shorter():
    """After long steps (a prefill) the waiter sleeps most of the expected time before
    polling; once steps are short (decode), it must not keep sleeping the long time.
    The long steps are long enough (0.2 s) that a loaded machine's late wake-ups cannot
    pass for a step that got shorter."""
    waiter = EventWaiter("poll")
    for _ in range(3):
        await waiter.wait(TimedEvent(0.2))
    assert waiter.expected_s is not None and waiter.expected_s > 0.05
    for _ in range(8):
        await waiter.wait(TimedEvent(0.001))
    assert waiter.expected_s < 0.004  # eight 1 ms steps: the estimate fell, the long sleeps stopped


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError):
        EventWaiter("spin-forever")


async def test_auto_polls_for_a_stage_alone_and_blocks_in_a_thread_when_stages_share_the_loop():
    """``auto``: a lone stage polls (the event completes after a few queries); once a
    second stage serves in the same loop, a wait blocks in the waiter thread (an event that
    completes only when set, not by queries)."""
    alone, other = EventWaiter("auto"), EventWaiter("auto")
    with alone.tenant():
        polled = StandInEvent(20)
        await alone.wait(polled)
        assert polled.queries == 21
        with other.tenant():
            assert alone.blocks_in_thread() and other.blocks_in_thread()
            ev = StandInEvent(None)
            asyncio.get_running_loop().call_later(0.05, ev.set)
            await alone.wait(ev)
            assert ev.queries <= 2  # one look before waiting, no polling
        assert not alone.blocks_in_thread()
    alone.close()


async def test_two_engines_serving_in_one_loop_count_as_sharing_it():
    from omni_async import Engine, SamplingParams

    first = Engine.from_pretrained("tiny", kv_capacity_tokens=2048)
    second = Engine.from_pretrained("tiny", kv_capacity_tokens=2048)
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    async with first:
        await first.generate(input_ids=[1, 2, 3], sampling=sp)
        assert first.scheduler.info()["device_wait"] == "poll"
        async with second:
            await second.generate(input_ids=[1, 2, 3], sampling=sp)
            assert first.scheduler.info()["device_wait"] == second.scheduler.info()["device_wait"] == "thread"
        assert first.scheduler.info()["device_wait"] == "poll"
