"""The speech pipeline on the built-in tiny Qwen3-TTS model (random weights, CPU): the
three loops' codes, batching, streaming against the one-shot decode, aborts and typed
errors, through the public surface."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from omni_async import errors
from omni_async.speech import SpeechParams, SpeechPipeline

TEXTS = ["Hello there.", "A somewhat longer sentence for the talker to speak.", "Short one", "Numbers like 42 and 7."]
VOICES = ["ryan", "vivian", "serena", "dylan"]


async def _codes(loop: str, params: SpeechParams, texts=TEXTS) -> list[torch.Tensor]:
    async with SpeechPipeline.from_pretrained("tiny", loop=loop) as tts:
        results = await asyncio.gather(*(tts.synthesize(t, voice=v, language="English", params=params)
                                         for t, v in zip(texts, VOICES)))
    return [r.codes for r in results]


@pytest.mark.parametrize("params", [SpeechParams(max_frames=12, temperature=0.0),
                                    SpeechParams(max_frames=12, temperature=0.9, seed=11)], ids=["greedy", "seeded"])
async def test_the_three_loops_write_identical_codes(params):
    normal = await _codes("normal", params)
    assert all(c.shape[1] == 16 and c.shape[0] >= 1 for c in normal)
    assert len({tuple(c[:, 1:].flatten().tolist()) for c in normal}) > 1  # the rows differ from each other
    for loop in ("overlap", "async_decode"):
        other = await _codes(loop, params)
        for a, b in zip(normal, other):
            assert torch.equal(a, b), loop


async def test_seeds_change_sampled_codes_and_greedy_ignores_them():
    a = await _codes("normal", SpeechParams(max_frames=10, temperature=0.9, seed=1), TEXTS[:1])
    b = await _codes("normal", SpeechParams(max_frames=10, temperature=0.9, seed=2), TEXTS[:1])
    assert not torch.equal(a[0], b[0])
    g1 = await _codes("normal", SpeechParams(max_frames=10, temperature=0.0, seed=1), TEXTS[:1])
    g2 = await _codes("normal", SpeechParams(max_frames=10, temperature=0.0, seed=2), TEXTS[:1])
    assert torch.equal(g1[0], g2[0])


async def test_a_batch_of_mixed_lengths_gives_each_request_its_codes_alone():
    lengths = [3, 17, 9, 25]
    params = [SpeechParams(max_frames=n, temperature=0.8, seed=i, ignore_eos=True) for i, n in enumerate(lengths)]
    async with SpeechPipeline.from_pretrained("tiny", loop="overlap") as tts:
        together = await asyncio.gather(*(tts.synthesize(t, voice=v, params=p) for t, v, p in zip(TEXTS, VOICES, params)))
        alone = [await tts.synthesize(t, voice=v, params=p) for t, v, p in zip(TEXTS, VOICES, params)]
    for n, a, b in zip(lengths, together, alone):
        assert a.codes.shape == (n, 16) and a.finish_reason == "length"
        assert torch.equal(a.codes, b.codes)
        np.testing.assert_allclose(a.audio, b.audio, atol=1e-5)  # the codec batches streams: rounding only


async def test_streamed_chunks_are_the_one_shot_decode_of_the_codes():
    async with SpeechPipeline.from_pretrained("tiny", first_chunk_frames=1, max_chunk_frames=5) as tts:
        chunks = [c async for c in tts.stream("Streaming audio in pieces.", voice="vivian",
                                             params=SpeechParams(max_frames=30, ignore_eos=True, seed=5))]
        codes = torch.cat([c.codes for c in chunks])
        whole = await tts.decode(codes)
    assert len(chunks) > 3 and chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert [c.first_frame for c in chunks] == list(np.cumsum([0] + [len(c.codes) for c in chunks[:-1]]))
    assert all(len(c.audio) == len(c.codes) * 1920 for c in chunks)
    audio = np.concatenate([c.audio for c in chunks])
    assert audio.shape == whole.shape == (30 * 1920,)
    np.testing.assert_allclose(audio, whole, atol=1e-5)


async def test_max_and_min_frames_and_finish_reasons():
    async with SpeechPipeline.from_pretrained("tiny") as tts:
        capped = await tts.synthesize("Cap me.", voice="ryan", params=SpeechParams(max_frames=7, ignore_eos=True))
        assert capped.codes.shape[0] == 7 and capped.finish_reason == "length"
        assert capped.sample_rate == 24000 and capped.audio.dtype == np.float32 and len(capped.audio) == 7 * 1920
        free = await tts.synthesize("Speak freely now.", voice="ryan", params=SpeechParams(max_frames=40, min_frames=4))
        assert 4 <= free.codes.shape[0] <= 40 and free.finish_reason in ("stop", "length")
        assert int(free.codes[:, 0].max()) < 2048  # no control id ever becomes a frame


async def _idle(tts: SpeechPipeline) -> dict:
    for _ in range(200):
        info = tts.info()
        if info["active_requests"] == 0 and info["speech"]["codec_streams"] == 0 and info["kv_free_pages"] == info["kv_total_pages"]:
            return info
        await asyncio.sleep(0.01)
    return tts.info()


async def test_leaving_a_stream_early_frees_the_talker_and_the_codec():
    async with SpeechPipeline.from_pretrained("tiny", first_chunk_frames=1, max_chunk_frames=2) as tts:
        stream = tts.stream("A long utterance that nobody listens to until the end.", voice="ryan",
                            params=SpeechParams(max_frames=400, ignore_eos=True))
        got = 0
        async for chunk in stream:
            got += 1
            if got == 2:
                break
        await stream.aclose()
        assert tts.info()["active_requests"] <= 1
        info = await _idle(tts)
        assert info["active_requests"] == 0 and info["speech"]["codec_streams"] == 0
        assert info["kv_free_pages"] == info["kv_total_pages"]
        after = await tts.synthesize("Still fine.", voice="ryan", params=SpeechParams(max_frames=3, ignore_eos=True))
        assert after.codes.shape == (3, 16)


async def test_cancelling_synthesize_aborts_its_request():
    async with SpeechPipeline.from_pretrained("tiny") as tts:
        task = asyncio.create_task(tts.synthesize("Cancel me please.", voice="ryan",
                                                  params=SpeechParams(max_frames=500, ignore_eos=True)))
        while tts.info()["speech"]["codec_frames"] == 0 and tts.info()["tokens_out"] < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        info = await _idle(tts)
        assert info["active_requests"] == 0 and info["kv_free_pages"] == info["kv_total_pages"]


async def test_bad_requests_get_typed_errors_and_the_rest_carry_on():
    async with SpeechPipeline.from_pretrained("tiny", context_length=256) as tts:
        good = asyncio.create_task(tts.synthesize("In flight meanwhile.", voice="ryan",
                                                  params=SpeechParams(max_frames=20, ignore_eos=True, seed=3)))
        with pytest.raises(errors.InvalidRequestError, match="unknown voice"):
            await tts.synthesize("hi", voice="nobody")
        with pytest.raises(errors.InvalidRequestError, match="empty"):
            await tts.synthesize("   ", voice="ryan")
        with pytest.raises(errors.InvalidRequestError, match="too long|does not fit"):
            await tts.synthesize("word " * 400, voice="ryan")
        with pytest.raises(errors.InvalidRequestError, match="max_frames"):
            await tts.synthesize("hi", voice="ryan", params=SpeechParams(max_frames=10_000))
        with pytest.raises(errors.InvalidRequestError, match="temperature"):
            SpeechParams(temperature=-1.0)
        with pytest.raises(errors.InvalidRequestError, match="unknown language"):
            await tts.synthesize("hi", voice="ryan", language="klingon")
        with pytest.raises(errors.InvalidRequestError, match="unknown SpeechParams"):
            await tts.synthesize("hi", voice="ryan", params={"max_frame": 3})
        result = await good
        assert result.codes.shape == (20, 16)
        again = await tts.synthesize("In flight meanwhile.", voice="ryan", params=SpeechParams(max_frames=20, ignore_eos=True, seed=3))
        assert torch.equal(again.codes, result.codes)


async def test_voices_and_languages_come_from_the_config():
    async with SpeechPipeline.from_pretrained("tiny") as tts:
        assert "ryan" in tts.voices() and "vivian" in tts.voices()
        assert tts.languages()[0] == "auto" and "english" in tts.languages()
        assert tts.info()["speech"]["sample_rate"] == 24000


async def test_a_rows_codes_do_not_depend_on_the_other_rows_settings():
    """Top-k rows draw over their top candidates when every sampled row has a small top_k,
    over the sorted vocabulary otherwise: the same codes either way."""
    mine = SpeechParams(max_frames=16, temperature=0.9, predictor_top_k=50, top_k=50, seed=21, ignore_eos=True)
    wide = SpeechParams(max_frames=16, temperature=0.9, predictor_top_k=0, top_k=0, seed=22, ignore_eos=True)
    async with SpeechPipeline.from_pretrained("tiny") as tts:
        alone = await tts.synthesize("Mine alone.", voice="ryan", params=mine)
        beside, _ = await asyncio.gather(tts.synthesize("Mine alone.", voice="ryan", params=mine),
                                         tts.synthesize("A row with the whole vocabulary.", voice="vivian", params=wide))
    assert torch.equal(alone.codes, beside.codes)


@pytest.mark.parametrize("loop", ["normal", "overlap"])
async def test_several_frames_a_step_write_the_codes_of_one_frame_a_step(loop):
    """A talker step of three forwards per stream (as CUDA's plan runs several) writes the
    codes of one forward a step, sampled (the predictor's settings shared by a step's
    forwards) and with streams of different lengths ending mid-step."""
    params = [SpeechParams(max_frames=n, temperature=0.9, seed=3 + n, ignore_eos=True) for n in (7, 12, 4, 10)]

    async def codes(steps: int) -> list[torch.Tensor]:
        async with SpeechPipeline.from_pretrained("tiny", loop=loop, decode_steps=steps) as tts:
            results = await asyncio.gather(*(tts.synthesize(t, voice=v, params=p) for t, v, p in zip(TEXTS, VOICES, params)))
        return [r.codes for r in results]

    one, three = await codes(1), await codes(3)
    for p, a, b in zip(params, one, three):
        assert a.shape == (p.max_frames, 16)
        assert torch.equal(a, b)
