"""Admission by what can be played on time.

A speech stream that starts but cannot be fed in real time is worse than one refused:
every listener already playing starts to hear gaps too. So before a request reaches the
talker it passes this gate: it starts when the talker, by its own measure, can write one
more stream's frames in real time beside the ones running (and under ``max_streams``);
otherwise it waits, in arrival order, for a stream to end, at most ``wait_s`` (what is
left of its time-to-first-packet budget), and is then refused with
:class:`~omni_async.errors.OverloadedError` (HTTP 503, the reason named). A full waiting
line (``max_waiting``) refuses at once.

The measure (:class:`FrameClock`): after each talker step, the wall time since the last
one and the frames written in it give the time a frame of every running row costs at
that batch size (prefill steps' time is charged to the frames after them), averaged per
batch size; the cost with one more row is read from those (interpolated, or past the
largest size measured along the slope of the two largest), and admission holds while it
stays under the frame's duration (80 ms) less a margin. Until two batch sizes have been
measured the cost is taken as flat (one more stream is let in, and measured); a stream
that would run alone is never held by the estimate.

The talker is not the only stage that must keep up: every running stream needs a second of
audio decoded each second it plays, and at tens of streams the codec, not the talker, is
the bound (an H100, the 1.7B shape: the talker writes ~4,800 frames a second beside it, the
codec decodes ~3,300). So the gate also reads the codec's rate (:class:`AudioRate`: audio
seconds decoded per second over rounds that left ready chunks for the next one, past a
round's budget: the codec is the bound then) and holds while the streams it must feed, one
more included, exceed that rate less the margin. Rounds that take everything ready measure
only the frames the talker fed, so they are not counted; without a round budget
(``codec_max_frames=None``) the codec is never measured and the talker's estimate decides.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable

import anyio

from .. import errors

__all__ = ["AudioRate", "FrameClock", "SpeechAdmission"]


class FrameClock:
    """Seconds a talker step takes to write one frame for each of ``n`` running rows,
    measured while streams run (see module): a moving average per batch size, read
    between the sizes measured by interpolation and past the largest along the slope of
    the two largest. A size not measured for ``max_age_s`` is forgotten: the gate keeps
    the talker away from sizes it found too dear, so such a figure would never be
    measured again however the load changed. ``clock``: seconds (tests pass their own)."""

    def __init__(self, weight: float = 0.2, idle_s: float = 0.5, max_age_s: float = 10.0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.by_rows: dict[int, tuple[float, float]] = {}  # rows -> (seconds a frame, when last measured)
        self.weight = weight  # of a new sample in its size's average
        self.max_age_s = max_age_s
        self.idle_s = idle_s  # a longer pause between steps is idleness, not work
        self.clock = clock
        self._last: float | None = None
        self._frames = 0
        self._spent = 0.0

    def observe(self, rows: int, frames_total: int) -> None:
        """After a step: ``rows`` in the talker's running batch now, ``frames_total``
        written by the talker so far. With no row running the talker goes idle: the time
        until the next step is not charged to any frame."""
        now = self.clock()
        if rows == 0:
            self._last = None
            return
        if self._last is None or now - self._last > self.idle_s:
            self._last, self._frames, self._spent = now, frames_total, 0.0
            return
        self._spent += now - self._last
        self._last = now
        made = frames_total - self._frames
        if made > 0 and rows > 0:
            cost = self._spent * rows / made
            old = self.by_rows.get(rows)
            fresh = old is not None and now - old[1] <= self.max_age_s
            self.by_rows[rows] = (old[0] + self.weight * (cost - old[0]) if fresh else cost, now)
            self._frames, self._spent = frames_total, 0.0

    def frame_seconds(self, rows: int) -> float | None:
        """Predicted seconds per frame of every row at ``rows`` rows; None before any sample."""
        now = self.clock()
        known = {n: cost for n, (cost, at) in self.by_rows.items() if now - at <= self.max_age_s}
        if not known:
            return None
        if rows in known:
            return known[rows]
        below = [n for n in known if n < rows]
        above = [n for n in known if n > rows]
        if below and above:
            lo, hi = max(below), min(above)
            return known[lo] + (known[hi] - known[lo]) * (rows - lo) / (hi - lo)
        if above:  # fewer rows than any measured: no dearer than the fewest measured
            return known[min(above)]
        sizes = sorted(known)
        if len(sizes) == 1:  # one size measured: no slope to go by yet; the next size measured gives one
            return known[sizes[0]]
        lo, hi = sizes[-2], sizes[-1]
        slope = max(0.0, (known[hi] - known[lo]) / (hi - lo))
        return known[hi] + slope * (rows - hi)


class AudioRate:
    """Audio seconds the codec decodes per second of its rounds, over rounds that left
    ready chunks for the next (the codec is the bound then, and this is what it delivers
    beside the talker), a moving average; forgotten after ``max_age_s`` without such a
    round (a rate measured under a load long gone)."""

    def __init__(self, weight: float = 0.2, max_age_s: float = 10.0, clock: Callable[[], float] = time.perf_counter) -> None:
        self.weight, self.max_age_s, self.clock = weight, max_age_s, clock
        self._rate: float | None = None
        self._at = 0.0

    def observe(self, audio_s: float, took_s: float) -> None:
        if took_s <= 0:
            return
        sample, now = audio_s / took_s, self.clock()
        fresh = self._rate is not None and now - self._at <= self.max_age_s
        self._rate = self._rate + self.weight * (sample - self._rate) if fresh else sample  # type: ignore[operator]
        self._at = now

    def rate(self) -> float | None:
        if self._rate is None or self.clock() - self._at > self.max_age_s:
            return None
        return self._rate


class SpeechAdmission:
    """The gate in front of the talker (see module). ``running()``: streams on the talker
    now; ``playing()``: streams the codec still feeds (those plus any whose last frames it
    is decoding); ``audio_rate``: the codec's measure (none: the talker's alone)."""

    def __init__(self, running: Callable[[], int], clock: FrameClock, *, frame_s: float, max_streams: int | None = None,
                 max_waiting: int | None = None, wait_s: float | None = None, margin: float = 0.2,
                 rows_per_step: int | None = None, audio_rate: AudioRate | None = None,
                 playing: Callable[[], int] | None = None) -> None:
        self.running = running
        self.playing = playing or running
        self.frame_clock = clock
        self.audio_rate = audio_rate
        self.frame_s = frame_s
        self.max_streams, self.max_waiting, self.wait_s, self.margin = max_streams, max_waiting, wait_s, margin
        self.rows_per_step = rows_per_step  # a decode step's row budget: more rows take several steps a frame
        self._line: deque[object] = deque()
        self._changed = anyio.Event()
        self.admitted = 0
        self.refused: dict[str, int] = {}

    @property
    def enabled(self) -> bool:
        return self.max_streams is not None or self.wait_s is not None or self.max_waiting is not None

    def waiting(self) -> int:
        return len(self._line)

    def notify(self) -> None:
        """Something changed (a stream ended, a step was measured): waiters look again."""
        self._changed.set()

    def fits(self, extra: int = 1) -> tuple[bool, str]:
        """Whether ``extra`` more streams can start now, and if not why."""
        n = self.running() + extra
        if self.max_streams is not None and n > self.max_streams:
            return False, "max_streams"
        if self.wait_s is not None and n > extra:  # (alone, a stream is as fast as it can be: never held)
            per_step = self.rows_per_step or n
            cost = self.frame_clock.frame_seconds(min(n, per_step))
            if cost is not None and cost * math.ceil(n / per_step) > self.frame_s * (1 - self.margin):
                return False, "underrun_risk"
            rate = None if self.audio_rate is None else self.audio_rate.rate()
            if rate is not None and self.playing() + extra > rate * (1 - self.margin):  # a second of audio a second each
                return False, "codec_behind"
        return True, ""

    async def enter(self) -> None:
        """Return when the request may start; raise OverloadedError when it may not."""
        if not self.enabled:
            return
        if self.max_waiting is not None and len(self._line) >= self.max_waiting and (self._line or not self.fits()[0]):
            self._refuse("queue_full", f"{len(self._line)} speech requests already wait to start (max_waiting_streams)")
        ticket = object()
        self._line.append(ticket)
        reason = ""
        try:
            with anyio.move_on_after(self.wait_s if self.wait_s is not None else math.inf):
                while True:
                    if self._line[0] is ticket:
                        ok, reason = self.fits()
                        if ok:
                            self.admitted += 1
                            return
                    self._changed = changed = anyio.Event() if self._changed.is_set() else self._changed
                    await changed.wait()
            self._refuse("ttfp_budget", f"the speech request could not start within its {self.wait_s:g} s budget"
                         + (f" ({reason})" if reason else ""))
        finally:
            self._line.remove(ticket)
            self.notify()  # the next in line looks

    def _refuse(self, reason: str, message: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        raise errors.OverloadedError(message, reason=reason)

    def stats(self) -> dict[str, object]:
        return {"admission_waiting": len(self._line), "admission_admitted": self.admitted, "admission_refused": dict(self.refused)}
