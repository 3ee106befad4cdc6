"""``omni-async speak`` (one text into a WAV file), ``serve`` of a speech model, and the
bytes both write.

``speak`` runs in process through ``main(argv)``; its argument errors are checked before
the model loads (loading is made to fail the test). ``serve`` runs as a subprocess."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import wave
from pathlib import Path

import numpy as np
import pytest

from omni_async.cli import main
from omni_async.speech import SpeechParams, SpeechPipeline
from omni_async.speech.audio_format import pcm16, wav_file, wav_header

REPO = Path(__file__).resolve().parents[1]
SAMPLES_PER_FRAME = 1920  # 24 kHz / 12.5 frames a second


@pytest.fixture(autouse=True)
def _keep_logging():
    """main() points the root logger at stderr; give the test run its handlers back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def no_load(monkeypatch):
    async def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(SpeechPipeline, "load", refuse)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


def test_pcm16_rounds_and_clips_and_the_wav_header_reads_back():
    assert np.frombuffer(pcm16(np.array([-2.0, -1.0, 0.0, 0.5, 1.0, 3.0, 1e-5])), "<i2").tolist() == [-32767, -32767, 0, 16384, 32767, 32767, 0]
    audio = np.linspace(-1, 1, 101, dtype=np.float32)
    with wave.open(io.BytesIO(wav_file(audio, 16000))) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (1, 2, 16000, 101)
        assert w.readframes(101) == pcm16(audio)
    assert len(wav_header(24000, None)) == 44 and wav_header(24000, None)[4:8] == b"\xff\xff\xff\xff"


def test_speak_writes_the_pipelines_audio_as_a_wav(capsys, tmp_path):
    out = tmp_path / "hello.wav"
    code, stdout, err = _run(capsys, "speak", "--text", "Hello there.", "--voice", "ryan", "--out", str(out), "--max-frames", "6",
                             "--temperature", "0")
    assert code == 0, err
    line = stdout.strip()
    assert line.startswith(f"wrote {out}: 0.48 s of audio (6 frames, length) in ") and " RTF " in line and "\n" not in line, stdout

    async def expected() -> bytes:
        async with SpeechPipeline.from_pretrained("tts-tiny", loop="normal") as tts:
            r = await tts.synthesize("Hello there.", voice="ryan", params=SpeechParams(max_frames=6, temperature=0))
        return pcm16(r.audio)

    with wave.open(str(out)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (1, 2, 24000, 6 * SAMPLES_PER_FRAME)
        assert w.readframes(w.getnframes()) == asyncio.run(expected())


def test_a_builtin_model_speaks_five_frames_a_word_unless_told(capsys, tmp_path):
    out = tmp_path / "words.wav"
    code, stdout, err = _run(capsys, "speak", "--text", "one two three", "--voice", "vivian", "--out", str(out))
    assert code == 0, err
    with wave.open(str(out)) as w:
        assert w.getnframes() == 15 * SAMPLES_PER_FRAME
    assert "(15 frames, length)" in stdout


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--text", "hi", "--voice", "nobody"], "error: InvalidRequestError: unknown voice 'nobody'; this model has: aiden, dylan,"),
        (["--text", "  ", "--voice", "aiden"], "error: InvalidRequestError: --text is empty: there is nothing to speak"),
        (["--text", "hi"], "error: InvalidRequestError: --voice is needed; this model has: aiden,"),
        (["--text", "hi", "--voice", "aiden", "--language", "klingon"], "error: InvalidRequestError: unknown language 'klingon'"),
        (["--text", "hi", "--voice", "aiden", "--max-frames", "0"], "error: InvalidRequestError: max_frames must be a positive int, got 0"),
        (["--text", "hi", "--voice", "aiden", "--temperature", "-1"], "error: InvalidRequestError: temperature must be a finite number >= 0"),
        (["--text", "hi", "--voice", "aiden", "--model", str(REPO / "tests")], "error: ModelLoadError: --model"),
        (["--text", "hi", "--voice", "aiden", "--model", "smollm2"], "error: ModelLoadError: --model smollm2: no such folder or built-in speech model"),
        (["--text", "hi", "--voice", "aiden", "--device", "tpu"], "error: ConfigError: --device tpu"),
    ],
)
def test_speak_refuses_bad_arguments_before_loading(capsys, tmp_path, no_load, argv, line):
    code, _, err = _run(capsys, "speak", "--out", str(tmp_path / "x.wav"), *argv)
    assert code == 2
    assert err.strip().startswith(line) and len(err.strip().splitlines()) == 1, err


def test_speak_refuses_an_output_it_cannot_write(capsys, tmp_path, no_load):
    code, _, err = _run(capsys, "speak", "--text", "hi", "--voice", "aiden", "--out", str(tmp_path / "missing" / "x.wav"))
    assert code == 2 and err.strip().startswith("error: ConfigError: --out"), err
    code, _, err = _run(capsys, "speak", "--text", "hi", "--voice", "aiden", "--out", str(tmp_path))
    assert code == 2 and "a folder" in err, err


@pytest.mark.parametrize(
    "argv, line",
    [
        (["generate", "--model", "tts-tiny", "--prompt", "hi"], "error: ConfigError: --model tts-tiny is a speech model: use omni-async speak"),
        (["demo", "--model", "tts-tiny"], "error: ConfigError: --model tts-tiny is a speech model"),
        (["serve", "--model", "tts-tiny", "--chat-template", "{{ x }}"], "error: ConfigError: --chat-template: a speech model has no chat template"),
        (["serve", "--model", "tts-tiny", "--backend", "sglang"], "error: ConfigError: --backend sglang: a speech model runs on the native backend"),
    ],
)
def test_the_other_commands_say_what_a_speech_model_is_for(capsys, no_load, argv, line):
    code, _, err = _run(capsys, *argv)
    assert code == 2
    assert err.strip().startswith(line), err


def test_help_lists_speak(capsys):
    code, out, _ = _run(capsys, "--help")
    assert code == 0 and "speak" in out
    code, out, _ = _run(capsys, "speak", "--help")
    for flag in ("--text", "--voice", "--out", "--model", "--language", "--device", "--max-frames", "--seed", "--temperature"):
        assert flag in out, flag


def test_serve_a_speech_model_from_the_command_line():
    pytest.importorskip("fastapi")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "omni_async.cli", "serve", "--model", "tts-tiny", "--port", str(port)],
                            cwd=REPO, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{base}/v1/audio/voices", timeout=5) as resp:
                    voices = json.loads(resp.read())
                break
            except OSError:
                assert proc.poll() is None, proc.communicate()[1]
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.2)
        assert "aiden" in voices["voices"]
        body = json.dumps({"model": "tts-tiny", "input": "Hello.", "voice": "aiden", "max_frames": 4}).encode()
        req = urllib.request.Request(f"{base}/v1/audio/speech", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.headers["content-type"] == "audio/wav"
            with wave.open(io.BytesIO(resp.read())) as w:
                assert w.getnframes() == 4 * SAMPLES_PER_FRAME
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "loaded tts-tiny" in err and "Traceback" not in err
