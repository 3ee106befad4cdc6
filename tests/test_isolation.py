"""Isolation: one bad request, callback, message or fault never takes down another.

Each test sends the bad thing next to companion requests; the companions must finish
with the tokens they get when served alone, and KV must end fully free."""

from __future__ import annotations

import asyncio
import threading
import time

import anyio
import pytest

from omni_async import Engine, IncomingMessage, RequestPayload, SamplingParams, errors
from omni_async.backends.native.builder import build_native_stack, build_scheduler
from omni_async.config import SchedulerConfig
from omni_async.runners.native import NativeModelRunner

from .conftest import LOOPS, assert_kv_free
from .test_admission import Stage

COMPANIONS = {"c1": [5, 6, 7], "c2": [9, 10, 11, 12]}


async def _alone(ids: list[int], n: int = 8) -> list[int]:
    engine = Engine.from_pretrained("tiny")
    async with engine:
        return (await engine.generate(input_ids=ids, sampling=SamplingParams(max_new_tokens=n, ignore_eos=True))).output_ids


async def _check_companions(st: Stage) -> None:
    got = await st.done(*COMPANIONS)
    for msg, (rid, ids) in zip(got, COMPANIONS.items()):
        assert msg.type == "result", (rid, msg.data)
        assert msg.data.output_ids == await _alone(ids), rid


def _raising(rid_to_fail: str, fallback=None):
    def callback(*args):
        rid = next((getattr(a, "request_id", None) for a in args if getattr(a, "request_id", None)), None)
        if rid is None and args and isinstance(args[0], str):
            rid = args[0]
        if rid == rid_to_fail:
            raise RuntimeError(f"callback broke on {rid}")
        return fallback(*args) if fallback else None

    return callback


@pytest.mark.parametrize("kind", ["request_build_ready", "stream_chunk_handler", "stream_done_handler", "abort_callback"])
async def test_a_raising_stage_callback_fails_its_request_only(kind):
    fallbacks = {
        "request_build_ready": lambda payload, done: True,
        "stream_chunk_handler": lambda data, chunk: data.stream_chunks.append(chunk),
        "stream_done_handler": lambda data: None,
        "abort_callback": lambda rid: None,
    }
    async with Stage(**{kind: _raising("bad", fallbacks[kind])}) as st:
        await st.send("bad", ids=(1, 2, 3), n=200)
        for rid, ids in COMPANIONS.items():
            await st.send(rid, ids=ids, n=8)
        if kind in ("stream_chunk_handler", "stream_done_handler"):
            await st.sched.inbox.send(IncomingMessage("bad", "stream_chunk", [1]))
            await st.sched.inbox.send(IncomingMessage("bad", "stream_done"))
        if kind == "abort_callback":
            st.sched.abort("bad")
        await _check_companions(st)
        (bad,) = await st.done("bad")
        assert bad.type == "error"
        if kind != "abort_callback":  # an abort callback that raises is logged; the abort stands
            assert isinstance(bad.data, errors.RequestFailedError) and "callback broke" in str(bad.data)
        else:
            assert isinstance(bad.data, errors.RequestAbortedError)
    assert [m for m in st.messages if m.request_id == "bad" and m.type in ("result", "error")].__len__() == 1


@pytest.mark.parametrize("kind", ["request_builder", "result_adapter", "stream_output_builder"])
async def test_a_raising_builder_or_adapter_fails_its_request_only(kind):
    config = SchedulerConfig()
    stack = build_native_stack("tiny", config)
    holder = {}

    def fallback(*args):
        from omni_async.stage.emission import default_result_adapter, default_stream_output_builder

        if kind == "request_builder":
            return holder["s"].default_request_builder(*args)
        if kind == "result_adapter":
            return default_result_adapter(*args)
        return default_stream_output_builder(*args)

    def pick(*args):
        if kind == "request_builder":
            return args[0].request_id
        if kind == "result_adapter":
            return args[0].request_id
        return args[0]

    def callback(*args):
        if pick(*args) == "bad":
            raise RuntimeError("callback broke on bad")
        return fallback(*args)

    st = Stage.__new__(Stage)
    st.config, st.stack = config, stack
    st.sched = holder["s"] = build_scheduler(stack, config, **{kind: callback})
    st.messages, st.terminal = [], {}
    async with st:
        await st.send("bad", ids=(1, 2, 3), n=6)
        for rid, ids in COMPANIONS.items():
            await st.send(rid, ids=ids, n=8)
        await _check_companions(st)
        (bad,) = await st.done("bad")
        assert bad.type == "error" and isinstance(bad.data, errors.RequestFailedError)
        assert "callback broke" in str(bad.data)


async def test_malformed_inbox_messages_never_crash_the_stage():
    async with Stage() as st:
        for junk in (None, "hello", 42, IncomingMessage(["not", "hashable"], "new_request", None),
                     IncomingMessage("", "new_request", None), IncomingMessage("weird", "no_such_type", None)):
            await st.sched.inbox.send(junk)
        for rid, ids in COMPANIONS.items():
            await st.send(rid, ids=ids, n=8)
        await _check_companions(st)
        (weird,) = await st.done("weird")
        assert isinstance(weird.data, errors.InvalidRequestError) and "unknown message type" in str(weird.data)
        assert st.sched.serving
        with pytest.raises(errors.InvalidRequestError):
            st.sched.submit_threadsafe("not a message")  # type: ignore[arg-type]


class CulpritRunner(NativeModelRunner):
    """Raises in every step that prefills the request ``bad``."""

    def launch(self, scheduler_output, *, lookahead=False):
        batch = scheduler_output.batch_data
        if not batch.is_decode and any(r.rid == "bad" for r in batch.reqs):
            raise RuntimeError("this request breaks every step it is in")
        return super().launch(scheduler_output, lookahead=lookahead)


@pytest.mark.parametrize("loop", LOOPS)
async def test_a_request_that_breaks_its_steps_fails_alone(loop):
    engine = Engine.from_pretrained("tiny", loop=loop)
    engine.scheduler.runner.__class__ = CulpritRunner
    async with engine:
        sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
        bad = await engine.submit(input_ids=[1, 2, 3], sampling=sp, request_id="bad")
        companions = [await engine.submit(input_ids=ids, sampling=sp, request_id=rid) for rid, ids in COMPANIONS.items()]
        with pytest.raises(errors.RequestFailedError, match="breaks every step"):
            await bad.result()
        for handle, ids in zip(companions, COMPANIONS.values()):
            assert (await handle.result()).output_ids == await _alone(ids)
    assert_kv_free(engine)


class HungRunner(NativeModelRunner):
    """The first step with ``hang`` in it never returns (until released)."""

    release = threading.Event()

    def launch(self, scheduler_output, *, lookahead=False):
        if any(r.rid == "hang" for r in scheduler_output.batch_data.reqs):
            self.release.wait(30)
        return super().launch(scheduler_output, lookahead=lookahead)


async def test_a_hung_step_times_out_and_closing_is_bounded():
    engine = Engine.from_pretrained("tiny", step_timeout_s=0.5)
    engine.scheduler.runner.__class__ = HungRunner
    HungRunner.release.clear()
    try:
        async with engine:
            handle = await engine.submit(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=4), request_id="hang")
            with pytest.raises(errors.DeviceTimeoutError, match="step_timeout_s"):
                await handle.result()
            t0 = time.perf_counter()
        assert time.perf_counter() - t0 < 5, "closing waited for the hung step"
    finally:
        HungRunner.release.set()


async def test_stream_input_for_unknown_ids_is_bounded_and_an_ended_id_can_be_reused():
    seen = []
    async with Stage(stream_chunk_handler=lambda data, chunk: seen.append((data.request_id, chunk))) as st:
        for i in range(3000):
            await st.sched.inbox.send(IncomingMessage(f"ghost{i}", "stream_chunk", i))
        await st.send("x", n=4)
        (first,) = await st.done("x")
        assert first.type == "result"
        assert len(st.sched.admission.chunks) <= 1000
        del st.terminal["x"]
        await st.send("x", n=400)
        while "x" not in st.sched.emission.live:
            await anyio.sleep(0.005)
        await st.sched.inbox.send(IncomingMessage("x", "stream_chunk", "for the second x"))
        (second,) = await st.done("x")
        assert second.type == "result"
        assert ("x", "for the second x") in seen


async def test_admin_threadsafe_on_the_loop_thread_raises_instead_of_blocking(tiny_engine):
    engine = tiny_engine()
    async with engine:
        await engine.generate(input_ids=[1], sampling=SamplingParams(max_new_tokens=1))
        with pytest.raises(errors.AdminError, match="loop's thread"):
            engine.scheduler.admin_threadsafe("model_info")


async def test_bad_metadata_is_an_invalid_request(tiny_engine):
    engine = tiny_engine()
    async with engine:
        with pytest.raises(errors.InvalidRequestError):
            await engine.submit(input_ids=[1], metadata=5)  # type: ignore[arg-type]


@pytest.mark.parametrize("limits", [dict(loop="sideways"), dict(page_size=0), dict(no_such_limit=1), dict(step_timeout_s=-1),
                                    dict(context_length=10**9), dict(step_launch="inline")])
def test_configuration_problems_are_config_errors(limits):
    with pytest.raises(errors.ConfigError):
        Engine.from_pretrained("tiny", **limits)
