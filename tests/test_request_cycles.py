"""A finished request is freed by reference counting: once its terminal message is sent
the stage keeps no link from its scheduling state (``Request``) back to its data
(``RequestData``), so the two no longer form a cycle that only the cyclic GC (whose full
passes stall the event loop for hundreds of ms under a burst) could free. Checked with
the cyclic GC disabled, in every loop, for results and for errors."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from omni_async import Engine, SamplingParams, errors

from .conftest import LOOPS

N = 40


@pytest.mark.parametrize("loop", LOOPS)
async def test_finished_requests_leave_no_cyclic_garbage(loop):
    async with Engine.from_pretrained("tiny", loop=loop) as engine:
        sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
        prompts = [[1 + i % 50, 2, 3, 4 + i % 7] for i in range(N)]
        await asyncio.gather(*(engine.generate(input_ids=p, sampling=sp) for p in prompts))  # warm
        gc.collect()
        gc.disable()
        try:
            await asyncio.gather(*(engine.generate(input_ids=p, sampling=sp) for p in prompts))
            aborted = await engine.submit(input_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=400, ignore_eos=True))
            await asyncio.sleep(0.05)
            await engine.abort(aborted.request_id)
            with pytest.raises(errors.RequestAbortedError):
                await aborted.result()
            del aborted
            garbage = gc.collect()
        finally:
            gc.enable()
    # before: ~17 objects per request (Request <-> RequestData and their lists)
    assert garbage < N, f"{garbage} objects of cyclic garbage after {N + 1} requests"


async def test_a_request_and_its_data_die_with_their_last_reference():
    """At the stage level: the result adapter sees each request's data; once its
    terminal is read and nothing else holds them, both objects are gone."""
    import anyio

    from omni_async import IncomingMessage, RequestPayload
    from omni_async.backends.native.builder import build_native_stack, build_scheduler
    from omni_async.config import SchedulerConfig

    seen: list[weakref.ref] = []

    def adapter(data):
        seen.append(weakref.ref(data))
        seen.append(weakref.ref(data.req))
        return len(data.output_ids)

    config = SchedulerConfig()
    sched = build_scheduler(build_native_stack("tiny", config), config, result_adapter=adapter)
    gc.collect()
    gc.disable()
    try:
        with anyio.fail_after(60):
            async with sched:
                for i in range(5):
                    payload = RequestPayload(f"r{i}", [3, 4, 5 + i], SamplingParams(max_new_tokens=4, ignore_eos=True))
                    await sched.inbox.send(IncomingMessage(f"r{i}", "new_request", payload))
                    async for msg in sched.outbox:
                        if msg.type in ("result", "error"):
                            assert msg.data == 4
                            break
                    del msg
            # closed: no step of the stage's holds a row any more (the last step's
            # batch is kept until the next one)
            alive = [r for r in seen if r() is not None]
    finally:
        gc.enable()
    assert len(seen) == 10 and not alive, f"{len(alive)} of {len(seen)} request objects still alive"
