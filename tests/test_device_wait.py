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
    polling; once steps are short (decode), it must not keep sleeping the long time."""
    waiter = EventWaiter("poll")
    for _ in range(3):
        await waiter.wait(TimedEvent(0.03))
    assert waiter.expected_s is not None and waiter.expected_s > 0.02
    started = time.perf_counter()
    for _ in range(8):
        await waiter.wait(TimedEvent(0.001))
    assert waiter.expected_s < 0.004
    assert time.perf_counter() - started < 0.18  # eight 1 ms steps, not eight ~28 ms sleeps


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError):
        EventWaiter("spin-forever")
