"""How a codec round's chunks become calls (omni_async.speech.codec_plan): the merged plan
puts playing streams of different chunk targets in one call of a shared length, keeps
first chunks in calls of their own, pads only ended streams, stays within the round's
frame budget and the graphs' longest chunk, and every ready stream is in exactly one call.
Then the stage under both plans: concurrent streams of mixed lengths, fed a few frames
at a time, get exactly their one-shot decode."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from omni_async.speech.codec import CodecDecoder
from omni_async.speech.codec_config import CodecConfig
from omni_async.speech.codec_plan import ROUND_PLANS, call_cost, plan_calls
from omni_async.speech.codec_stage import CodecStage
from omni_async.speech.codec_streams import CodecStream
from omni_async.speech.playback import Playback

from .test_codec_slots import F32_TOL, random_codes


def stream(pending: int, *, playing: bool = True, ended: bool = False, buffered_s: float = 2.0) -> CodecStream:
    s = CodecStream(f"s{id(object())}", None, None, playback=Playback())
    if playing:
        s.playback.on_audio(buffered_s)
    s.pending = [torch.zeros(pending, 16, dtype=torch.long)] if pending else []
    s.pending_frames, s.ended = pending, ended
    return s


def urgency(s: CodecStream) -> float:
    return s.urgency(0.08)


def check(calls, ready, spare, max_frames, max_chunk) -> None:
    """Every ready stream in exactly one call, spare ones at most once; no chunk past the
    graphs' longest; only ended streams take more frames than they have; the padded
    frames within the budget."""
    seen = [s for _, group in calls for s in group]
    assert len(seen) == len({id(s) for s in seen})
    assert {id(s) for s, _ in ready} <= {id(s) for s in seen} <= {id(s) for s, _ in ready} | {id(s) for s in spare}
    for n, group in calls:
        assert 1 <= n <= max_chunk and group
        assert all(s.pending_frames >= n or s.ended for s in group)
    assert sum(n * len(group) for n, group in calls) <= max_frames


def test_merged_puts_playing_streams_of_different_targets_in_one_call():
    """Twelve playing streams wanting 2, 4 and 8 frames, each with 8 waiting: by length,
    three calls; merged, one call of 8 (cheaper by the model)."""
    ready = [(stream(8), want) for want in (2, 4, 8) for _ in range(4)]
    by_length = plan_calls(ready, [], "by-length", None, 256, 32, urgency)
    merged = plan_calls(ready, [], "merged", None, 256, 32, urgency)
    assert sorted(n for n, _ in by_length) == [2, 4, 8]
    assert [(n, len(g)) for n, g in merged] == [(8, 12)]
    check(merged, ready, [], 256, 32)
    assert call_cost(12, 8) < sum(call_cost(len(g), n) for n, g in by_length)


def test_merged_fills_its_call_with_streams_not_yet_due_within_the_budget():
    """Two due streams and six not due, each with 4 frames waiting, a budget of 24 frames:
    the shared call of 4 takes the due ones and the most urgent spare ones up to 24."""
    ready = [(stream(4, buffered_s=1.0), 4) for _ in range(2)]
    spare = sorted((stream(4, buffered_s=2.0 + i) for i in range(6)), key=urgency)
    calls = plan_calls(ready, spare, "merged", None, 24, 32, urgency)
    check(calls, ready, spare, 24, 32)
    assert [(n, len(g)) for n, g in calls] == [(4, 6)]
    assert [s for s in calls[0][1] if s in spare] == spare[:4]
    assert plan_calls(ready, spare, "merged", 3, 24, 32, urgency)[0][1] == [s for s, _ in ready] + spare[:1]  # max_streams


def test_first_chunks_keep_their_own_call_and_run_first():
    """A new stream's first chunk is never in the shared call (its first sound waits for no
    long call) and its call goes first; playing streams share theirs."""
    new = stream(8, playing=False)
    ready = [(new, 2)] + [(stream(8), 8) for _ in range(6)]
    calls = plan_calls(ready, [], "merged", None, 256, 32, urgency)
    check(calls, ready, [], 256, 32)
    assert calls[0] == (2, [new])
    assert [(n, len(g)) for n, g in calls[1:]] == [(8, 6)]


def test_only_ended_streams_are_padded_and_never_past_the_longest_chunk():
    """An ended stream with 3 frames left joins a shared call of 8 (padded); a playing
    stream with 3 frames waiting never does. No call is longer than ``max_chunk``, however
    many frames wait."""
    ended, short = stream(3, ended=True), stream(3)
    ready = [(ended, 4), (short, 2)] + [(stream(40), 8) for _ in range(8)]
    calls = plan_calls(ready, [], "merged", None, 1024, 8, urgency)
    check(calls, ready, [], 1024, 8)
    shared = max(calls, key=lambda c: len(c[1]))
    assert shared[0] == 8 and ended in shared[1] and short not in shared[1]
    assert any(n == 2 and group == [short] for n, group in calls)


def test_merged_stays_within_a_tight_budget():
    """A budget of one frame a ready stream: the plan falls back to one frame each."""
    ready = [(stream(8), 8) for _ in range(5)]
    calls = plan_calls(ready, [stream(8)], "merged", None, 5, 32, urgency)
    check(calls, ready, [], 5, 32)
    assert [(n, len(g)) for n, g in calls] == [(1, 5)]


@pytest.fixture(scope="module")
def codec() -> CodecDecoder:
    return CodecDecoder.random(CodecConfig.tiny(), seed=0)


@pytest.mark.parametrize("plan", ROUND_PLANS)
async def test_streams_of_mixed_lengths_get_their_one_shot_decode_under_each_plan(codec, plan):
    """Five streams of 9 to 41 frames, fed three frames at a time and ended at different
    times: each stream's chunks make its one-shot decode, exactly one is terminal, and every
    slot comes back; under the merged plan calls hold streams of different targets."""
    stage = CodecStage(codec, torch.device("cpu"), first_chunk_frames=2, max_chunk_frames=8, slots=2, round_plan=plan)
    runner = asyncio.create_task(stage.run())
    try:
        all_codes = [random_codes(n, seed=80 + n) for n in (9, 17, 23, 31, 41)]
        streams = [stage.open(f"s{i}") for i in range(len(all_codes))]

        async def collect(s):
            return [c async for c in s.receive]

        readers = [asyncio.create_task(collect(s)) for s in streams]
        for start in range(0, 41, 3):
            for s, c in zip(streams, all_codes):
                if start < len(c):
                    stage.push(s, c[start:start + 3])
                    if start + 3 >= len(c):
                        stage.end(s, "stop")
            await asyncio.sleep(0.01)
        for reader, c in zip(readers, all_codes):
            chunks = await asyncio.wait_for(reader, 60)
            assert [x.finished for x in chunks] == [False] * (len(chunks) - 1) + [True]
            assert sum(len(x.codes) for x in chunks) == len(c)
            with torch.inference_mode():
                whole = codec.decode(c[None])[0].numpy()
            np.testing.assert_allclose(np.concatenate([x.audio for x in chunks]), whole, atol=F32_TOL)
        assert stage.slots.in_use() == 0 and stage.active() == 0
        assert stage.frames_decoded == sum(len(c) for c in all_codes)
        assert stage.bulk_shapes.summary()["calls"] + stage.express_calls == stage.calls
    finally:
        runner.cancel()
