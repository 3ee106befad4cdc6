"""The talker's input, built for every reply of an Omni pipeline in one place
(:class:`TalkerInput`).

Each reply turns the thinker's tokens into the talker's text rows as they come (an
embedding lookup in the thinker's table, a projection to the talker's width). Built one
reply at a time, 64 streams made 64 small device passes for every thinker token, each
with its own copy of ids from the host and its own hand-over to a thread: the talker's
frames, which wait for their rows, waited behind that queue. Here the rows wanted since
the last pass are built in one pass (one copy of ids, one lookup, one projection over all
of them) and split among the replies that asked, in the order they asked.

On CUDA the passes run on a thread and a high-priority stream of their own: the event loop
never waits on the device, and the stages, whose every launch waits for the default
stream's work (weights and caches written there), no longer wait for input passes queued
on it. A pass ends with its stream synchronised, so the rows it hands to the talker are
written before any step of the talker's stream reads them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Any, Callable, Iterator, TypeVar

import anyio
import torch

from ..runners.streams import HIGH_PRIORITY, STREAMS
from ..stage.executor import await_future

__all__ = ["TalkerInput"]

T = TypeVar("T")


class _Wanted:
    """One reply's request for the text rows of ``tokens``."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.done = anyio.Event()
        self.rows: torch.Tensor | None = None
        self.error: BaseException | None = None


class TalkerInput:
    """``text_rows``: the rows of a reply's tokens, batched with every other reply's
    wanted since the last pass (:meth:`run` is the task making the passes);
    ``work``: any other input work (a reply's first prompt) on the same thread and
    stream. ``rows_of(tokens) -> [n, H]``: the talker's text rows of thinker tokens."""

    def __init__(self, device: torch.device, rows_of: Callable[[list[int]], torch.Tensor], *, threaded: bool) -> None:
        self.device, self.rows_of, self.threaded = device, rows_of, threaded
        self._wanted: list[_Wanted] = []
        self._wake = anyio.Event()
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._stream: Any = None
        self.passes = 0  # text-row passes made
        self.replies_served = 0  # reply requests those passes answered

    async def run(self) -> None:
        """Make a pass for the rows wanted, whenever some are (the pipeline's task)."""
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            wanted, self._wanted = self._wanted, []
            if not wanted:
                continue
            try:
                rows = await self.work(self._pass, [w.tokens for w in wanted])
            except Exception as exc:  # each reply that asked gets the error
                for w in wanted:
                    w.error = exc
                    w.done.set()
                continue
            self.passes += 1
            self.replies_served += len(wanted)
            for w, r in zip(wanted, rows):
                w.rows = r
                w.done.set()

    async def text_rows(self, tokens: list[int]) -> torch.Tensor:
        """The talker's text rows ``[len(tokens), H]`` of thinker ``tokens``, on its device."""
        w = _Wanted(tokens)
        self._wanted.append(w)
        self._wake.set()
        await w.done.wait()
        if w.error is not None:
            raise w.error
        assert w.rows is not None
        return w.rows

    async def work(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, on the input's thread and stream where it has them (the
        module's docstring), its device work done when it returns."""
        if not self.threaded:
            return fn(*args)
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-talker-input")
        return await await_future(self._thread.submit(self._on_stream, fn, *args))

    def _pass(self, token_lists: list[list[int]]) -> list[torch.Tensor]:
        sizes = [len(t) for t in token_lists]
        rows = self.rows_of([t for tokens in token_lists for t in tokens])
        return list(rows.split(sizes))

    def _on_stream(self, fn: Callable[..., T], *args: Any) -> T:
        with self._stream_context():
            out = fn(*args)
            if self._stream is not None:
                self._stream.synchronize()
            return out

    @contextlib.contextmanager
    def _stream_context(self) -> Iterator[None]:
        if self.device.type != "cuda":
            yield
            return
        if self._stream is None:
            self._stream = STREAMS.take(self.device, HIGH_PRIORITY)
        with torch.cuda.stream(self._stream):
            yield

    def close(self) -> None:
        """The thread ends (work queued is dropped) and the stream goes back to the pool."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.shutdown(wait=True, cancel_futures=True)
        stream, self._stream = self._stream, None
        if stream is not None:
            STREAMS.give_back(stream)
