"""The talker's input, built for every reply of an Omni pipeline in one place
(:class:`TalkerInput`).

Each reply turns the thinker's tokens into the talker's text rows as they come (an
embedding lookup in the thinker's table, a projection to the talker's width). Built one
reply at a time, 64 streams made 64 small device passes for every thinker token, each
with its own copy of ids from the host and its own hand-over to a thread: the talker's
frames, which wait for their rows, waited behind that queue. Here the rows wanted since
the last pass are built in one pass (one copy of ids, one lookup, one projection over all
of them) and split among the replies that asked, in the order they asked. A reply's first
prompt (the talker's input from the thinker's rows so far) is built the same way: the
64 replies of a burst reach their second token in the same thinker step, and built one at
a time each waited for the device alone (a hand-over and a synchronisation each, behind
the thinker's steps); here those wanted together are one pass (``prompts_of``), one wait.

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
    """One reply's request for an item of a pass (text rows of ``item``'s tokens, or a prompt)."""

    def __init__(self, item: Any) -> None:
        self.item = item
        self.done = anyio.Event()
        self.result: Any = None
        self.error: BaseException | None = None


# ``many(items) -> results``: one pass over the items wanted together, a result (or the
# exception that item alone failed with) per item, in order.
Many = Callable[[list[Any]], list[Any]]


class TalkerInput:
    """``text_rows``: the rows of a reply's tokens, batched with every other reply's
    wanted since the last pass (:meth:`run` is the task making the passes); ``prompt``:
    a reply's first prompt, batched the same way with ``prompts_of``; ``work``: any other
    input work on the same thread and stream. ``rows_of(tokens) -> [n, H]``: the talker's
    text rows of thinker tokens; ``prompts_of(items) -> prompts``: :data:`Many`."""

    def __init__(self, device: torch.device, rows_of: Callable[[list[int]], torch.Tensor], *, threaded: bool,
                 prompts_of: Many | None = None) -> None:
        self.device, self.rows_of, self.threaded = device, rows_of, threaded
        self.prompts_of = prompts_of
        self._wanted: dict[Many, list[_Wanted]] = {}
        self._wake = anyio.Event()
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._stream: Any = None
        self.passes = 0  # text-row passes made
        self.replies_served = 0  # reply requests those passes answered
        self.prompt_passes = 0  # prompt passes made
        self.prompts_built = 0  # prompts those passes built

    async def run(self) -> None:
        """Make a pass for the items wanted, whenever some are (the pipeline's task): the
        prompts first (a reply waits for its prompt to start at all), then the text rows."""
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            wanted, self._wanted = self._wanted, {}
            for many in sorted(wanted, key=lambda m: m != self.prompts_of):
                await self._run_pass(many, wanted[many])

    async def _run_pass(self, many: Many, wanted: list[_Wanted]) -> None:
        try:
            results = await self.work(many, [w.item for w in wanted])
        except Exception as exc:  # each reply that asked gets the error
            results = [exc] * len(wanted)
        else:
            if many == self.prompts_of:
                self.prompt_passes, self.prompts_built = self.prompt_passes + 1, self.prompts_built + len(wanted)
            else:
                self.passes, self.replies_served = self.passes + 1, self.replies_served + len(wanted)
        for w, r in zip(wanted, results):
            if isinstance(r, BaseException):
                w.error = r
            else:
                w.result = r
            w.done.set()

    async def _each(self, many: Many, item: Any) -> Any:
        w = _Wanted(item)
        self._wanted.setdefault(many, []).append(w)
        self._wake.set()
        await w.done.wait()
        if w.error is not None:
            raise w.error
        return w.result

    async def text_rows(self, tokens: list[int]) -> torch.Tensor:
        """The talker's text rows ``[len(tokens), H]`` of thinker ``tokens``, on its device."""
        return await self._each(self._pass, tokens)

    async def prompt(self, item: Any) -> Any:
        """``prompts_of``'s result for ``item``, built with every other wanted since the last pass."""
        assert self.prompts_of is not None, "this input was made without prompts_of"
        return await self._each(self.prompts_of, item)

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
