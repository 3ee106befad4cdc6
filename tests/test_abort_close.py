"""Abort (waiting, prefilling, decoding), cancellation of the awaiting task, closing with
requests in flight: one terminal message each, KV back to fully free, nothing left
running."""

from __future__ import annotations

import asyncio
import threading

import pytest

from omni_async import Engine, SamplingParams, errors

from .conftest import LOOPS, assert_kv_free


async def wait_until(cond, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.0005)


def find_req(engine: Engine, rid: str):
    return engine.stack.core.find(rid)


@pytest.mark.parametrize("loop", LOOPS)
async def test_abort_waiting_request(tiny_engine, loop):
    engine = tiny_engine(loop=loop, max_running_requests=1)
    async with engine:
        long = await engine.submit(input_ids=[5] * 20, sampling=SamplingParams(max_new_tokens=200, ignore_eos=True))
        waiting = await engine.submit(input_ids=[6] * 20, sampling=SamplingParams(max_new_tokens=5), request_id="w")
        await wait_until(lambda: find_req(engine, "w") is not None and find_req(engine, long.request_id) in engine.stack.core.running)
        assert find_req(engine, "w") in engine.stack.core.waiting
        await engine.abort("w")
        with pytest.raises(errors.RequestAbortedError):
            await waiting.result()
        res = await long.result()
        assert len(res.output_ids) == 200
    assert_kv_free(engine)


@pytest.mark.parametrize("loop", LOOPS)
async def test_abort_while_prefilling_chunks(tiny_engine, loop):
    engine = tiny_engine(loop=loop, chunked_prefill_size=32, max_prefill_tokens=32)
    async with engine:
        handle = await engine.submit(input_ids=[7] * 1500, sampling=SamplingParams(max_new_tokens=4), request_id="p")

        def mid_prefill() -> bool:
            req = find_req(engine, "p")
            return req is not None and 0 < req.num_cached < 1500

        await wait_until(mid_prefill)
        await engine.abort("p")
        with pytest.raises(errors.RequestAbortedError) as info:
            await handle.result()
        assert info.value.output_ids == []
        other = await engine.generate(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=3))
        assert len(other.output_ids) == 3
    assert_kv_free(engine)


@pytest.mark.parametrize("loop", LOOPS)
async def test_abort_while_decoding(tiny_engine, loop):
    engine = tiny_engine(loop=loop)
    async with engine:
        others = [
            await engine.submit(input_ids=[9, i + 2], sampling=SamplingParams(max_new_tokens=30, ignore_eos=True))
            for i in range(3)
        ]
        handle = await engine.submit(input_ids=[3, 4, 5], sampling=SamplingParams(max_new_tokens=500, ignore_eos=True), request_id="d")
        seen = []
        with pytest.raises(errors.RequestAbortedError) as info:
            async for delta in handle:
                seen.extend(delta.token_ids)
                if len(seen) == 5:
                    await engine.abort("d")
        assert seen[: len(info.value.output_ids)] == info.value.output_ids[: len(seen)]
        assert 5 <= len(info.value.output_ids) < 500
        for h in others:
            assert len((await h.result()).output_ids) == 30
    assert_kv_free(engine)


@pytest.mark.parametrize("loop", LOOPS)
async def test_cancelling_the_awaiting_task_aborts(tiny_engine, loop):
    engine = tiny_engine(loop=loop)
    async with engine:
        task = asyncio.create_task(
            engine.generate(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=1000, ignore_eos=True), request_id="c")
        )
        await wait_until(lambda: (r := find_req(engine, "c")) is not None and len(r.output_ids) > 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: "c" not in engine.scheduler.active_request_ids())
        # the request ended early and the engine still serves
        res = await engine.generate(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2))
        assert len(res.output_ids) == 2
    assert_kv_free(engine)


async def test_breaking_out_of_a_stream_aborts(tiny_engine):
    engine = tiny_engine()
    async with engine:
        n = 0
        async for _delta in engine.stream(input_ids=[4, 4], sampling=SamplingParams(max_new_tokens=1000, ignore_eos=True), request_id="s"):
            n += 1
            if n == 3:
                break
        await wait_until(lambda: "s" not in engine.scheduler.active_request_ids())
    assert_kv_free(engine)


async def test_abort_unknown_and_finished_ids_is_harmless(tiny_engine):
    engine = tiny_engine()
    async with engine:
        res = await engine.generate(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2), request_id="x")
        await engine.abort("x")
        await engine.abort("never-submitted")
        again = await engine.generate(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2), request_id="x")
        assert again.output_ids == res.output_ids
    assert_kv_free(engine)


@pytest.mark.parametrize("loop", LOOPS)
async def test_close_with_requests_in_flight(loop):
    before_threads = {t.ident for t in threading.enumerate()}
    engine = Engine.from_pretrained("tiny", loop=loop, max_running_requests=4)
    await engine.start()
    handles = [
        await engine.submit(input_ids=[i + 1] * (5 + i), sampling=SamplingParams(max_new_tokens=10_00, ignore_eos=True))
        for i in range(10)
    ]
    await wait_until(lambda: len(engine.stack.core.running) >= 2)
    await engine.aclose()
    for h in handles:
        with pytest.raises(errors.SchedulerClosedError):
            await h.result()
    assert_kv_free(engine)
    with pytest.raises(errors.SchedulerClosedError):
        await engine.submit(input_ids=[1])
    leftover = [t for t in threading.enumerate() if t.ident not in before_threads and t.is_alive()]
    assert leftover == [], f"threads left behind: {leftover}"
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert others == [], f"tasks left behind: {others}"


async def test_scheduler_emits_exactly_one_terminal_per_request():
    """At the stage level: count terminal messages per id through aborts and close."""
    from omni_async import IncomingMessage, RequestPayload
    from omni_async.backends.native.builder import build_native_stack, build_scheduler
    from omni_async.config import SchedulerConfig

    config = SchedulerConfig(max_running_requests=3)
    stack = build_native_stack("tiny", config)
    sched = build_scheduler(stack, config)
    terminals: dict[str, int] = {}
    import anyio

    async with anyio.create_task_group() as tg:
        tg.start_soon(sched.run)

        async def collect():
            async for msg in sched.outbox:
                if msg.type in ("result", "error"):
                    terminals[msg.request_id] = terminals.get(msg.request_id, 0) + 1

        tg.start_soon(collect)
        for i in range(12):
            n = 3 if i % 3 == 0 else 400
            await sched.inbox.send(
                IncomingMessage(f"r{i}", "new_request", RequestPayload(f"r{i}", [i + 1, 2, 3], SamplingParams(max_new_tokens=n, ignore_eos=True)))
            )
        await wait_until(lambda: len(stack.core.running) == 3)
        sched.abort("r1")  # running
        sched.abort("r10")  # waiting
        sched.abort("r11")
        sched.abort("r11")  # twice
        await wait_until(lambda: terminals.get("r1") == 1 and terminals.get("r0") == 1)
        await sched.aclose()
    assert terminals == {f"r{i}": 1 for i in range(12)}
    assert stack.allocator.is_fully_free()


async def test_engine_started_in_a_child_task_closes_from_another():
    """The first request may come from any task (here under gather); closing works from
    the parent, and two engines close in any order."""
    a = Engine.from_pretrained("tiny")
    b = Engine.from_pretrained("tiny", seed=1)
    res = await asyncio.gather(
        a.generate(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2)),
        b.generate(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2)),
    )
    assert all(len(r.output_ids) == 2 for r in res)
    await a.aclose()
    await b.aclose()
    assert_kv_free(a)
    assert_kv_free(b)
