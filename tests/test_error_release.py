"""A request that ended in an error does not keep its closed engine alive: the error a
handle raises is a fresh exception each time, so its traceback (which holds the caller's
frames, and through them the engine) is never stored in the handle. Checked with the cyclic
GC disabled, by weak reference: a closed engine whose requests raised (invalid, aborted,
cancelled, closed under them) is freed as soon as its last reference goes."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from omni_async import Engine, SamplingParams, errors

LONG = SamplingParams(max_new_tokens=400, ignore_eos=True)


async def raise_in_every_way(engine: Engine) -> None:
    with pytest.raises(errors.InvalidRequestError):  # refused by submit itself
        await engine.submit(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=2, logit_bias={"999999": 1.0}))
    bad = await engine.submit(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=2, regex="(unclosed"))
    for _ in range(2):  # the same handle raises twice: two fresh exceptions
        with pytest.raises(errors.InvalidRequestError):
            await bad.result()
    with pytest.raises(errors.InvalidRequestError):
        async for _ in bad:
            pass
    aborted = await engine.submit(input_ids=[4, 5, 6], sampling=LONG, request_id="to-abort")
    waiter = asyncio.create_task(aborted.result())
    await asyncio.sleep(0)
    await engine.abort("to-abort")
    with pytest.raises(errors.RequestAbortedError):
        await waiter
    del waiter  # a task holds its exception, whose traceback holds this frame: the caller's own cycle
    with pytest.raises(errors.RequestAbortedError):
        await aborted.result()
    cancelled = asyncio.create_task(engine.generate(input_ids=[7, 8], sampling=LONG))
    await asyncio.sleep(0.05)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled


@pytest.mark.parametrize("loop", ["normal", "async_decode"])
async def test_engines_whose_requests_raised_are_freed_without_the_cyclic_gc(loop):
    async with Engine.from_pretrained("tiny", loop=loop) as warm:  # once-per-process state
        await raise_in_every_way(warm)
    del warm
    gc.collect()
    gc.disable()
    try:
        refs = []
        for _ in range(3):
            engine = Engine.from_pretrained("tiny", loop=loop)
            async with engine:
                await raise_in_every_way(engine)
                open_at_close = asyncio.create_task(engine.generate(input_ids=[9, 9], sampling=LONG))
                await asyncio.sleep(0.05)
            with pytest.raises(errors.RequestAbortedError):
                await open_at_close
            del open_at_close
            refs.append(weakref.ref(engine))
            del engine
        alive = [r for r in refs if r() is not None]
        assert not alive, f"{len(alive)} of 3 closed engines are held by reference cycles"
    finally:
        gc.enable()
