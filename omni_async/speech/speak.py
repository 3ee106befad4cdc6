"""``omni-async speak``: one utterance to a WAV file; and what the command line needs to
load and check a speech model (``serve`` uses it too).

Everything the arguments decide is checked before the model loads, as for the other
commands: the model names a speech model, the text is not empty, the voice and language
exist (read from the checkpoint's config.json, or the built-in's), the sampling values
hold, the output's folder exists. Failures end as one line, ``error: <Type>: <message>``.

A built-in model has random weights, which never reach the codec EOS: unless
``--max-frames`` says otherwise it speaks 5 frames (0.4 s) a word of the text, the
rate of ordinary speech (2.5 words a second), not the whole context.
"""

from __future__ import annotations

import argparse
import sys
import time
import wave
from pathlib import Path
from typing import TYPE_CHECKING

from .. import errors
from .audio_format import pcm16
from .config import TTSConfig, named_config
from .params import SpeechParams
from .pipeline import SpeechPipeline
from .prompt import resolve_voice
from .schedule import SpeechSchedule
from .flags import schedule_fields
from .names import DEFAULT_SPEECH_MODEL, MODEL_KINDS
from .stage import builtin_name, is_speech_checkpoint

if TYPE_CHECKING:
    from .omni_pipeline import OmniPipeline

__all__ = ["preflight_speak", "check_speech_serve", "refuse_speech_model", "load_speech", "speak",
           "DEFAULT_SPEECH_MODEL", "MODEL_KINDS", "params_of", "speech_schedule"]

FRAMES_PER_WORD = 5  # 12.5 frames a second at 2.5 words a second


def _config(model: str, flag: str = "--model") -> TTSConfig:
    """The model's config, read without loading weights; ModelLoadError for a model that
    is no speech model."""
    builtin = builtin_name(model)
    if builtin is not None:
        return named_config(builtin)
    if not Path(model).is_dir():
        raise errors.ModelLoadError(f"{flag} {model}: no such folder or built-in speech model; {MODEL_KINDS}")
    if not is_speech_checkpoint(model):
        raise errors.ModelLoadError(f"{flag} {model}: not a Qwen3-TTS checkpoint (its config.json has no model_type qwen3_tts); {MODEL_KINDS}")
    return TTSConfig.from_folder(model)


def params_of(args: argparse.Namespace) -> SpeechParams:
    """The flags as SpeechParams (a built-in model's default length from the text)."""
    max_frames = args.max_frames
    if max_frames is None and builtin_name(args.model) is not None:
        max_frames = max(1, FRAMES_PER_WORD * len(args.text.split()))
    return SpeechParams(max_frames=max_frames, temperature=args.temperature, seed=args.seed)


def preflight_speak(args: argparse.Namespace) -> None:
    if not args.text.strip():
        raise errors.InvalidRequestError("--text is empty: there is nothing to speak")
    cfg = _config(args.model)
    if args.voice is None and cfg.speakers and cfg.model_type == "custom_voice":
        raise errors.InvalidRequestError(f"--voice is needed; this model has: {', '.join(sorted(cfg.speakers))}")
    resolve_voice(cfg, args.voice, args.language)
    params_of(args)
    out = Path(args.out).expanduser()
    if out.is_dir():
        raise errors.ConfigError(f"--out {args.out}: a folder; give a file name (x.wav)")
    if not out.parent.is_dir():
        raise errors.ConfigError(f"--out {args.out}: no such folder {str(out.parent)!r}")


def speech_schedule(args: argparse.Namespace) -> dict:
    """serve's ``--speech-*`` flags as SpeechSchedule fields (checked)."""
    fields = schedule_fields(args)
    SpeechSchedule.of(fields)
    return fields


def check_speech_serve(args: argparse.Namespace) -> None:
    """``serve`` of a speech model: the native backend, no text-only options, a schedule that holds."""
    _config(args.model)
    speech_schedule(args)
    if getattr(args, "backend", "native") != "native":
        raise errors.ConfigError(f"--backend {args.backend}: a speech model runs on the native backend")
    if getattr(args, "chat_template", None):
        raise errors.ConfigError("--chat-template: a speech model has no chat template")


def refuse_speech_model(args: argparse.Namespace) -> None:
    """A text command given a speech model: say which commands take it."""
    raise errors.ConfigError(f"--model {args.model} is a speech model: use omni-async speak, or serve (POST /v1/audio/speech)")


async def load_speech(args: argparse.Namespace, schedule: dict | None = None, **limits: object) -> SpeechPipeline:
    """Load in a worker thread; one line on stderr when done (on a terminal, or for serve).
    ``schedule``: SpeechSchedule fields (serve's flags)."""
    start = time.perf_counter()
    pipeline = await SpeechPipeline.load(args.model, device=args.device, loop=args.loop, dtype=args.dtype, seed=args.engine_seed,
                                         schedule=schedule, **limits)
    if sys.stderr.isatty() or args.command == "serve":
        print(f"loaded {args.model} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return pipeline


async def load_omni(args: argparse.Namespace, **limits: object) -> OmniPipeline:
    """A Qwen3-Omni folder's three stages (thinker, talker, Code2Wav) in a worker thread;
    ``limits`` (the command line's) are the thinker's."""
    from .omni_pipeline import OmniPipeline

    start = time.perf_counter()
    pipeline = await OmniPipeline.load(args.model, device=args.device, loop=args.loop or "overlap", dtype=args.dtype,
                                       seed=args.engine_seed, thinker_limits=dict(limits))
    print(f"loaded {args.model} (thinker, talker, code2wav) in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return pipeline


async def speak(args: argparse.Namespace) -> int:
    pipeline = await load_speech(args)
    async with pipeline:
        start = time.perf_counter()
        result = await pipeline.synthesize(args.text, voice=args.voice, language=args.language, params=params_of(args))
        elapsed = time.perf_counter() - start
    with wave.open(str(Path(args.out).expanduser()), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(result.sample_rate)
        out.writeframes(pcm16(result.audio))
    rtf = elapsed / result.seconds if result.seconds else float("inf")
    print(f"wrote {args.out}: {result.seconds:.2f} s of audio ({result.codes.shape[0]} frames, {result.finish_reason}) "
          f"in {elapsed:.2f} s, RTF {rtf:.2f}")
    return 0
