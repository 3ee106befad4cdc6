"""Stop strings: find the first one in generated text, even across token boundaries,
and hold text back from the stream while it could still be the start of one."""

from __future__ import annotations


class StopMatcher:
    """Tracks one completion's text. ``feed`` returns the text that is safe to stream now
    and whether a stop string ended the completion.

    Text that ends with a proper prefix of a stop string is held back until the next
    chunk settles it (or ``release`` at the end), so a stop string never reaches the
    stream when ``include_stop_str_in_output`` is false.
    """

    def __init__(self, stops: list[str], include_stop: bool) -> None:
        self._stops = list(stops)
        self._include = include_stop
        self._longest = max((len(s) for s in self._stops), default=0)
        self.text = ""  # everything decoded so far (cut at the stop once matched)
        self._sent = 0  # length of the prefix of ``text`` already streamed
        self.stopped: str | None = None  # the stop string that matched

    def feed(self, chunk: str) -> tuple[str, bool]:
        if self.stopped is not None:
            return "", True
        start = max(0, len(self.text) - self._longest + 1)
        self.text += chunk
        if not self._stops:
            return self._emit(len(self.text)), False
        hit = self._first_stop(start)
        if hit is not None:
            pos, stop = hit
            self.stopped = stop
            self.text = self.text[: pos + len(stop)] if self._include else self.text[:pos]
            return self._emit(len(self.text)), True
        return self._emit(len(self.text) - self._held_back()), False

    def release(self) -> str:
        """The end of the completion: whatever was held back is not a stop string."""
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        end = max(end, self._sent)
        out = self.text[self._sent:end]
        self._sent = end
        return out

    def _first_stop(self, start: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            pos = self.text.find(stop, start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        return best

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that a stop string starts with."""
        text = self.text
        for n in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
