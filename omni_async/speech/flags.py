"""The speech commands' flags: ``omni-async speak``'s, and ``omni-async serve``'s
``--speech-*`` (how a served speech model shares the device among streams:
:class:`~omni_async.speech.schedule.SpeechSchedule`'s fields). Imported while the parser
is built, so it imports no torch."""

from __future__ import annotations

import argparse
from typing import Any

from .names import DEFAULT_SPEECH_MODEL, MODEL_KINDS

__all__ = ["add_schedule_flags", "add_speak_flags", "schedule_fields"]


def add_speak_flags(p: argparse.ArgumentParser) -> None:
    """``speak``'s own flags (the device flags are the other commands')."""
    p.add_argument("--model", default=DEFAULT_SPEECH_MODEL, help=f"the speech model: {MODEL_KINDS}")
    p.add_argument("--text", required=True, help="what to say")
    p.add_argument("--voice", default=None, help="the speaker (a wrong one is answered with the model's voices)")
    p.add_argument("--language", default=None, help="the language of the text (none: auto)")
    p.add_argument("--out", required=True, help="the WAV file to write (16-bit mono PCM)")
    p.add_argument("--max-frames", type=int, default=None,
                   help="80 ms frames at most (none: until the model stops; a built-in model, whose random weights never stop, 5 a word of the text)")
    p.add_argument("--temperature", type=float, default=None, help="0 is greedy (none: the checkpoint's generation config)")
    p.add_argument("--seed", type=int, default=None, help="the utterance's sampling seed")
    p.add_argument("--engine-seed", type=int, default=0, help="a built-in model's weights seed")


def add_schedule_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speech scheduling (a speech model only; docs/speech.md)")
    g.add_argument("--speech-policy", default="deadline", choices=("deadline", "fcfs"),
                   help="deadline: least slack first (a stream about to run dry, a new stream's first chunk); fcfs: arrival order")
    g.add_argument("--speech-max-decode-rows", type=int, default=None, help="a talker step's row budget (none: every stream, every step)")
    g.add_argument("--speech-max-streams", type=int, default=None, help="streams at once; more wait (see --speech-admission-wait)")
    g.add_argument("--speech-admission-wait", type=float, default=None,
                   help="seconds a request may wait to start (while one more stream would not be fed in real time) before a 503")
    g.add_argument("--speech-max-waiting", type=int, default=None, help="requests waiting to start at most; more get a 503 at once")
    g.add_argument("--speech-codec-max-frames", type=int, default=256,
                   help="frames a codec round decodes at most, most urgent first (a round's time stays short: first chunks wait less)")
    g.add_argument("--speech-codec-plan", default="merged", choices=("merged", "by-length"),
                   help="how a codec round's chunks become calls: merged (one call of a shared length for most) or by-length (a call per length)")
    g.add_argument("--speech-codec-express", action=argparse.BooleanOptionalAction, default=True,
                   help="first chunks ready while a codec round is in flight are decoded beside it, on the codec's express lane")


def schedule_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as SpeechSchedule fields."""
    return {"policy": args.speech_policy, "max_decode_rows": args.speech_max_decode_rows, "max_streams": args.speech_max_streams,
            "admission_wait_s": args.speech_admission_wait, "max_waiting_streams": args.speech_max_waiting,
            "codec_max_frames": args.speech_codec_max_frames, "codec_express": args.speech_codec_express,
            "codec_round_plan": args.speech_codec_plan}
