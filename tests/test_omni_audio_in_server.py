"""Audio in a chat: messages with audio parts through the chat template (the Python API),
and OpenAI's ``input_audio`` parts over HTTP (a real OpenAI client against a real server
on 127.0.0.1), on the hearing checkpoint of tests/test_omni_audio_in.py with a byte-level
tokenizer and a template that writes Qwen3-Omni's audio placeholder. The reply to a
message with audio is transformers' ``generate`` on the processor's inputs; over HTTP it
is the Python API's reply to the same samples; a broken payload is a 400 naming the part,
and the next request succeeds."""

from __future__ import annotations

import base64
import io
import json
import shutil
import wave

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from omni_async.errors import InvalidRequestError  # noqa: E402
from omni_async.server import running_server  # noqa: E402
from omni_async.speech.audio_format import pcm16  # noqa: E402
from omni_async.speech.omni_hearing import split_audio_parts  # noqa: E402
from omni_async.text.chat import render_chat_ids  # noqa: E402

from .test_omni_audio_in import AUDIO_END, AUDIO_START, RATE, THINKER_EOS, hearing_model, reference_generate, waveform  # noqa: E402,F401
from .test_omni_chain import assert_stages_free, pipeline  # noqa: E402
# ``served``: a real server on this module's ``chat_folder`` (a fixture resolves its own
# dependencies where the test asks for it)
from .test_omni_chat_server import assert_same_samples, byte_tokenizer, served  # noqa: E402,F401
from .test_omni_talker import AUDIO, IDS  # noqa: E402

TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
            "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'audio' %}"
            "<|audio_start|><|audio_pad|><|audio_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
            "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
REPLY = 6
VOICE = {"voice": "ethan", "format": "wav"}


def hearing_tokenizer() -> dict:
    """The chat tests' byte-level tokenizer with Qwen3-Omni's audio tokens at the tiny
    checkpoint's ids."""
    tok = byte_tokenizer()
    named = [(IDS["tts_bos_token_id"], "<tts_text_bos>"), (IDS["tts_eos_token_id"], "<tts_text_eod>"),
             (IDS["tts_pad_token_id"], "<tts_pad>"), (AUDIO, "<|audio_pad|>"), (AUDIO_START, "<|audio_start|>"),
             (AUDIO_END, "<|audio_end|>")]  # the ids between 505 and 510 in order: the tokenizer numbers them so
    for token_id, text in named:
        tok["added_tokens"].append({"id": token_id, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                                    "normalized": False, "special": True})
    return tok


@pytest.fixture(scope="module")
def chat_folder(hearing_model, tmp_path_factory):
    folder, _ = hearing_model
    out = tmp_path_factory.mktemp("omni_hearing_chat") / "ck"
    shutil.copytree(folder, out)
    (out / "tokenizer.json").write_text(json.dumps(hearing_tokenizer()))
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|im_end|>"}))
    return out


def quantised(samples: np.ndarray) -> np.ndarray:
    """The samples a 16-bit WAV file of ``samples`` carries, as floats."""
    return (np.frombuffer(pcm16(samples), dtype="<i2").astype(np.float32) / 32768.0).astype(np.float32)


def wav_bytes(samples: np.ndarray, rate: int = RATE, width: int = 2, channels: int = 1) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as wav:
        wav.setnchannels(channels)
        wav.setsampwidth(width)
        wav.setframerate(rate)
        if width == 2:
            wav.writeframes(np.repeat(np.frombuffer(pcm16(samples), dtype="<i2"), channels).tobytes())
        else:
            wav.writeframes(bytes(len(samples) * width * channels))
    return buf.getvalue()


def messages_with(samples: np.ndarray) -> list[dict]:
    return [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "what is this? "},
                                         {"type": "audio", "audio": samples, "sample_rate": RATE},
                                         {"type": "text", "text": " say it"}]}]


def openai_messages(data: bytes, fmt: str = "wav") -> list[dict]:
    return [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "what is this? "},
                                         {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}},
                                         {"type": "text", "text": " say it"}]}]


async def test_a_message_with_audio_is_heard_as_generate_hears_it(hearing_model, chat_folder):
    """A user turn of text, audio and text through the template: the prompt holds the
    template's placeholder expanded to the audio's rows, and the reply's tokens and the
    talker's frames are transformers' ``generate`` on the processor's inputs."""
    _, model = hearing_model
    samples = waveform(2.2, 3)
    async with pipeline(chat_folder, "overlap") as pipe:
        template_messages, audios = split_audio_parts(messages_with(samples))
        rendered = render_chat_ids(pipe.thinker.tokenizer, template_messages)
        assert rendered.count(AUDIO) == 1 and rendered[rendered.index(AUDIO) - 1] == AUDIO_START
        ids, thinker, codes = reference_generate(model, rendered, [samples], reply=REPLY, frames=12)
        result = await pipe.chat(messages_with(samples), sampling=dict(max_new_tokens=REPLY, stop_token_ids=[THINKER_EOS]), max_frames=12)
        assert result.output_ids == thinker.sequences[0, len(ids):].tolist()
        assert result.codes.tolist() == codes.tolist() and codes.shape[0] == 12
        with pytest.raises(InvalidRequestError, match="audio placeholder"):  # a template that drops the audio part
            pipe.thinker.tokenizer.chat_template = TEMPLATE.replace("<|audio_start|><|audio_pad|><|audio_end|>", "")
            await pipe.chat(messages_with(samples))
        await assert_stages_free(pipe)


async def _chat(client, messages, **extra):
    return await client.chat.completions.create(model="ck", messages=messages, max_tokens=REPLY, temperature=0,
                                                modalities=["text", "audio"], audio=VOICE, **extra)


async def test_input_audio_over_http_is_the_python_apis_reply(served):
    """An OpenAI client sends a WAV of 16-bit samples as input_audio: the spoken reply's
    text and audio are the Python API's for those samples, whole and streamed; the usage
    counts the prompt with the audio's placeholders expanded."""
    pipe, client = served
    samples = waveform(2.2, 3)
    heard = quantised(samples)
    want = await pipe.chat(messages_with(heard), sampling=dict(max_new_tokens=REPLY))
    prompt = await pipe.thinker_prompt(messages_with(heard))
    res = await _chat(client, openai_messages(wav_bytes(samples)))
    message = res.choices[0].message
    assert message.audio.transcript == want.text
    with wave.open(io.BytesIO(base64.b64decode(message.audio.data))) as wav:
        assert_same_samples(wav.readframes(wav.getnframes()), pcm16(want.audio))
    assert res.usage.prompt_tokens == len(prompt.ids) > 40
    assert res.usage.completion_tokens_details.audio_tokens == want.codes.shape[0]
    stream = await _chat(client, openai_messages(wav_bytes(samples)), stream=True)
    transcript = []
    async for chunk in stream:
        for choice in chunk.choices:
            audio = choice.delta.to_dict().get("audio") or {}
            transcript.append(audio.get("transcript", ""))
    assert "".join(transcript) == want.text
    # a stereo file is heard as the mean of its channels
    res = await _chat(client, openai_messages(wav_bytes(samples, channels=2)))
    assert res.choices[0].message.audio.transcript == want.text
    # a text reply (no modalities) to the same audio: the thinker alone, the same text
    text = await client.chat.completions.create(model="ck", messages=openai_messages(wav_bytes(samples)), max_tokens=REPLY,
                                                temperature=0)
    assert text.choices[0].message.content == want.text and text.usage.prompt_tokens == len(prompt.ids)
    await assert_stages_free(pipe)


async def test_audio_at_another_rate_is_resampled_and_heard(served):
    """A 48 kHz WAV (what most devices record): heard as its samples resampled to 16 kHz
    (the pipeline's resampler, the Python API's path too), with the placeholders of its
    length at 16 kHz."""
    from omni_async.models.resample import resample

    pipe, client = served
    rate = 48_000
    t = np.arange(int(2.2 * rate)) / rate
    samples = (0.2 * np.sin(2 * np.pi * 440 * t) + 0.1 * np.sin(2 * np.pi * 2300 * t)).astype(np.float32)
    heard = quantised(samples)
    at_16k = resample(heard, rate, RATE)
    want = await pipe.chat(messages_with(at_16k), sampling=dict(max_new_tokens=REPLY))
    prompt = await pipe.thinker_prompt(messages_with(at_16k))
    res = await _chat(client, openai_messages(wav_bytes(samples, rate=rate)))
    assert res.choices[0].message.audio.transcript == want.text
    assert res.usage.prompt_tokens == len(prompt.ids) > 40
    direct = [{"role": "user", "content": [{"type": "audio", "audio": heard, "sample_rate": rate}]}]
    assert (await pipe.thinker_prompt(direct)).ids == (await pipe.thinker_prompt(
        [{"role": "user", "content": [{"type": "audio", "audio": at_16k, "sample_rate": RATE}]}])).ids
    await assert_stages_free(pipe)


async def test_a_model_that_does_not_hear_refuses_input_audio():
    from omni_async import Engine

    async with running_server(Engine.from_pretrained("tiny", loop="normal")) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="input_audio parts need a model that hears"):
            await client.chat.completions.create(model="tiny", messages=openai_messages(wav_bytes(waveform(1.0, 1))), max_tokens=3)
        res = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert res.choices[0].finish_reason
        await client.close()


BROKEN = [
    ("not base64 %%%", "wav", "messages[1].content[1].input_audio.data"),
    (base64.b64encode(b"RIFF....WAVEnot really").decode(), "wav", "messages[1].content[1].input_audio.data"),
    ("wav-8bit", "wav", "messages[1].content[1].input_audio.data"),
    ("wav-500Hz", "wav", "messages[1].content[1].input_audio"),
    ("wav", "mp3", "messages[1].content[1].input_audio.format"),
]


@pytest.mark.parametrize("data,fmt,param", BROKEN, ids=["base64", "not-wav", "8-bit", "500Hz", "mp3"])
async def test_a_broken_audio_payload_is_a_400_and_the_next_request_succeeds(served, data, fmt, param):
    pipe, client = served
    samples = waveform(1.0, 4)
    payload = {"wav-8bit": lambda: base64.b64encode(wav_bytes(samples, width=1)).decode(),
               "wav-500Hz": lambda: base64.b64encode(wav_bytes(samples, rate=500)).decode(),
               "wav": lambda: base64.b64encode(wav_bytes(samples)).decode()}.get(data, lambda: data)()
    messages = openai_messages(b"")
    messages[1]["content"][1]["input_audio"] = {"data": payload, "format": fmt}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            await _chat(client, messages, stream=stream)
        assert err.value.status_code == 400 and err.value.body["param"] == param
    res = await _chat(client, openai_messages(wav_bytes(samples)))
    assert res.choices[0].message.audio.data and res.choices[0].message.audio.transcript is not None
    await assert_stages_free(pipe)
