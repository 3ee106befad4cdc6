"""The speech models' names as the command line offers them, kept apart from the models'
code so that building the parser (``--help``, usage errors) imports no torch."""

from __future__ import annotations

__all__ = ["BUILTIN_NAMES", "DEFAULT_SPEECH_MODEL", "MODEL_KINDS"]

BUILTIN_NAMES = ("tiny", "0.6b", "1.7b")  # random-weight models of the checkpoints' shapes
DEFAULT_SPEECH_MODEL = "tts-tiny"
MODEL_KINDS = f"give {', '.join('tts-' + n for n in BUILTIN_NAMES)} (built in, random weights) or a Qwen3-TTS checkpoint folder"
