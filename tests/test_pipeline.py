"""Two stages in one event loop: a thinker streams into a talker."""

from __future__ import annotations

import pytest

from omni_async import RequestPayload, SamplingParams, errors
from omni_async.backends.native.builder import build_native_stack, build_scheduler
from omni_async.config import SchedulerConfig
from omni_async.pipeline import TwoStagePipeline, make_talker

from .conftest import LOOPS


def make_thinker(loop: str):
    config = SchedulerConfig(loop=loop)
    stack = build_native_stack("tiny", config)
    stack.runner.capture_hidden = True
    return build_scheduler(stack, config), stack


def payloads(rid: str, n_think: int = 12, n_talk: int = 8):
    return (
        RequestPayload(rid, [256, 72, 105], SamplingParams(max_new_tokens=n_think, ignore_eos=True)),
        RequestPayload(rid, [], SamplingParams(max_new_tokens=n_talk, ignore_eos=True)),
    )


@pytest.mark.parametrize("loop", LOOPS)
async def test_talker_starts_after_three_chunks_and_sees_them_in_order(loop):
    thinker, stack = make_thinker(loop)
    talker = make_talker(loop)
    async with TwoStagePipeline(thinker, talker) as pipe:
        handle = await pipe.submit("c1", *payloads("c1"))
        events = [ev async for ev in handle]
    thinker_tokens = [t for ev in events if ev.stage == "thinker" and ev.kind == "stream" for t in ev.data.token_ids]
    assert len(thinker_tokens) == 12
    assert all(ev.data.hidden_states.shape[0] == len(ev.data.token_ids) for ev in events if ev.stage == "thinker" and ev.kind == "stream")
    first_talker = next(i for i, ev in enumerate(events) if ev.stage == "talker")
    thinker_before = sum(1 for ev in events[:first_talker] if ev.stage == "thinker" and ev.kind == "stream")
    assert thinker_before >= 3  # partial start: after three chunks, before the thinker finished
    results = {ev.stage: ev.data for ev in events if ev.kind == "result"}
    talk = results["talker"]
    assert len(talk.output_ids) == 8
    # the talker's prompt is BOS + the first thinker tokens, in order
    assert talk.prompt_ids[0] == 256 and talk.prompt_ids[1:] == thinker_tokens[: len(talk.prompt_ids) - 1]
    assert len(talk.prompt_ids) - 1 >= 3
    assert stack.allocator.is_fully_free()


async def test_abort_of_the_thinker_mid_stream_aborts_the_talker():
    thinker, _ = make_thinker("normal")
    talker = make_talker("normal")
    async with TwoStagePipeline(thinker, talker) as pipe:
        handle = await pipe.submit("c2", *payloads("c2", n_think=400, n_talk=400))
        talker_tokens = 0
        with pytest.raises(errors.RequestAbortedError):
            async for ev in handle:
                if ev.stage == "talker" and ev.kind == "stream":
                    talker_tokens += 1
                    if talker_tokens == 3:
                        thinker.abort("c2")
        # the talker was aborted too: nothing of c2 is left in either stage
        assert "c2" not in thinker.active_request_ids()
        for _ in range(100):
            if "c2" not in talker.active_request_ids():
                break
            import asyncio

            await asyncio.sleep(0.01)
        assert "c2" not in talker.active_request_ids()
        # the pipeline still serves
        ok = await pipe.submit("c3", *payloads("c3", 5, 4))
        res = await ok.results()
        assert set(res) == {"thinker", "talker"}


async def test_talker_build_failure_reaches_the_caller_and_stops_the_thinker():
    thinker, _ = make_thinker("normal")
    talker = make_talker("normal")
    original = talker.intake.request_builder

    def failing(payload):
        if payload.request_id == "bad":
            raise RuntimeError("voice not found")
        return original(payload)

    talker.intake.request_builder = failing
    async with TwoStagePipeline(thinker, talker) as pipe:
        handle = await pipe.submit("bad", *payloads("bad", n_think=300))
        with pytest.raises(errors.RequestFailedError, match="voice not found"):
            async for _ in handle:
                pass
        good = await (await pipe.submit("good", *payloads("good", 6, 5))).results()
        assert len(good["talker"].output_ids) == 5
    assert "bad" not in thinker.active_request_ids()


async def test_a_slow_caller_backpressures_the_router():
    thinker, _ = make_thinker("normal")
    talker = make_talker("normal")
    pipe = TwoStagePipeline(thinker, talker, buffer=2)
    async with pipe:
        handle = await pipe.submit("slow", *payloads("slow", 40, 30))
        import asyncio

        # the caller reads nothing for a while: the router hands over ``buffer``
        # events and then stops routing the thinker's output, so it piles up in the
        # pipeline's backlog, not downstream
        deadline = asyncio.get_running_loop().time() + 30
        while pipe.backlog < 10:
            assert asyncio.get_running_loop().time() < deadline, "the thinker stopped producing"
            await asyncio.sleep(0.01)
        assert handle.buffered == 2
        got = [ev async for ev in handle]
        assert sum(1 for ev in got if ev.kind == "result") == 2
