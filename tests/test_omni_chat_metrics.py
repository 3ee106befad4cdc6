"""Spoken chat replies in ``/metrics``: a real server over the tiny Qwen3-Omni checkpoint,
OpenAI's client, and the Prometheus text scraped between replies. Each reply moves the
audio counters by exactly what it sent (frames, seconds, one time-to-first-audio
observation), the text counters by the thinker's tokens (one time-to-first-token
observation), both stages' gauges are there labelled by stage, every counter only grows,
and each reply writes one structured log line with its figures."""

from __future__ import annotations

import base64
import io
import logging
import wave

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from omni_async.server import running_server  # noqa: E402

from .http_client import http_get  # noqa: E402
from .test_omni_chain import assert_stages_free, pipeline  # noqa: E402
from .test_omni_chat_server import AUDIO, MESSAGES, REPLY, chat_folder, leave_after_first_audio  # noqa: E402,F401 (a fixture)
from .test_omni_talker import omni_model  # noqa: E402,F401 (a fixture)

P = "omni_async_"
MODEL = {"model": "ck"}


@pytest.fixture
async def served_url(chat_folder):
    pipe = pipeline(chat_folder, "overlap")
    async with running_server(pipe) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        try:
            yield pipe, client, url
        finally:
            await client.close()


async def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of ``/metrics`` by (name, labels)."""
    status, text = await http_get(f"{url}/metrics")
    assert status == 200
    return {(s.name, frozenset(s.labels.items())): s.value for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(P + name, frozenset(labels.items()))]


def moved(before: dict, after: dict, name: str, **labels: str) -> float:
    """How far a counter moved (a labelled one not yet written counts 0)."""
    key = (P + name, frozenset(labels.items()))
    return after.get(key, 0.0) - before.get(key, 0.0)


def assert_monotone(before: dict, after: dict) -> None:
    """Counters and histograms never go down (``_created`` stamps are no counts)."""
    for key, old in before.items():
        name = key[0]
        if name.endswith(("_total", "_count", "_sum", "_bucket")):
            assert after[key] >= old, (key, old, after[key])


async def _spoken(client, **extra):
    return await client.chat.completions.create(model="ck", messages=MESSAGES, max_tokens=REPLY, temperature=0,
                                                modalities=["text", "audio"], **extra)


async def _whole(client) -> dict:
    res = await _spoken(client, audio=AUDIO)
    with wave.open(io.BytesIO(base64.b64decode(res.choices[0].message.audio.data))) as wav:
        samples, rate = wav.getnframes(), wav.getframerate()
    details = res.usage.completion_tokens_details
    return {"frames": details.audio_tokens, "seconds": samples / rate, "text_tokens": details.text_tokens,
            "prompt_tokens": res.usage.prompt_tokens, "reason": res.choices[0].finish_reason}


async def _streamed(client, rate: int) -> dict:
    stream = await _spoken(client, audio={**AUDIO, "format": "pcm16"}, stream=True, stream_options={"include_usage": True})
    data, reason, usage = b"", None, None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            data += base64.b64decode((choice.delta.to_dict().get("audio") or {}).get("data", ""))
            reason = choice.finish_reason or reason
    details = usage.completion_tokens_details
    return {"frames": details.audio_tokens, "seconds": len(data) / 2 / rate, "text_tokens": details.text_tokens,
            "prompt_tokens": usage.prompt_tokens, "reason": reason}


def assert_counted(before: dict, after: dict, sent: dict) -> None:
    """One reply's figures: exactly what it sent."""
    assert moved(before, after, "speech_frames_total", model="ck") == sent["frames"] > 0
    assert moved(before, after, "speech_audio_seconds_total", model="ck") == pytest.approx(sent["seconds"], abs=1e-6)
    assert sent["seconds"] > 0
    assert moved(before, after, "speech_time_to_first_audio_seconds_count", model="ck") == 1
    assert moved(before, after, "speech_real_time_factor_count", model="ck") == 1
    assert moved(before, after, "speech_underrun_seconds_count", model="ck") == 1
    assert sum(moved(before, after, "speech_requests_total", model="ck", finish_reason=r) for r in ("stop", "length")) == 1
    assert moved(before, after, "speech_empty_audio_total", model="ck") == 0
    assert moved(before, after, "speech_chunk_frames_sum", model="ck") == sent["frames"]
    # the thinker's figures, as the text server records a chat completion
    assert moved(before, after, "generation_tokens_total", model="ck") == sent["text_tokens"] == REPLY
    assert moved(before, after, "prompt_tokens_total", model="ck") == sent["prompt_tokens"]
    assert moved(before, after, "time_to_first_token_seconds_count", model="ck") == 1
    assert moved(before, after, "e2e_request_latency_seconds_count", model="ck") == 1
    assert moved(before, after, "requests_total", model="ck", finish_reason=sent["reason"]) == 1
    for stage in ("talker", "codec"):
        assert moved(before, after, "speech_step_seconds_count", model="ck", stage=stage) > 0
    assert moved(before, after, "step_duration_seconds_count") > 0  # the thinker's steps
    for stage in ("thinker", "talker"):
        assert moved(before, after, "steps_total", stage=stage) > 0


async def test_spoken_replies_move_the_counters_by_what_they_sent(served_url, caplog):
    pipe, client, url = served_url
    caplog.set_level(logging.INFO, logger="omni_async")
    s0 = await scrape(url)
    for stage in ("thinker", "talker"):  # both stages' gauges, labelled
        assert value(s0, "num_requests_running", stage=stage) == 0
        assert value(s0, "kv_pages_total", stage=stage) > 0
    assert value(s0, "speech_streams_open", model="ck") == 0
    whole = await _whole(client)
    s1 = await scrape(url)
    streamed = await _streamed(client, pipe.sample_rate)
    s2 = await scrape(url)
    s3 = await scrape(url)
    assert_counted(s0, s1, whole)
    assert_counted(s1, s2, streamed)
    for before, after in ((s0, s1), (s1, s2), (s2, s3)):
        assert_monotone(before, after)
    for stage in ("thinker", "talker"):
        assert value(s3, "num_requests_running", stage=stage) == 0 and value(s3, "num_requests_waiting", stage=stage) == 0
    lines = [r.omni_fields for r in caplog.records if r.getMessage() == "omni_chat_response"]
    assert [(f["frames"], f["text_tokens"]) for f in lines] == [(whole["frames"], REPLY), (streamed["frames"], REPLY)]
    assert all(f["ttfp_s"] > 0 and f["worst_gap_s"] >= 0 and f["ttft_s"] > 0 for f in lines)
    await assert_stages_free(pipe)


async def test_a_reply_the_client_left_is_counted_as_aborted(served_url):
    pipe, client, url = served_url
    s0 = await scrape(url)
    await leave_after_first_audio(client)
    await assert_stages_free(pipe)
    s1 = await scrape(url)
    assert moved(s0, s1, "speech_requests_total", model="ck", finish_reason="abort") == 1
    assert moved(s0, s1, "requests_total", model="ck", finish_reason="abort") == 1
    assert moved(s0, s1, "speech_time_to_first_audio_seconds_count", model="ck") == 1
    assert moved(s0, s1, "speech_real_time_factor_count", model="ck") == 0  # only completed replies
    assert_monotone(s0, s1)


async def test_a_refused_spoken_request_is_counted_as_refused(served_url):
    """A prompt past the thinker's context is refused at the reply's first event: a 400,
    counted with the refusals, no utterance; the next reply is counted as usual."""
    pipe, client, url = served_url
    s0 = await scrape(url)
    long = [{"role": "user", "content": "x" * (pipe.thinker.scheduler.limits.context_length + 8)}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="ck", messages=long, temperature=0, modalities=["text", "audio"], audio=AUDIO,
                                                 stream=stream)
    s1 = await scrape(url)
    assert moved(s0, s1, "requests_refused_total", model="ck", status="400") == 2
    for name in ("speech_requests_total", "requests_total"):
        assert sum(v for (n, _), v in s1.items() if n == P + name) == sum(v for (n, _), v in s0.items() if n == P + name)
    assert moved(s0, s1, "speech_time_to_first_audio_seconds_count", model="ck") == 0
    assert_monotone(s0, s1)
    sent = await _whole(client)
    assert_counted(s1, await scrape(url), sent)
