"""The codec stage's lanes (omni_async.speech.codec_stage, codec_lane) on the tiny decoder
with random weights on the CPU: a round's calls go out one by one, the call holding a
first chunk first; a first chunk that becomes ready while a round is in flight takes the
express lane and goes out before that round's chunks; streamed chunks still make the
one-shot decode with the express lane on and off, every stream ends with exactly one
terminal chunk, and a stream closed while its call is in flight gives its slot back once,
after that call.

Order is made deterministic by a real decoder whose forward can be held on the lane's
thread (``tests/codec_gate.py``): a test holds a call, acts while it is in flight, then
lets it go. Nothing here measures time; waits are bounded only so that a broken stage
fails instead of hanging."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from omni_async.speech import SpeechParams, SpeechPipeline
from omni_async.speech.codec import CodecDecoder
from omni_async.speech.codec_config import CodecConfig
from omni_async.speech.codec_graphs import CallShapes
from omni_async.speech.codec_stage import CodecStage

from .codec_gate import WAIT_S, GatedDecoder, eventually
from .test_codec_slots import F32_TOL, random_codes

@pytest.fixture
def decoder() -> GatedDecoder:
    return GatedDecoder.random(CodecConfig.tiny(), seed=0)


def one_shot(decoder: CodecDecoder, codes: torch.Tensor) -> np.ndarray:
    with torch.inference_mode():
        return decoder.decode(codes[None])[0].numpy()


async def collect(stream, into: list, order: list | None = None) -> None:
    async for chunk in stream.receive:
        into.append(chunk)
        if order is not None:
            order.append(chunk.request_id)


def assert_whole(decoder: CodecDecoder, chunks: list, codes: torch.Tensor) -> None:
    """The chunks make the one-shot decode, and exactly the last one is terminal."""
    assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert sum(len(c.codes) for c in chunks) == len(codes)
    np.testing.assert_allclose(np.concatenate([c.audio for c in chunks]), one_shot(decoder, codes), atol=F32_TOL)


class Running:
    """The stage's loop as a task, cancelled at the end; ``check()`` fails if it died."""

    def __init__(self, stage: CodecStage) -> None:
        self.task = asyncio.create_task(stage.run())

    def check(self) -> None:
        assert not self.task.done(), self.task.exception() if self.task.done() else None

    async def stop(self) -> None:
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task


async def test_a_rounds_call_holding_a_first_chunk_runs_first_and_goes_out_before_the_round_ends(decoder):
    """A round of a playing stream's leftover (2 frames) and a new stream's first chunk (4
    frames): two calls. The new stream's call runs first and its chunk is delivered while
    the other call is still held (the express lane off: the round alone)."""
    stage = CodecStage(decoder, torch.device("cpu"), first_chunk_frames=4, max_chunk_frames=4, slots=4, express=False)
    running = Running(stage)
    try:
        playing_codes, new_codes = random_codes(6, seed=1), random_codes(4, seed=2)
        playing, new = stage.open("playing"), stage.open("new")
        stage.push(playing, playing_codes[:4])
        first = await asyncio.wait_for(playing.receive.receive(), WAIT_S)
        held = decoder.hold(lambda codes: codes.shape[1] == 2)  # the playing stream's leftover call
        stage.push(playing, playing_codes[4:])
        stage.end(playing, "stop")
        stage.push(new, new_codes)
        stage.end(new, "stop")
        try:
            got = await asyncio.wait_for(new.receive.receive(), WAIT_S)
            assert not held.opened.is_set()  # out while the round's other call was held
        finally:
            held.release()
        assert got.finished and len(got.codes) == 4
        assert_whole(decoder, [got], new_codes)
        rest: list = []
        await asyncio.wait_for(collect(playing, rest), WAIT_S)
        assert_whole(decoder, [first, *rest], playing_codes)
        assert [len(c.codes) for c in rest] == [2]
        running.check()
        assert stage.express_calls == 0
    finally:
        await running.stop()


async def test_a_first_chunk_ready_while_a_round_is_in_flight_goes_out_before_that_round(decoder):
    """Two new streams' first chunks in a round whose call is held; a third stream's first
    chunk becomes ready meanwhile: it takes the express lane and is delivered before the
    held round's chunks, which follow once it is let go. Every stream then makes its
    one-shot decode."""
    stage = CodecStage(decoder, torch.device("cpu"), first_chunk_frames=2, max_chunk_frames=4, slots=4)
    running = Running(stage)
    all_codes = {name: random_codes(9, seed=10 + i) for i, name in enumerate(("a", "c", "b"))}
    streams = {name: stage.open(name) for name in all_codes}
    chunks: dict[str, list] = {name: [] for name in all_codes}
    order: list[str] = []
    readers = [asyncio.create_task(collect(streams[n], chunks[n], order)) for n in all_codes]
    try:
        held = decoder.hold()  # the round's call
        stage.push(streams["a"], all_codes["a"][:2])
        stage.push(streams["c"], all_codes["c"][:2])
        assert await held.wait_entered()
        stage.push(streams["b"], all_codes["b"][:2])
        try:
            await eventually(lambda: bool(order))
            assert order == ["b"] and not held.opened.is_set()  # delivered while the round was held
        finally:
            held.release()
        for name, s in streams.items():
            stage.push(s, all_codes[name][2:])
            stage.end(s, "length")
        await asyncio.wait_for(asyncio.gather(*readers), WAIT_S)
        assert order[:3] == ["b", "a", "c"]
        for name in all_codes:
            assert_whole(decoder, chunks[name], all_codes[name])
        assert stage.express_calls == 1 and stage.express_chunks == 1
        running.check()
        assert stage.active() == 0 and stage.slots.in_use() == 0
    finally:
        await running.stop()


@pytest.mark.parametrize("express", [True, False], ids=["express", "rounds-only"])
async def test_streams_make_the_one_shot_decode_and_end_once_with_the_express_lane_on_and_off(decoder, express):
    """Six streams arriving over a round held in flight and after it, their frames coming
    in pieces: each stream's chunks make its one-shot decode and exactly its last chunk is
    terminal; first chunks that came during the held round took the express lane when it
    is on, and none did when it is off."""
    stage = CodecStage(decoder, torch.device("cpu"), first_chunk_frames=2, max_chunk_frames=8, slots=2, express=express)
    running = Running(stage)
    all_codes = [random_codes(n, seed=30 + n) for n in (11, 17, 6, 23, 3, 14)]
    streams = [stage.open(f"s{i}") for i in range(len(all_codes))]
    chunks: list[list] = [[] for _ in streams]
    readers = [asyncio.create_task(collect(s, into)) for s, into in zip(streams, chunks)]
    try:
        sent = [3, 2, 2, 2, 0, 0]  # frames pushed so far
        held = decoder.hold()
        stage.push(streams[0], all_codes[0][:3])
        assert await held.wait_entered()
        for s, c in zip(streams[1:4], all_codes[1:4]):  # first chunks ready during the held round
            stage.push(s, c[:2])
        for _ in range(10):
            await asyncio.sleep(0.01)
        held.release()
        while any(n < len(c) for n, c in zip(sent, all_codes)):  # the rest three frames at a time
            for i, (s, c) in enumerate(zip(streams, all_codes)):
                stage.push(s, c[sent[i]:sent[i] + 3])
                sent[i] = min(len(c), sent[i] + 3)
            await asyncio.sleep(0.005)
        for s in streams:
            stage.end(s, "stop")
        await asyncio.wait_for(asyncio.gather(*readers), WAIT_S)
        for c, got in zip(all_codes, chunks):
            assert_whole(decoder, got, c)
        assert (stage.express_calls > 0) == express
        running.check()
        assert stage.active() == 0 and stage.slots.in_use() == 0
    finally:
        await running.stop()


async def test_closing_streams_whose_calls_are_in_flight_frees_each_slot_once(decoder):
    """A stream closed while its round's call is held, and another closed while its first
    chunk's express call is held: neither gets a chunk, each slot comes back only once its
    call is done, and exactly once (the store serves two new streams after, without
    growing); the stage runs on."""
    stage = CodecStage(decoder, torch.device("cpu"), first_chunk_frames=2, max_chunk_frames=2, slots=2)
    running = Running(stage)
    try:
        in_round, in_express = stage.open("in-round"), stage.open("in-express")
        round_call = decoder.hold()
        stage.push(in_round, random_codes(4, seed=50))
        assert await round_call.wait_entered()
        express_call = decoder.hold()
        stage.push(in_express, random_codes(4, seed=51))
        try:
            assert await express_call.wait_entered()  # the express lane took it beside the held round
            stage.close(in_express)
            stage.close(in_round)
            assert stage.slots.in_use() == 2  # both calls still in flight: their slots wait for them
        finally:
            express_call.release()
        await eventually(lambda: stage.slots.in_use() == 1)
        assert stage.slots.in_use() == 1  # the express call is done: its slot is back, the round's is not
        round_call.release()
        await eventually(lambda: stage.slots.in_use() == 0)
        assert stage.slots.in_use() == 0 and stage.active() == 0
        assert [c async for c in in_round.receive] == [] and [c async for c in in_express.receive] == []
        next_codes = [random_codes(5, seed=52 + i) for i in range(2)]
        after = [stage.open(f"after{i}") for i in range(2)]
        for s, c in zip(after, next_codes):
            stage.push(s, c)
            stage.end(s, "stop")
        for s, c in zip(after, next_codes):
            got: list = []
            await asyncio.wait_for(collect(s, got), WAIT_S)
            assert_whole(decoder, got, c)
        assert stage.slots.capacity == 2 and stage.slots.in_use() == 0  # each slot came back once: no grow, no double free
        running.check()
    finally:
        await running.stop()


@pytest.mark.parametrize("express", [True, False], ids=["express", "rounds-only"])
async def test_the_pipelines_express_lane_is_a_schedule_option_with_the_same_audio(express):
    """``SpeechSchedule(codec_express=...)``: concurrent streams' chunks make the one-shot
    decode of their codes either way; ``info()`` counts the express lane's calls (none
    when it is off)."""
    async with SpeechPipeline.from_pretrained("tiny", schedule={"codec_express": express}) as tts:
        assert tts.codec.express is express
        results = await asyncio.gather(*(tts.synthesize(f"Express lane, stream {i}.", voice="vivian",
                                                        params=SpeechParams(max_frames=12 + 3 * i, ignore_eos=True, seed=i))
                                         for i in range(4)))
        for r in results:
            whole = await tts.decode(r.codes)
            np.testing.assert_allclose(r.audio, whole, atol=F32_TOL)
        info = tts.info()["speech"]
    if not express:
        assert info["codec_express_calls"] == 0
    # The calls by shape account for every call and every decoded frame of both lanes.
    bulk, fast = info["codec_bulk_shapes"], info["codec_express_shapes"]
    assert bulk["calls"] + fast["calls"] == info["codec_calls"] and fast["calls"] == info["codec_express_calls"]
    assert info["codec_frames"] == sum(len(r.codes) for r in results)  # (an ended stream's last call may be padded)
    assert bulk["frames_wanted"] + fast["frames_wanted"] == info["codec_frames"] + info["codec_frames_padded"]
    assert 0 < bulk["useful_share"] <= 1 and bulk["frames_computed"] >= bulk["frames_wanted"]


def test_call_shapes_count_a_graphed_calls_padding():
    """A call of n streams pads to the smallest bucket holding n; past the largest bucket it
    runs as whole buckets and one padded remainder."""
    shapes = CallShapes((1, 2, 4, 8))
    for streams, frames in [(3, 4), (3, 4), (8, 2), (11, 1)]:
        shapes.count(streams, frames)
    got = shapes.summary()
    assert got["calls"] == 4 and got["by_shape"] == {"3x4": 2, "8x2": 1, "11x1": 1}
    assert got["frames_wanted"] == 3 * 4 * 2 + 16 + 11
    assert got["frames_computed"] == 4 * 4 * 2 + 16 + (8 + 4)
