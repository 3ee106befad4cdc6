"""The pipeline under absent, late and slow readers: every conversation is answered,
leaves the pipeline once both stages ended, its id is reusable, an unread handle stalls
only its own conversation (aborted past a deadline or a size with a typed error), and
closing always finishes. Every wait is bounded, so a hang fails the test."""

from __future__ import annotations

import anyio
import pytest

from omni_async import RequestPayload, SamplingParams, errors
from omni_async.pipeline import TwoStagePipeline

HANG = 60  # seconds: far above any of these runs; reaching it is a hang


def payloads(rid: str, n_think: int = 10, n_talk: int = 6):
    return (
        RequestPayload(rid, [256, 72, 105], SamplingParams(max_new_tokens=n_think, ignore_eos=True)),
        RequestPayload(rid, [], SamplingParams(max_new_tokens=n_talk, ignore_eos=True)),
    )


def tiny_pipeline(**options) -> TwoStagePipeline:
    return TwoStagePipeline.from_pretrained("tiny", "tiny", **options)


async def until(cond, what: str) -> None:
    while not cond():
        await anyio.sleep(0.01)


def idle(pipe: TwoStagePipeline) -> bool:
    return not pipe.first.active_request_ids() and not pipe.second.active_request_ids() and pipe.backlog == 0


async def resubmit(pipe, rid: str):
    """Submit ``rid`` again once it is free: after both stages' terminal messages have been
    routed (a stage may be idle, or the reader see its error, a moment before that)."""
    while True:
        try:
            return await pipe.submit(rid, *payloads(rid))
        except errors.RequestRejectedError:
            await anyio.sleep(0.01)


async def test_a_reader_that_starts_after_both_stages_finished_is_answered_and_the_id_freed():
    async with tiny_pipeline() as pipe:
        with anyio.fail_after(HANG):
            handle = await pipe.submit("late", *payloads("late"))
            await until(lambda: idle(pipe) and handle.buffered > 0, "both stages finished")
            await anyio.sleep(0.05)
            res = await handle.results()
            assert len(res["thinker"].output_ids) == 10 and len(res["talker"].output_ids) == 6
            again = await (await pipe.submit("late", *payloads("late"))).results()
            assert len(again["talker"].output_ids) == 6


async def test_an_ended_id_can_be_submitted_again():
    async with tiny_pipeline() as pipe:
        for _ in range(3):
            with anyio.fail_after(HANG):
                res = await (await pipe.submit("same", *payloads("same"))).results()
            assert len(res["thinker"].output_ids) == 10 and len(res["talker"].output_ids) == 6


async def test_an_id_is_reusable_after_its_reader_left_early():
    async with tiny_pipeline() as pipe:
        with anyio.fail_after(HANG):
            handle = await pipe.submit("gone", *payloads("gone", n_think=200, n_talk=100))
            async for ev in handle:
                if ev.kind == "stream":
                    break  # the reader leaves: the conversation is aborted in both stages
            await until(lambda: idle(pipe), "the abort reached both stages")
            res = await (await resubmit(pipe, "gone")).results()
            assert len(res["talker"].output_ids) == 6


async def test_an_unread_handle_stalls_only_its_own_conversation_and_is_aborted_past_the_deadline():
    async with tiny_pipeline(buffer=2, stall_timeout=1.0) as pipe:
        with anyio.fail_after(HANG):
            unread = await pipe.submit("unread", *payloads("unread", n_think=200, n_talk=100))
            await until(lambda: "unread" in pipe.first.active_request_ids(), "the thinker started")
            for i in range(4):  # others are served while nobody reads "unread"
                res = await (await pipe.submit(f"other{i}", *payloads(f"other{i}"))).results()
                assert len(res["talker"].output_ids) == 6
            await until(lambda: "unread" not in pipe.first.active_request_ids()
                        and "unread" not in pipe.second.active_request_ids(), "the deadline aborted it")
            with pytest.raises(errors.ConsumerStalledError, match="unread"):
                async for _ in unread:
                    pass
            assert isinstance(errors.ConsumerStalledError("x"), errors.RequestAbortedError)
            res = await (await resubmit(pipe, "unread")).results()
            assert len(res["talker"].output_ids) == 6


async def test_an_unread_handle_is_aborted_past_its_size_bound():
    async with tiny_pipeline(buffer=2, max_held=8, stall_timeout=3600) as pipe:
        with anyio.fail_after(HANG):
            unread = await pipe.submit("big", *payloads("big", n_think=200, n_talk=100))
            await until(lambda: "big" in pipe.first.active_request_ids(), "the thinker started")
            await until(lambda: "big" not in pipe.first.active_request_ids(), "the size bound aborted it")
            with pytest.raises(errors.ConsumerStalledError, match="max_held=8"):
                async for _ in unread:
                    pass
            assert pipe.backlog == 0


async def test_closing_finishes_with_an_unread_handle():
    with anyio.fail_after(HANG):
        async with tiny_pipeline(buffer=2) as pipe:
            unread = await pipe.submit("unread", *payloads("unread", n_think=200, n_talk=100))
            await until(lambda: pipe.backlog >= 5, "the thinker produced past the buffer")
            # another conversation is served meanwhile
            res = await (await pipe.submit("other", *payloads("other"))).results()
            assert len(res["talker"].output_ids) == 6
        with pytest.raises(errors.RequestAbortedError):
            async for _ in unread:
                pass


async def test_a_late_reader_of_an_ended_conversation_leaves_its_successor_alone():
    """A handle acts on its own conversation only: once that one has ended and its id
    is taken by a new conversation, reading the old handle (to its error, or leaving it
    early) must not abort the new one."""
    async with tiny_pipeline() as pipe:
        with anyio.fail_after(HANG):
            failed = await pipe.submit("same", *payloads("same", n_think=200, n_talk=100))
            await until(lambda: "same" in pipe.first.active_request_ids(), "the thinker started")
            pipe.abort("same")
            await until(lambda: idle(pipe), "the aborted conversation ended")
            finished = None
            for old, read in ((failed, "to its error"), (None, "and leaves early")):
                if old is None:  # a conversation that ended well, never read
                    old = finished = await resubmit(pipe, "same")
                    await until(lambda: idle(pipe) and finished.buffered > 0, "it finished")
                new = await resubmit(pipe, "same")
                await until(lambda: "same" in pipe.first.active_request_ids(), "the new one started")
                if read == "to its error":
                    with pytest.raises(errors.RequestAbortedError):
                        async for _ in old:
                            pass
                else:
                    async for _ in old:
                        break
                res = await new.results()  # the new conversation runs to its end
                assert len(res["thinker"].output_ids) == 10 and len(res["talker"].output_ids) == 6, read
                await until(lambda: idle(pipe), "the new one left")
