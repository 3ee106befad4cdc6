"""The per-step host path: the inline default stream emission gives the same deltas as
the guarded builder path, streams end once, the ``gc_freeze`` option, and the full GC pass
that ends a CUDA build."""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

from omni_async import Engine, SamplingParams
from omni_async.backends.native.builder import build_native_stack, build_scheduler
from omni_async.client.heap import configure_gc
from omni_async.config import SchedulerConfig
from omni_async.errors import ConfigError, InvalidRequestError
from omni_async.stage.emission import default_stream_output_builder

from .conftest import LOOPS

PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [3] * 20, [40, 41]]


def _sampling(i: int) -> SamplingParams:
    # Mixed rows: logprobs on some, a length limit that differs, sampled and greedy.
    return SamplingParams(
        max_new_tokens=5 + 3 * i, ignore_eos=True, return_logprob=i % 2 == 0,
        temperature=0.0 if i < 2 else 0.9, seed=i,
    )


async def _streams(engine: Engine) -> list[tuple]:
    """Per request: its tokens, logprobs, how many deltas said finished, and the last
    delta's finish reason (a lagging reader gets merged deltas, so the split varies)."""
    async with engine:
        out = []
        for i, ids in enumerate(PROMPTS):
            tokens, logprobs, finished, reason = [], [], 0, None
            async for d in engine.stream(input_ids=ids, sampling=_sampling(i)):
                tokens += d.token_ids
                if d.logprobs is not None:
                    logprobs += d.logprobs
                finished += d.finished
                reason = d.finish_reason
            out.append((tokens, logprobs, finished, reason))
        return out


def _engine(loop: str, builder=None) -> Engine:
    config = SchedulerConfig(loop=loop)
    stack = build_native_stack("tiny", config)
    kw = {"stream_output_builder": builder} if builder is not None else {}
    sched = build_scheduler(stack, config, **kw)
    return Engine(sched, tokenizer=None, stack=stack)


@pytest.mark.parametrize("loop", LOOPS)
async def test_inline_stream_messages_equal_the_builder_path(loop):
    calls = []

    def wrapped(*args):  # not the default builder itself: the guarded path runs
        calls.append(args[0])
        return default_stream_output_builder(*args)

    inline = await _streams(_engine(loop))
    guarded = await _streams(_engine(loop, wrapped))
    assert calls, "the custom builder was not called"
    assert inline == guarded
    for i, (tokens, logprobs, finished, reason) in enumerate(inline):
        assert len(tokens) == 5 + 3 * i
        assert len(logprobs) == (len(tokens) if i % 2 == 0 else 0)
        assert finished == 1 and reason == "length"


async def test_gc_freeze_freezes_the_heap_after_loading():
    gc.unfreeze()
    try:
        engine = Engine.from_pretrained("tiny", gc_freeze=True)
        assert gc.get_freeze_count() > 1000  # torch's and the model's objects
        async with engine:
            res = await engine.generate(input_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=4, ignore_eos=True))
        assert len(res.output_ids) == 4
    finally:
        gc.unfreeze()
    engine = Engine.from_pretrained("tiny")
    assert gc.get_freeze_count() == 0  # off by default


async def test_a_burst_up_to_the_running_limit_grows_no_slot_table():
    # Each running request's slot is made at start (backends/native/stack.py): the tables
    # used to double from 64 slots, host and device, inside a burst's first steps.
    engine = Engine.from_pretrained("tiny", max_running_requests=200)
    async with engine:
        before = (await engine.model_info())["data"]["slot_table_grows"]
        results = await asyncio.gather(*(engine.generate(input_ids=[3 + i % 50] * (2 + i % 9),
                                                         sampling=SamplingParams(max_new_tokens=3, ignore_eos=True))
                                         for i in range(200)))
        after = (await engine.model_info())["data"]["slot_table_grows"]
    assert [len(r.output_ids) for r in results] == [3] * 200
    assert after == before


class FullPasses:
    """Python's full (generation 2) GC passes that end inside the block."""

    def __enter__(self) -> "FullPasses":
        self.count = 0
        gc.callbacks.append(self._seen)
        return self

    def _seen(self, phase: str, info: dict) -> None:
        self.count += phase == "stop" and info["generation"] == 2

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._seen)


def test_a_cuda_build_ends_with_a_full_gc_pass_a_cpu_build_does_not():
    # The objects a build promotes would otherwise be walked by a full pass inside the
    # first requests (client/heap.py); the CPU's build is not made a tenth of a second longer.
    with FullPasses() as cuda:
        configure_gc(False, None, "cuda:0")
    with FullPasses() as cpu:
        configure_gc(False, None, "cpu")
    assert (cuda.count, cpu.count) == (1, 0)
    gc.disable()
    try:
        with FullPasses() as disabled:
            configure_gc(False, None, "cuda")
        assert disabled.count == 0  # a process that turned the GC off keeps it off
    finally:
        gc.enable()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_a_cuda_engines_first_requests_meet_no_full_gc_pass():
    engine = Engine.from_pretrained("tiny", device="cuda")
    sampling = [SamplingParams(max_new_tokens=8 + i % 24, ignore_eos=True, temperature=0.6 * (i % 2)) for i in range(128)]
    with FullPasses() as served:
        async with engine:
            await asyncio.gather(*(engine.generate(input_ids=[3 + i % 50] * (4 + i % 60), sampling=sp)
                                   for i, sp in enumerate(sampling)))
    assert served.count == 0


def test_gc_gen0_threshold_is_applied():
    before = gc.get_threshold()
    try:
        Engine.from_pretrained("tiny", gc_gen0_threshold=12345)
        assert gc.get_threshold() == (12345, *before[1:])
    finally:
        gc.set_threshold(*before)


@pytest.mark.parametrize("kw", [{"gc_freeze": "yes"}, {"gc_gen0_threshold": 0}, {"gc_gen0_threshold": 1.5}])
def test_gc_options_are_checked(kw):
    with pytest.raises(ConfigError, match=next(iter(kw))):
        SchedulerConfig(**kw)


async def test_stream_submits_when_first_read_and_closes_like_a_generator(tiny_engine):
    """``Engine.stream`` returns the handle's own iteration (no wrapping generator): it
    still submits only when first read, raises a bad request's error there, and its
    ``aclose`` ends the request."""
    engine = tiny_engine(loop="overlap")
    async with engine:
        bad = engine.stream(input_ids=[1, 2], bogus=1)  # nothing is submitted until it is read
        with pytest.raises(InvalidRequestError):
            await bad.__anext__()
        with pytest.raises(StopAsyncIteration):
            await bad.__anext__()
        sp = SamplingParams(max_new_tokens=1000, ignore_eos=True)
        stream = engine.stream(input_ids=[4, 4], sampling=sp, request_id="c")
        assert "c" not in engine.scheduler.active_request_ids()
        first = await stream.__anext__()
        assert first.token_ids and not first.finished
        await stream.aclose()
        for _ in range(2000):  # the abort lands at the next step boundary
            if "c" not in engine.scheduler.active_request_ids():
                break
            await asyncio.sleep(0.005)
        assert "c" not in engine.scheduler.active_request_ids()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        again = await engine.generate(input_ids=[4, 4], sampling=SamplingParams(max_new_tokens=3), request_id="c")
        assert len(again.output_ids) == 3
