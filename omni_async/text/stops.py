"""Stop strings: find the first one in generated text, even across token boundaries,
and hold text back from the stream while it could still be the start of one."""

from __future__ import annotations


class StopMatcher:
    """Tracks one completion's text. ``feed`` returns the text that is safe to stream now
    and whether a stop string ended the completion.

    Only the held-back tail is ever searched: text is emitted only when no suffix of it
    could begin a stop string, so a stop string can never start in emitted text. The
    held tail is the longest suffix that is a proper prefix of some stop string; it is
    settled by the next chunk (or ``release`` at the end), so a stop string never reaches
    the stream when ``include_stop_str_in_output`` is false. Work per chunk is bounded by
    the stop strings' length, not by the text so far.
    """

    def __init__(self, stops: list[str], include_stop: bool) -> None:
        self._stops = list(stops)
        self._include = include_stop
        self._longest = max((len(s) for s in self._stops), default=0)
        self._parts: list[str] = []  # emitted text
        self._held = ""
        self.stopped: str | None = None  # the stop string that matched

    @property
    def text(self) -> str:
        """Everything decoded so far (cut at the stop string once one matched)."""
        return "".join(self._parts) + self._held

    def feed(self, chunk: str) -> tuple[str, bool]:
        if self.stopped is not None:
            return "", True
        if not self._stops:
            if chunk:
                self._parts.append(chunk)
            return chunk, False
        buf = self._held + chunk
        hit = self._first_stop(buf)
        if hit is not None:
            pos, stop = hit
            self.stopped = stop
            self._held = ""
            return self._emit(buf[: pos + len(stop)] if self._include else buf[:pos]), True
        keep = self._held_back(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return self._emit(buf[: len(buf) - keep]), False

    def release(self) -> str:
        """The end of the completion: whatever was held back is not a stop string."""
        held, self._held = self._held, ""
        return self._emit(held)

    def _emit(self, text: str) -> str:
        if text:
            self._parts.append(text)
        return text

    def _first_stop(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            pos = buf.find(stop)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        return best

    def _held_back(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that a stop string starts with."""
        for n in range(min(self._longest - 1, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
