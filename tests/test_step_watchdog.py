"""The step watchdog: on by default with a deadline scaled to the device and the step's
size, DeviceTimeoutError for the requests of a hung step, closing bounded; None opts out."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from omni_async import Engine, SamplingParams, errors
from omni_async.stage.watchdog import FLOOR_S, auto_deadline_s


class HangingForward:
    """A forward pre-hook on the model that blocks while armed, until released."""

    def __init__(self) -> None:
        self.armed = threading.Event()
        self.release = threading.Event()
        self.entered = threading.Event()

    def __call__(self, module, args):
        if self.armed.is_set():
            self.entered.set()
            self.release.wait(30)


def test_the_default_deadline_scales_with_the_step_and_the_device():
    small, large = auto_deadline_s("cpu", 135_000_000, 64), auto_deadline_s("cpu", 135_000_000, 4096)
    assert FLOOR_S < small < large < float("inf")
    assert auto_deadline_s("cuda", 135_000_000, 4096) < large  # a faster device, a tighter deadline


async def test_the_watchdog_is_on_by_default_and_sized_per_step():
    engine = Engine.from_pretrained("tiny")
    async with engine:
        assert engine.scheduler.info()["step_timeout_s"] == "auto"
        await engine.generate(input_ids=list(range(1, 200)), sampling=SamplingParams(max_new_tokens=1))
        prefill_deadline = engine.scheduler.info()["step_timeout_last_s"]
        await engine.generate(input_ids=[1], sampling=SamplingParams(max_new_tokens=3, ignore_eos=True))
        decode_deadline = engine.scheduler.info()["step_timeout_last_s"]
        params = engine.scheduler.info()["num_parameters"]
    assert decode_deadline == auto_deadline_s("cpu", params, 1)
    assert FLOOR_S <= decode_deadline < prefill_deadline < float("inf")


async def test_none_opts_out_of_the_watchdog():
    engine = Engine.from_pretrained("tiny", step_timeout_s=None)
    async with engine:
        await engine.generate(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2))
        info = engine.scheduler.info()
    assert info["step_timeout_s"] is None and info["step_timeout_last_s"] is None


async def test_a_hung_forward_fails_its_requests_with_device_timeout_and_close_returns():
    engine = Engine.from_pretrained("tiny", step_timeout_s=1.0)
    hang = HangingForward()
    engine.stack.runner.model.register_forward_pre_hook(hang)
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    try:
        async with engine:
            hang.armed.set()
            handles = [await engine.submit(input_ids=[3, 4 + i], sampling=sp) for i in range(2)]
            for h in handles:
                with pytest.raises(errors.DeviceTimeoutError, match="step_timeout_s=1 s"):
                    await h.result()
            assert hang.entered.is_set()
            assert engine.scheduler.info()["step_timeouts"] >= 1
            t0 = time.perf_counter()
        assert time.perf_counter() - t0 < 5, "closing waited for the hung forward"
    finally:
        hang.release.set()
    await asyncio.sleep(0)
