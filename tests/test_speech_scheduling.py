"""Scheduling speech streams that are being played, on the built-in tiny model (CPU):
each stream's playback state, the deadline policy's codes against FCFS's, admission by
what can be played on time (typed refusals, nothing lost), and an abandoned stream
freeing everything."""

from __future__ import annotations

import asyncio
import gc
import time

import anyio
import pytest
import torch

from omni_async import errors
from omni_async.speech import SpeechParams, SpeechPipeline, SpeechSchedule
from omni_async.speech.admission import AudioRate, FrameClock, SpeechAdmission

TEXTS = ["Hello there.", "A somewhat longer sentence for the talker to speak.", "Short one", "Numbers like 42 and 7.",
         "One more voice joins.", "And the last of six."]
VOICES = ["ryan", "vivian", "serena", "dylan", "ryan", "vivian"]
LONG = SpeechParams(max_frames=3000, ignore_eos=True, temperature=0)


async def _idle(tts: SpeechPipeline) -> dict:
    with anyio.fail_after(30):
        while True:
            info = tts.info()
            if (info["active_requests"] == 0 and info["speech"]["codec_streams"] == 0 and not info["speech"]["streams"]
                    and info["kv_free_pages"] == info["kv_total_pages"]):
                return info
            await asyncio.sleep(0.01)


async def _all_codes(tts: SpeechPipeline, params: list[SpeechParams]) -> list[torch.Tensor]:
    results = await asyncio.gather(*(tts.synthesize(t, voice=v, params=p) for t, v, p in zip(TEXTS, VOICES, params)))
    return [r.codes for r in results]


@pytest.mark.parametrize("loop", ["normal", "overlap", "async_decode"])
async def test_deadline_with_a_row_budget_writes_fcfs_codes(loop):
    params = [SpeechParams(max_frames=10 + 3 * i, temperature=0.9, seed=i, ignore_eos=True) for i in range(len(TEXTS))]
    async with SpeechPipeline.from_pretrained("tiny", loop=loop, schedule={"policy": "fcfs"}) as tts:
        assert tts.info()["scheduling_policy"] == "fcfs"
        fcfs = await _all_codes(tts, params)
        tts.set_schedule(SpeechSchedule(policy="deadline", max_decode_rows=2))
        capped = await _all_codes(tts, params)
        info = await _idle(tts)
    assert info["scheduling_policy"] == "deadline" and info["speech"]["scheduling_policy"] == "deadline"
    assert info["decode_rows_left_out"] > 0  # the budget held rows back
    for p, a, b in zip(params, fcfs, capped):
        assert a.shape == (p.max_frames, 16)
        assert torch.equal(a, b)


def test_a_codec_stream_other_than_own_or_talker_is_a_config_error():
    with pytest.raises(errors.ConfigError, match="codec_stream"):
        SpeechPipeline.from_pretrained("tiny", codec_stream="sideways")


@pytest.mark.parametrize("sms", [0, -3, 2.5, True])
def test_a_codec_sms_that_is_not_a_positive_integer_is_a_config_error(sms):
    with pytest.raises(errors.ConfigError, match="codec_sms"):
        SpeechPipeline.from_pretrained("tiny", codec_sms=sms)


async def test_each_stream_exposes_its_playback_state():
    async with SpeechPipeline.from_pretrained("tiny", loop="normal") as tts:
        stream = tts.stream(TEXTS[0], voice="ryan", params=LONG, request_id="listened")
        assert tts.playback("listened") is None  # not started until iterated
        sent = 0.0
        async for chunk in stream:
            sent += chunk.seconds
            if sent >= 0.5:
                break
        state = tts.playback("listened")
        assert state is not None and state["sent_s"] >= sent - 1e-6 and 0 < state["ttfp_s"] < 30
        assert state["slack_s"] <= state["sent_s"] and state["played_s"] >= 0
        assert tts.info()["speech"]["streams"]["listened"]["sent_s"] >= state["sent_s"]
        await stream.aclose()
        assert tts.playback("listened") is None
        await _idle(tts)


async def test_an_abandoned_stream_frees_the_talker_the_codec_and_its_playback():
    """No ``aclose``: the iterator is dropped after its first chunk and collected."""
    async with SpeechPipeline.from_pretrained("tiny", loop="overlap") as tts:
        stream = tts.stream(TEXTS[1], voice="vivian", params=LONG)
        first = await anext(stream)
        assert len(first.audio) and tts.info()["speech"]["streams"]
        del stream
        gc.collect()
        info = await _idle(tts)
        assert info["speech"]["codec_frames"] < 3000 and info["speech"]["admission_waiting"] == 0
        after = await tts.synthesize("Still fine.", voice="ryan", params=SpeechParams(max_frames=3, ignore_eos=True))
        assert after.codes.shape == (3, 16)


async def test_admission_refuses_what_cannot_start_and_loses_nothing():
    schedule = SpeechSchedule(max_streams=1, admission_wait_s=0.3, max_waiting_streams=1)
    async with SpeechPipeline.from_pretrained("tiny", loop="normal", schedule=schedule) as tts:
        long = tts.stream(TEXTS[0], voice="ryan", params=LONG)
        await anext(long)
        # One waits its 0.3 s and is refused; one more, while the line is full, at once.
        waiter = asyncio.create_task(tts.synthesize(TEXTS[2], voice="ryan", params=SpeechParams(max_frames=3)))
        while tts.info()["speech"]["admission_waiting"] == 0:
            await asyncio.sleep(0.005)
        with pytest.raises(errors.OverloadedError) as full:
            await tts.synthesize(TEXTS[3], voice="ryan", params=SpeechParams(max_frames=3))
        assert full.value.reason == "queue_full"
        with pytest.raises(errors.OverloadedError) as late:
            await waiter
        assert late.value.reason == "ttfp_budget" and "max_streams" in str(late.value)
        assert tts.info()["speech"]["admission_refused"] == {"queue_full": 1, "ttfp_budget": 1}
        # A request that waits less than its budget starts when the running stream ends.
        later = asyncio.create_task(tts.synthesize(TEXTS[4], voice="dylan", params=SpeechParams(max_frames=4, ignore_eos=True)))
        while tts.info()["speech"]["admission_waiting"] == 0:
            await asyncio.sleep(0.005)
        await long.aclose()
        assert (await later).codes.shape == (4, 16)
        info = await _idle(tts)
        assert info["active_requests"] == 0 and info["speech"]["admission_admitted"] == 2


def test_the_frame_clock_fits_the_cost_of_a_frame_by_batch_size():
    now = [0.0]
    clock = FrameClock(clock=lambda: now[0])
    assert clock.frame_seconds(4) is None
    frames = 0
    for rows in (2, 4, 8, 2, 4, 8):  # one frame for each row costs 10 ms + 5 ms a row
        for _ in range(5):
            now[0] += 0.010 + 0.005 * rows
            frames += rows
            clock.observe(rows, frames)
    assert clock.frame_seconds(16) == pytest.approx(0.010 + 0.005 * 16, rel=1e-6)
    now[0] += 5.0  # idle: the gap is not charged to the next frames
    clock.observe(8, frames)
    now[0] += 0.05
    clock.observe(8, frames + 8)
    assert clock.frame_seconds(8) == pytest.approx(0.010 + 0.005 * 8, rel=1e-6)  # on the line: no 5 s frame
    clock.observe(0, frames + 8)  # nothing runs: the pause that follows is idleness
    now[0] += 0.4
    clock.observe(8, frames + 8)
    now[0] += 0.05
    clock.observe(8, frames + 16)
    assert clock.frame_seconds(8) == pytest.approx(0.010 + 0.005 * 8, rel=1e-6)
    now[0] += 9.0  # sizes not measured for 10 s are forgotten: 8 was measured last, 2 and 4 before
    assert clock.frame_seconds(16) == pytest.approx(0.010 + 0.005 * 8, rel=1e-6)  # one size left: flat
    now[0] += 2.0
    assert clock.frame_seconds(16) is None


def test_the_codecs_audio_rate_is_a_moving_average_forgotten_when_old():
    now = [0.0]
    rate = AudioRate(weight=0.5, max_age_s=5.0, clock=lambda: now[0])
    assert rate.rate() is None
    rate.observe(2.0, 0.1)  # 2 s of audio in 0.1 s
    assert rate.rate() == pytest.approx(20.0)
    now[0] = 1.0
    rate.observe(1.0, 0.1)
    assert rate.rate() == pytest.approx(15.0)
    now[0] = 7.0
    assert rate.rate() is None  # measured under a load long gone
    rate.observe(3.0, 0.1)
    assert rate.rate() == pytest.approx(30.0)  # afresh, not averaged with the stale figure


async def test_admission_holds_streams_the_codec_cannot_feed():
    """The talker's estimate says yes (no frame measured); the codec, measured at 10 audio
    seconds a second, can feed 8 streams with the 20% margin: the 9th is held, then refused
    at the end of its wait, and admitted once a stream ends."""
    running = [8]
    rate = AudioRate()
    rate.observe(1.0, 0.1)
    gate = SpeechAdmission(lambda: running[0], FrameClock(), frame_s=0.08, wait_s=0.05, audio_rate=rate)
    assert gate.fits() == (False, "codec_behind")
    with pytest.raises(errors.OverloadedError, match="codec_behind"):
        await gate.enter()
    assert gate.refused == {"ttfp_budget": 1}
    running[0] = 7
    assert gate.fits() == (True, "")
    await gate.enter()
    gate.audio_rate = None  # the talker's measure alone: never held by the codec
    running[0] = 50
    assert gate.fits() == (True, "")


async def test_the_codec_measures_its_rate_over_rounds_its_budget_cut():
    """Six streams at once through rounds of at most two frames: ready chunks wait past each
    round's budget, so the codec's rate (what the gate reads) is measured: audio seconds
    decoded a second of rounds, at least all the audio over the wall; without a budget it
    is not measured (every round takes all that is ready)."""
    params = [SpeechParams(max_frames=24, temperature=0, ignore_eos=True)] * len(TEXTS)
    async with SpeechPipeline.from_pretrained("tiny", schedule={"codec_max_frames": 2}) as tts:
        assert tts.info()["speech"]["codec_audio_rate"] is None
        t0 = time.perf_counter()
        await _all_codes(tts, params)
        wall = time.perf_counter() - t0
        rate = tts.info()["speech"]["codec_audio_rate"]
    assert rate is not None and rate > 0
    audio = 24 * len(TEXTS) * tts.codec.frame_seconds
    assert rate >= audio / wall  # rounds are part of the wall: their rate is at least the overall one
    async with SpeechPipeline.from_pretrained("tiny", schedule={"codec_max_frames": None}) as tts:
        await _all_codes(tts, params)
        assert tts.info()["speech"]["codec_audio_rate"] is None


async def test_admission_holds_streams_the_talker_cannot_feed_in_real_time():
    now = [0.0]
    frame_clock = FrameClock(clock=lambda: now[0])
    running = [0]
    gate = SpeechAdmission(lambda: running[0], frame_clock, frame_s=0.08, wait_s=0.2, margin=0.2)
    frames = 0
    for rows in (1, 2, 3, 4):  # 10 ms a row per frame: 6 rows fit in 64 ms (80 ms less 20%), 7 do not
        for _ in range(3):
            now[0] += 0.010 * rows
            frames += rows
            frame_clock.observe(rows, frames)
    running[0] = 5
    assert gate.fits() == (True, "")
    await gate.enter()
    running[0] = 6
    assert gate.fits() == (False, "underrun_risk")
    with pytest.raises(errors.OverloadedError) as refused:
        await gate.enter()
    assert refused.value.reason == "ttfp_budget" and "underrun_risk" in str(refused.value)

    async def a_stream_ends() -> None:
        await asyncio.sleep(0.05)
        running[0] = 5
        gate.notify()

    async with anyio.create_task_group() as tg:
        tg.start_soon(a_stream_ends)
        with anyio.fail_after(0.2):
            await gate.enter()  # admitted once there is room, inside its budget
    assert gate.stats()["admission_admitted"] == 2


async def test_a_duplicate_request_id_is_refused_and_the_open_stream_carries_on():
    async with SpeechPipeline.from_pretrained("tiny", loop="normal") as tts:
        params = SpeechParams(max_frames=8, ignore_eos=True, temperature=0)
        first = tts.stream(TEXTS[0], voice="ryan", params=params, request_id="same")
        chunks = [await anext(first)]
        with pytest.raises(errors.RequestRejectedError, match="duplicate request id"):
            await tts.synthesize(TEXTS[1], voice="ryan", params=params, request_id="same")
        assert tts.playback("same") is not None
        chunks += [c async for c in first]
        assert chunks[-1].finished and sum(len(c.codes) for c in chunks) == 8
        alone = await tts.synthesize(TEXTS[0], voice="ryan", params=params)
        assert torch.equal(torch.cat([c.codes for c in chunks]), alone.codes)
        await _idle(tts)


def test_gc_freeze_freezes_the_heap_once_the_speech_pipeline_is_built():
    """``gc_freeze`` (the server's command line turns it on) freezes what the pipeline's
    build made, as it does for an engine; off by default. It was accepted and ignored."""
    gc.unfreeze()
    try:
        SpeechPipeline.from_pretrained("tiny", gc_freeze=True)
        assert gc.get_freeze_count() > 1000  # torch's, the talker's and the codec's objects
    finally:
        gc.unfreeze()
    SpeechPipeline.from_pretrained("tiny")
    assert gc.get_freeze_count() == 0
