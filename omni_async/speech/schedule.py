"""How the speech stages share the device among streams that are being played: the
talker's scheduling policy and row budget, the first-chunk deadline, the admission gate's
limits, the codec's per-round budget and its express lane. One object, so a pipeline, the server's options and
the benchmark's arms name the same knobs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .. import errors
from .codec_plan import ROUND_PLANS

__all__ = ["SpeechSchedule", "POLICIES"]

POLICIES = ("deadline", "fcfs")


@dataclass(frozen=True)
class SpeechSchedule:
    """``policy``: ``"deadline"`` (least slack first: a stream about to run dry, or a new
    stream's first chunk, goes before streams with audio buffered) or ``"fcfs"`` (arrival
    order). ``max_decode_rows``: a talker step's row budget (None: every running stream
    writes a frame every step). ``ttfp_budget_s``: a new stream's first-chunk deadline,
    from its submission. Admission (off while all three are None): ``max_streams`` streams
    at once; a request waits at most ``admission_wait_s`` to start (and only while the
    talker, by its own measure, can feed one more stream in real time); at most
    ``max_waiting_streams`` wait; beyond, ``OverloadedError`` (HTTP 503).
    ``codec_max_streams``: streams a codec round decodes at most (most urgent first);
    ``codec_max_frames``: frames a codec round decodes at most (most urgent first, at
    least one chunk): a round's time stays bounded (a few milliseconds on a GPU at 256),
    so a new stream's first chunk never waits behind every stream's long chunk at once.
    ``codec_express``: a first chunk that becomes ready while a codec round is in flight is
    decoded beside it on the codec's express lane (a small call on a stream of its own)
    rather than after it (:mod:`~omni_async.speech.codec_stage`). ``codec_round_plan``:
    how a round's chunks become decoder calls, ``"merged"`` (one call of a shared length for
    most of them) or ``"by-length"`` (a call per chunk length; :mod:`~omni_async.speech.codec_plan`)."""

    policy: str = "deadline"
    max_decode_rows: int | None = None
    ttfp_budget_s: float = 0.3
    max_streams: int | None = None
    max_waiting_streams: int | None = None
    admission_wait_s: float | None = None
    codec_max_streams: int | None = None
    codec_max_frames: int | None = 256
    codec_express: bool = True
    codec_round_plan: str = "merged"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise errors.ConfigError(f"unknown speech scheduling policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        for name in ("max_decode_rows", "max_streams", "codec_max_streams", "codec_max_frames"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise errors.ConfigError(f"{name} must be None or an integer >= 1, got {value!r}")
        if self.codec_round_plan not in ROUND_PLANS:
            raise errors.ConfigError(f"codec_round_plan must be one of {', '.join(ROUND_PLANS)}, got {self.codec_round_plan!r}")
        if not isinstance(self.codec_express, bool):
            raise errors.ConfigError(f"codec_express must be True or False, got {self.codec_express!r}")
        if self.max_waiting_streams is not None and (not isinstance(self.max_waiting_streams, int) or self.max_waiting_streams < 0):
            raise errors.ConfigError(f"max_waiting_streams must be None or an integer >= 0, got {self.max_waiting_streams!r}")
        for name in ("ttfp_budget_s", "admission_wait_s"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value >= 0):
                raise errors.ConfigError(f"{name} must be a number >= 0, got {value!r}")

    @classmethod
    def of(cls, value: "SpeechSchedule | dict[str, Any] | None") -> "SpeechSchedule":
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise errors.ConfigError(f"unknown speech schedule field(s): {', '.join(unknown)}")
        return cls(**value)
