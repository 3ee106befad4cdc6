"""Chat with audio out over HTTP: a real server on 127.0.0.1 over a Qwen3-Omni pipeline
(the tiny random checkpoint of tests/test_omni_talker.py, with a byte-level tokenizer and
a chat template added), OpenAI's client against it. A spoken reply carries the text and
the audio the Python API gives for the same prompt, whole and streamed; bad audio
fields get a 400 naming the field; a text server asked for audio says so; a client that
leaves a stream ends the reply in every stage."""

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

from omni_async import Engine, SamplingParams  # noqa: E402
from omni_async.server import running_server  # noqa: E402
from omni_async.speech.audio_format import pcm16  # noqa: E402
from omni_async.text.chat import render_chat_ids  # noqa: E402

from .test_omni_chain import assert_stages_free, pipeline  # noqa: E402
from .test_omni_talker import IDS, omni_model  # noqa: E402,F401 (a fixture)

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say hi"}]
TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
REPLY = 7  # thinker tokens
AUDIO = {"voice": "chelsie", "format": "wav"}


def byte_tokenizer() -> dict:
    """tokenizer.json of a byte-level tokenizer whose special tokens sit at the tiny
    checkpoint's ids (``<|im_start|>`` 500, ``<|im_end|>`` 501, the roles 502-504)."""
    from tokenizers import pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord))}
    vocab.update({f"<unused_{i}>": i for i in range(len(vocab), 500)})
    names = {"im_start_token_id": "<|im_start|>", "im_end_token_id": "<|im_end|>", "user_token_id": "user",
             "assistant_token_id": "assistant", "system_token_id": "system"}
    added = [{"id": IDS[key], "content": text, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for key, text in sorted(names.items(), key=lambda kv: IDS[kv[0]])]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False, "vocab": vocab, "merges": []}}


@pytest.fixture(scope="module")
def chat_folder(omni_model, tmp_path_factory):
    folder, _ = omni_model
    out = tmp_path_factory.mktemp("omni_chat") / "ck"
    shutil.copytree(folder, out)
    (out / "tokenizer.json").write_text(json.dumps(byte_tokenizer()))
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|im_end|>"}))
    return out


@pytest.fixture
async def served(chat_folder):
    pipe = pipeline(chat_folder, "overlap")
    async with running_server(pipe) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        try:
            yield pipe, client
        finally:
            await client.close()


def assert_same_samples(got: bytes, want: bytes) -> None:
    """The same 16-bit samples, up to one step: the codec's chunks follow the listener,
    so two runs may cut a reply differently, and a chunked decode equals the one-shot one
    within float32 rounding (docs/speech.md), which can move a sample across a rounding edge."""
    a, b = np.frombuffer(got, dtype="<i2").astype(int), np.frombuffer(want, dtype="<i2").astype(int)
    assert a.shape == b.shape and np.abs(a - b).max() <= 1


async def _chat(client, **extra):
    return await client.chat.completions.create(model="ck", messages=MESSAGES, max_tokens=REPLY, temperature=0, **extra)


async def _expected(pipe):
    """The Python API's reply to the same prompt: text, and audio as 16-bit PCM bytes."""
    result = await pipe.chat(MESSAGES, voice=AUDIO["voice"], sampling=SamplingParams(max_new_tokens=REPLY, temperature=0))
    assert result.codes.shape[0] > 4 and result.text
    return result, pcm16(result.audio)


async def test_a_whole_spoken_reply_holds_the_pipelines_text_and_audio(served):
    pipe, client = served
    result, pcm = await _expected(pipe)
    res = await _chat(client, modalities=["text", "audio"], audio=AUDIO)
    message, choice = res.choices[0].message, res.choices[0]
    assert message.content is None and message.audio.transcript == result.text
    assert message.audio.id.startswith("audio_") and message.audio.expires_at > 0
    with wave.open(io.BytesIO(base64.b64decode(message.audio.data))) as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (pipe.sample_rate, 1, 2)
        assert_same_samples(wav.readframes(wav.getnframes()), pcm)
    assert choice.finish_reason == result.finish_reason
    assert res.usage.completion_tokens_details.audio_tokens == result.codes.shape[0]
    assert res.usage.prompt_tokens == len(render_chat_ids(pipe.thinker.tokenizer, MESSAGES))
    assert res.usage.completion_tokens == len(result.output_ids) + result.codes.shape[0]
    text_only = await _chat(client)  # the same server still answers text chat
    assert text_only.choices[0].message.content == result.text and getattr(text_only.choices[0].message, "audio", None) is None
    await assert_stages_free(pipe)


async def test_a_streamed_spoken_reply_sends_transcript_and_audio_deltas(served):
    """pcm16, streamed: transcript pieces joining into the text and base64 PCM pieces
    joining into the audio's samples (interleaved as the stages write them), every piece
    under one audio id; the finish reason and the usage last."""
    pipe, client = served
    result, pcm = await _expected(pipe)
    stream = await _chat(client, modalities=["text", "audio"], audio={**AUDIO, "format": "pcm16"}, stream=True,
                         stream_options={"include_usage": True})
    transcript, data, ids, reasons, usage = [], [], set(), [], None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            audio = choice.delta.to_dict().get("audio")
            if audio:
                ids.add(audio["id"])
                if "transcript" in audio:
                    transcript.append(audio["transcript"])
                if "data" in audio:
                    data.append(base64.b64decode(audio["data"]))
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert "".join(transcript) == result.text
    assert_same_samples(b"".join(data), pcm)
    assert len(ids) == 1 and len(data) > 1
    assert reasons == [result.finish_reason]
    assert usage.completion_tokens_details.audio_tokens == result.codes.shape[0]
    assert usage.completion_tokens == REPLY + result.codes.shape[0]
    await assert_stages_free(pipe)


async def test_a_streamed_wav_opens_with_a_header_and_holds_the_samples(served):
    pipe, client = served
    _, pcm = await _expected(pipe)
    stream = await _chat(client, modalities=["text", "audio"], audio=AUDIO, stream=True)
    data = b""
    async for chunk in stream:
        for choice in chunk.choices:
            audio = choice.delta.to_dict().get("audio") or {}
            data += base64.b64decode(audio.get("data", ""))
    assert data[:4] == b"RIFF"
    assert_same_samples(data[44:], pcm)


@pytest.mark.parametrize("fields,param", [
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio.voice"),
    ({"audio": {"voice": "ethan", "format": "mp3"}}, "audio.format"),
    ({}, "audio"),
    ({"modalities": ["audio"], "audio": AUDIO}, "modalities"),
    ({"modalities": ["text", "video"], "audio": AUDIO}, "modalities"),
])
async def test_bad_audio_fields_get_400_and_the_next_reply_succeeds(served, fields, param):
    pipe, client = served
    body = {"modalities": ["text", "audio"], **fields}
    with pytest.raises(openai.BadRequestError) as err:
        await _chat(client, extra_body=body)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param
    if param == "audio.voice":  # the voices there are, named
        assert "unknown speaker" in err.value.body["message"] and "chelsie" in err.value.body["message"]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError):  # before a stream's headers too
            await _chat(client, extra_body=body, stream=stream)
    res = await _chat(client, modalities=["text", "audio"], audio=AUDIO)
    assert res.choices[0].message.audio.data
    await assert_stages_free(pipe)


async def leave_after_first_audio(client) -> None:
    """A streamed spoken reply the client leaves at its first audio piece."""
    body = {"modalities": ["text", "audio"], "audio": AUDIO, "ignore_eos": True}
    async with client.chat.completions.with_streaming_response.create(
            model="ck", messages=MESSAGES, max_tokens=200, temperature=0, stream=True, extra_body=body) as res:
        async for line in res.iter_lines():
            if '"data"' in line:
                break


async def test_a_client_leaving_a_spoken_stream_ends_it_in_every_stage(served):
    pipe, client = served
    await leave_after_first_audio(client)
    await assert_stages_free(pipe)


async def test_a_text_model_asked_for_audio_says_it_writes_text_only():
    engine = Engine.from_pretrained("tiny", loop="normal")
    async with running_server(engine) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="tiny", messages=MESSAGES, modalities=["text", "audio"], audio=AUDIO)
        assert err.value.body["param"] == "modalities" and "text only" in err.value.body["message"]
        res = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
        assert res.choices[0].finish_reason
        await client.close()


def test_byte_tokenizer_puts_the_special_tokens_at_the_checkpoints_ids(chat_folder):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(chat_folder / "tokenizer.json"))
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n").ids
    assert ids[:2] == [500, 502] and ids[-3:-1] == [500, 503] and 501 in ids
    assert np.all(np.array(ids) < 512)


def _post(url: str, body: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_serve_on_a_qwen3_omni_folder_speaks(chat_folder):
    """``omni-async serve --model <Qwen3-Omni folder>`` loads the three stages (the folder's
    own Code2Wav) and answers a spoken chat request, and a bad voice with its 400; it stops
    cleanly on SIGINT."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "omni_async.cli", "serve", "--model", str(chat_folder), "--port", str(port)],
                            cwd=Path(__file__).resolve().parents[1], env=dict(os.environ), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = {"model": "ck", "messages": MESSAGES, "max_tokens": REPLY, "temperature": 0, "modalities": ["text", "audio"], "audio": AUDIO}
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                status, reply = _post(url, body)
                break
            except OSError:
                assert proc.poll() is None, proc.communicate()[1]
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.2)
        assert status == 200, reply
        audio = reply["choices"][0]["message"]["audio"]
        assert audio["transcript"] and base64.b64decode(audio["data"])[:4] == b"RIFF"
        status, reply = _post(url, {**body, "audio": {"voice": "alloy"}})
        assert status == 400 and reply["error"]["param"] == "audio.voice"
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "thinker, talker, code2wav" in err and "Traceback" not in err
