"""The speech server on 127.0.0.1 (``POST /v1/audio/speech``, ``GET /v1/audio/voices``),
driven by the official ``openai`` client, with the built-in ``tts-tiny`` model on the CPU.

Each test starts uvicorn in its own event loop and shuts it down at its end; expected
audio comes from the same pipeline called in-process. The tiny model's random weights
rarely reach the codec EOS, so requests give ``max_frames`` (and ``ignore_eos``).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct
import wave

import anyio
import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from omni_async.server import running_server  # noqa: E402
from omni_async.speech import SpeechParams, SpeechPipeline  # noqa: E402
from omni_async.speech.audio_format import pcm16  # noqa: E402

from .http_client import http_get  # noqa: E402

TEXT = "Hello there."
VOICE = "aiden"
FRAMES = 6
SAMPLES_PER_FRAME = 1920  # 24 kHz / 12.5 frames a second
GREEDY = {"max_frames": FRAMES, "temperature": 0, "ignore_eos": True}


@pytest.fixture
async def served():
    tts = SpeechPipeline.from_pretrained("tts-tiny", loop="normal")
    async with running_server(tts) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        try:
            yield tts, url, client
        finally:
            await client.close()


async def _speech(client, **extra) -> bytes:
    res = await client.audio.speech.create(model="tts-tiny", input=extra.pop("input", TEXT), voice=extra.pop("voice", VOICE),
                                           response_format=extra.pop("response_format", "wav"), extra_body=extra)
    return res.content


async def _streamed(client, stream_format: str, response_format: str, **extra) -> tuple[str, bytes]:
    """(content type, body) of a streamed response, read as it arrives."""
    async with client.audio.speech.with_streaming_response.create(
        model="tts-tiny", input=TEXT, voice=VOICE, response_format=response_format, stream_format=stream_format, extra_body=extra,
    ) as res:
        return res.headers["content-type"], b"".join([part async for part in res.iter_bytes()])


def _sse(body: bytes) -> list[dict]:
    events = [json.loads(block[len(b"data: "):]) for block in body.split(b"\n\n") if block.strip()]
    return events


async def _idle(tts: SpeechPipeline) -> dict:
    """Wait until no request runs: none open in the talker, no codec stream, all KV free."""
    with anyio.fail_after(30):
        while True:
            info = tts.engine.scheduler.info()
            if not tts.engine.open_requests and tts.info()["speech"]["codec_streams"] == 0 and info["kv_free_pages"] == info["kv_total_pages"]:
                return info
            await asyncio.sleep(0.02)


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_a_whole_wav_holds_the_frames_samples_of_the_pipeline(served):
    tts, _, client = served
    expected = await tts.synthesize(TEXT, voice=VOICE, params=SpeechParams(**GREEDY))
    body = await _speech(client, **GREEDY)
    with wave.open(io.BytesIO(body)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.getnframes() == FRAMES * SAMPLES_PER_FRAME
        data = w.readframes(w.getnframes())
    assert data == pcm16(expected.audio)
    assert np.abs(np.frombuffer(data, "<i2")).max() > 0  # sound, not silence


async def test_pcm_and_the_streamed_bodies_carry_the_same_samples(served):
    _, _, client = served
    pcm = await _speech(client, response_format="pcm", **GREEDY)
    assert len(pcm) == 2 * FRAMES * SAMPLES_PER_FRAME
    wav = await _speech(client, **GREEDY)
    assert wav[44:] == pcm
    kind, streamed_pcm = await _streamed(client, "audio", "pcm", **GREEDY)
    assert kind == "audio/pcm" and streamed_pcm == pcm
    kind, streamed_wav = await _streamed(client, "audio", "wav", **GREEDY)
    assert kind == "audio/wav"
    riff, fmt, data = struct.unpack("<4sI4s", streamed_wav[:12]), streamed_wav[12:36], struct.unpack("<4sI", streamed_wav[36:44])
    assert riff == (b"RIFF", 0xFFFFFFFF, b"WAVE") and data == (b"data", 0xFFFFFFFF)
    assert fmt == wav[12:36]  # the same format chunk as the whole file's
    assert streamed_wav[44:] == pcm


async def test_sse_events_decode_to_the_whole_responses_pcm(served):
    _, _, client = served
    for params in (GREEDY, {"max_frames": FRAMES, "seed": 7, "ignore_eos": True}):  # greedy, and sampled with a seed
        pcm = await _speech(client, response_format="pcm", **params)
        kind, body = await _streamed(client, "sse", "pcm", **params)
        assert kind.startswith("text/event-stream")
        events = _sse(body)
        deltas = [e for e in events if e["type"] == "speech.audio.delta"]
        assert len(deltas) >= 2  # chunk by chunk, not one blob
        assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == pcm
        assert events[-1] == {"type": "speech.audio.done",
                              "usage": {"input_tokens": len(TEXT.encode()), "output_tokens": FRAMES, "total_tokens": len(TEXT.encode()) + FRAMES}}
    greedy = await _speech(client, response_format="pcm", **GREEDY)
    assert greedy != pcm  # the seeded request sampled: the comparison above was not the greedy one twice
    _, streamed_wav = await _streamed(client, "audio", "wav", **GREEDY)
    _, body = await _streamed(client, "sse", "wav", **GREEDY)
    deltas = [base64.b64decode(e["audio"]) for e in _sse(body) if e["type"] == "speech.audio.delta"]
    assert b"".join(deltas) == streamed_wav and deltas[0][:4] == b"RIFF"  # a wav's deltas: the streamed file's bytes


async def test_concurrent_requests_each_get_the_audio_they_get_alone(served):
    """Three at once, of other lengths, voices and sampling, each as it sounds alone."""
    _, _, client = served
    asks = [dict(voice=VOICE, **GREEDY), dict(voice="vivian", input="Another, longer sentence to speak.", **{**GREEDY, "max_frames": 11}),
            dict(voice="ryan", max_frames=9, seed=3, ignore_eos=True)]
    alone = [await _speech(client, response_format="pcm", **dict(a)) for a in asks]
    together = await asyncio.gather(*(_speech(client, response_format="pcm", **dict(a)) for a in asks))
    assert [len(a) for a in together] == [len(a) for a in alone] == [2 * n * SAMPLES_PER_FRAME for n in (FRAMES, 11, 9)]
    for mine, own in zip(together, alone):  # the same codes; decoded beside other streams, the floats may differ in the last bit
        assert np.abs(np.frombuffer(mine, "<i2").astype(int) - np.frombuffer(own, "<i2")).max() <= 1


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"voice": "nobody"}, "voice"),
        ({"input": ""}, "input"),
        ({"input": "   "}, "input"),
        ({"input": "x" * 5000}, "input"),  # past the talker's 4096 positions
        ({"response_format": "mp3"}, "response_format"),
        ({"speed": 1.5}, "speed"),
        ({"instructions": "cheerful"}, "instructions"),
        ({"stream_format": "chunks"}, "stream_format"),
        ({"max_frame": 5}, "max_frame"),  # misspelt: refused, not ignored
        ({"max_frames": 0}, "max_frames"),
        ({"top_p": 2.0}, "top_p"),
        ({"language": "klingon"}, "language"),
        ({"voice": "nobody", "stream_format": "sse"}, "voice"),  # refused before a stream starts
        ({"voice": "nobody", "stream_format": "audio"}, "voice"),
    ],
)
async def test_a_bad_request_gets_400_and_the_next_one_succeeds(served, fields, param):
    tts, _, client = served
    with pytest.raises(openai.BadRequestError) as caught:
        await _speech(client, **{**GREEDY, **fields})
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param, caught.value.body
    assert caught.value.body["type"] == "invalid_request_error"
    await _idle(tts)
    assert len(await _speech(client, response_format="pcm", **GREEDY)) == 2 * FRAMES * SAMPLES_PER_FRAME


async def test_another_model_name_is_404(served):
    _, _, client = served
    with pytest.raises(openai.NotFoundError) as caught:
        await client.audio.speech.create(model="tts-1", input=TEXT, voice=VOICE, extra_body=GREEDY)
    assert caught.value.body["code"] == "model_not_found"


async def test_voices_models_health_and_metrics(served):
    tts, url, client = served
    status, text = await http_get(f"{url}/v1/audio/voices")
    voices = json.loads(text)
    assert status == 200 and voices["voices"] == tts.voices() and voices["languages"] == tts.languages()
    assert VOICE in voices["voices"] and voices["sample_rate"] == 24000
    assert [m.id for m in (await client.models.list()).data] == ["tts-tiny"]
    assert await http_get(f"{url}/health") == (200, json.dumps({"status": "ok"}, separators=(",", ":")))
    await _speech(client, **GREEDY)
    await _streamed(client, "sse", "pcm", **GREEDY)
    with pytest.raises(openai.BadRequestError):
        await _speech(client, voice="nobody", **GREEDY)
    _, text = await http_get(f"{url}/metrics")
    samples = _samples(text)
    assert not [k for k in samples if k[0] == "omni_async_speech_requests_total" and ("finish_reason", "length") not in k[1]]  # refused: not counted
    assert samples[("omni_async_speech_requests_total", (("finish_reason", "length"), ("model", "tts-tiny")))] == 2
    assert samples[("omni_async_speech_frames_total", (("model", "tts-tiny"),))] == 2 * FRAMES
    assert samples[("omni_async_speech_time_to_first_audio_seconds_count", (("model", "tts-tiny"),))] == 2
    assert samples[("omni_async_num_requests_running", ())] == 0


@pytest.mark.parametrize("stream_format", ["audio", "sse"])
async def test_a_client_leaving_mid_stream_aborts_its_request(served, stream_format):
    tts, url, client = served
    long = {"max_frames": 3000, "temperature": 0, "ignore_eos": True}
    async with client.audio.speech.with_streaming_response.create(
        model="tts-tiny", input=TEXT, voice=VOICE, response_format="pcm", stream_format=stream_format, extra_body=long,
    ) as res:
        got = 0
        async for part in res.iter_bytes():
            got += len(part)
            if got >= 4 * SAMPLES_PER_FRAME * 2:
                break
        assert tts.engine.open_requests  # still speaking while we listen
    # the response is closed here: the connection with it
    await _idle(tts)
    assert tts.info()["speech"]["codec_frames"] < 3000  # ended early, not by finishing
    _, text = await http_get(f"{url}/metrics")
    assert _samples(text)[("omni_async_speech_requests_total", (("finish_reason", "abort"), ("model", "tts-tiny")))] == 1
    assert len(await _speech(client, response_format="pcm", **GREEDY)) == 2 * FRAMES * SAMPLES_PER_FRAME


async def test_a_client_leaving_a_whole_response_aborts_its_request(served):
    tts, url, client = served
    task = asyncio.create_task(_speech(client, max_frames=3000, temperature=0, ignore_eos=True))
    with anyio.fail_after(20):
        while not tts.engine.open_requests:
            await asyncio.sleep(0.01)
    task.cancel()  # the client hangs up
    with pytest.raises(asyncio.CancelledError):
        await task
    await _idle(tts)
    assert tts.info()["speech"]["codec_frames"] < 3000
    _, text = await http_get(f"{url}/metrics")
    assert _samples(text)[("omni_async_speech_requests_total", (("finish_reason", "abort"), ("model", "tts-tiny")))] == 1


async def test_api_key_and_served_model_name():
    tts = SpeechPipeline.from_pretrained("tts-tiny", loop="normal")
    async with running_server(tts, api_key="sesame", model_name="my-voice") as url:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0) as stranger:
            with pytest.raises(openai.AuthenticationError):
                await _speech(stranger, **GREEDY)
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0) as client:
            res = await client.audio.speech.create(model="my-voice", input=TEXT, voice=VOICE, response_format="pcm", extra_body=GREEDY)
            assert len(res.content) == 2 * FRAMES * SAMPLES_PER_FRAME
            assert [m.id for m in (await client.models.list()).data] == ["my-voice"]
        assert (await http_get(f"{url}/health"))[0] == 200  # open without the key


async def test_a_request_that_cannot_start_in_time_gets_503_with_its_reason():
    tts = SpeechPipeline.from_pretrained("tts-tiny", loop="normal", schedule={"max_streams": 1, "admission_wait_s": 0.2})
    async with running_server(tts) as url:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
            long = {"max_frames": 3000, "temperature": 0, "ignore_eos": True}
            async with client.audio.speech.with_streaming_response.create(
                model="tts-tiny", input=TEXT, voice=VOICE, response_format="pcm", stream_format="audio", extra_body=long,
            ) as res:
                async for _ in res.iter_bytes():  # listening while the others are refused
                    with pytest.raises(openai.InternalServerError) as refused:
                        await _speech(client, response_format="pcm", **GREEDY)
                    with pytest.raises(openai.InternalServerError) as refused_streamed:
                        await _streamed(client, "sse", "pcm", **GREEDY)
                    assert tts.engine.open_requests  # the running stream carries on
                    break
            for exc in (refused.value, refused_streamed.value):
                assert exc.status_code == 503
                assert exc.body["code"] == "ttfp_budget" and "0.2 s" in exc.body["message"]
            await _idle(tts)
            assert len(await _speech(client, response_format="pcm", **GREEDY)) == 2 * FRAMES * SAMPLES_PER_FRAME
            _, text = await http_get(f"{url}/metrics")
    samples = _samples(text)
    assert samples[("omni_async_speech_admission_refused_total", (("model", "tts-tiny"), ("reason", "ttfp_budget")))] == 2
    assert samples[("omni_async_speech_requests_total", (("finish_reason", "abort"), ("model", "tts-tiny")))] == 1
    assert samples[("omni_async_speech_requests_total", (("finish_reason", "length"), ("model", "tts-tiny")))] == 1


async def test_audio_metrics_are_present_and_monotone(served):
    tts, url, client = served
    _, text = await http_get(f"{url}/metrics")
    before = _samples(text)
    m = (("model", "tts-tiny"),)
    assert before[("omni_async_speech_streams_in_underrun", m)] == 0 and before[("omni_async_speech_admission_waiting", m)] == 0
    for _ in range(2):
        await _speech(client, **GREEDY)
        await _streamed(client, "audio", "pcm", **GREEDY)
    await _idle(tts)
    _, text = await http_get(f"{url}/metrics")
    after = _samples(text)
    for key, value in before.items():  # every counter and histogram only grows
        if key[0].endswith(("_total", "_count", "_sum", "_bucket")):
            assert after[key] >= value, key
    assert after[("omni_async_speech_real_time_factor_count", m)] == 4
    assert after[("omni_async_speech_underrun_seconds_count", m)] == 4
    assert after[("omni_async_speech_underrun_seconds_sum", m)] >= 0
    assert after[("omni_async_speech_underruns_total", m)] >= 0
    assert after[("omni_async_speech_empty_audio_total", m)] == 0
    assert after[("omni_async_speech_chunk_frames_sum", m)] == 4 * FRAMES
    assert after[("omni_async_speech_step_seconds_count", (("model", "tts-tiny"), ("stage", "talker")))] >= 4 * FRAMES
    assert after[("omni_async_speech_step_seconds_count", (("model", "tts-tiny"), ("stage", "codec")))] >= 4
    assert after[("omni_async_speech_streams_open", m)] == 0
