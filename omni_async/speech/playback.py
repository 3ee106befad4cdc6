"""What each listener has heard: the playback state of one audio stream.

A late text token is slow; a late audio chunk is a gap the listener hears. So the
scheduler needs, per stream, what the client has been sent and what it has played: the
player here plays each chunk in real time from the first chunk's arrival, as the
benchmark's reference player does (``bench/tts_serving.py``); a chunk that arrives after
the audio before it ran out is an underrun, and the silence until it came a gap.

``slack`` is the audio sent and not yet played: how long the stream can wait for its
next chunk. Before its first chunk a stream's deadline is its time-to-first-packet budget
from when it was submitted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["Playback"]


@dataclass(eq=False)
class Playback:
    """One stream's player. ``clock``: seconds (``time.perf_counter`` by default; tests
    pass a simulated one). Times are the clock's."""

    clock: Callable[[], float] = time.perf_counter
    created: float = field(default=-1.0)
    first_audio_at: float | None = None
    sent_s: float = 0.0  # audio sent to the listener
    play_end: float = 0.0  # when the audio sent so far runs out
    worst_gap_s: float = 0.0
    underruns: int = 0  # chunks that arrived after the audio before them ran out
    finished: bool = False

    def __post_init__(self) -> None:
        if self.created < 0:
            self.created = self.clock()

    def on_audio(self, seconds: float, now: float | None = None) -> None:
        """A chunk of ``seconds`` of audio reached the listener (at ``now``)."""
        if seconds <= 0:
            return
        now = self.clock() if now is None else now
        if self.first_audio_at is None:
            self.first_audio_at = self.play_end = now
        elif now > self.play_end:
            self.underruns += 1
            self.worst_gap_s = max(self.worst_gap_s, now - self.play_end)
            self.play_end = now
        self.play_end += seconds
        self.sent_s += seconds

    @property
    def ttfp_s(self) -> float | None:
        """Submit to the first audio."""
        return None if self.first_audio_at is None else self.first_audio_at - self.created

    def slack(self, now: float | None = None) -> float:
        """Seconds of audio sent and not played yet (0 in an underrun; 0 before the first chunk)."""
        now = self.clock() if now is None else now
        return max(0.0, self.play_end - now) if self.first_audio_at is not None else 0.0

    def played_s(self, now: float | None = None) -> float:
        """Seconds of audio the listener has played."""
        return self.sent_s - self.slack(now) if self.first_audio_at is not None else 0.0

    def in_underrun(self, now: float | None = None) -> bool:
        """Playing, not finished, and out of audio: the listener hears silence now."""
        now = self.clock() if now is None else now
        return self.first_audio_at is not None and not self.finished and now > self.play_end

    def deadline_slack(self, ttfp_budget_s: float, pending_s: float = 0.0, now: float | None = None) -> float:
        """Seconds before this stream misses a deadline: before its first chunk, what is
        left of ``ttfp_budget_s``; after it, the audio buffered at the listener plus
        ``pending_s`` (audio made and not sent yet). Smaller is more urgent; negative once
        the deadline has passed (a listener in an underrun: by how long), so the stream
        that has waited longest goes first and none starves (earliest deadline first)."""
        now = self.clock() if now is None else now
        if self.first_audio_at is None:
            return ttfp_budget_s - (now - self.created)
        return self.play_end - now + pending_s

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        now = self.clock() if now is None else now
        return {"sent_s": round(self.sent_s, 4), "played_s": round(self.played_s(now), 4), "slack_s": round(self.slack(now), 4),
                "ttfp_s": None if self.ttfp_s is None else round(self.ttfp_s, 4), "underruns": self.underruns,
                "worst_gap_s": round(self.worst_gap_s, 4), "in_underrun": self.in_underrun(now)}
