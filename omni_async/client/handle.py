"""RequestHandle: what ``Engine.submit`` returns.

Readers: any number of ``await handle.result()`` calls, all given the same result (or
error); and one stream reader at a time (``async for delta in handle``): a second
concurrent iteration raises RuntimeError, since deltas are handed out once. Cancelling a
task that awaits ``result()`` or the stream aborts the request, as does leaving the stream
early.
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, NoReturn

import anyio

from .. import errors
from .collector import OutputCollector
from .completion import Completion
from .loopbridge import call_soon_on, foreign_loop, maybe_marshal
from ..messages import GenerationResult, OutgoingMessage, StreamDelta


@dataclass(frozen=True)
class HandleHooks:
    """What a handle may ask of whoever routes its messages (the engine's router
    builds them; the handle reaches back through nothing else)."""

    event_loop: Callable[[], "asyncio.AbstractEventLoop | None"]  # the loop it is served on
    abort: Callable[["RequestHandle"], None]  # end every completion of the request
    end_completion: Callable[[str], None]  # end one stage request (a stop string, a failed sibling)
    done: Callable[["RequestHandle"], None]  # the request ended: forget it


class RequestHandle:
    """One submitted request (``n`` completions): iterate it for stream deltas, or await
    ``result()``."""

    def __init__(
        self, request_id: str, completions: list[Completion], prompt_ids: list[int], hooks: HandleHooks, followers: int = 0
    ) -> None:
        """``followers``: the last completions were not sent to the stage and end with the
        first one's result (``n`` completions that generate nothing are all alike)."""
        self.request_id = request_id
        self._hooks = hooks
        self._completions = completions
        self._followers = completions[len(completions) - followers:] if followers else []
        self._by_sub = {c.sub_id: c for c in completions}
        self._prompt_ids = prompt_ids
        self._collector = OutputCollector()
        # Let the stream reader take what the collector holds (the router calls it once
        # per step for every handle it touched): the collector's own method, no hop.
        self.wake = self._collector.wake
        # Made by the first result() that waits (a stream reader never does): an anyio
        # Event asks which async library runs, ~2 us, each of a burst's submissions paid.
        self._finished: anyio.Event | None = None
        self._result: Any = None
        self._error: BaseException | None = None
        self._stage_result: Any = None  # the stage's result for completion 0
        self._cached_tokens = 0
        self._streaming = False
        self._ended = False  # the collector closed: checked for every message

    @property
    def done(self) -> bool:
        return self._ended

    @property
    def sub_ids(self) -> list[str]:
        """The stage's request ids of this request's completions."""
        return list(self._by_sub)

    # ------------------------------------------------------------ readers

    async def result(self) -> GenerationResult:
        own = self._hooks.event_loop()
        if not foreign_loop(own):
            return await self._result_here()
        try:
            return await maybe_marshal(own, self._result_here)
        except asyncio.CancelledError:
            # Cancelled on the caller's loop: ``_result_here`` may never have started on
            # the engine's loop (cancelled before its first step), so abort from here.
            call_soon_on(own, self._abort_unless_done)
            raise

    def _abort_unless_done(self) -> None:
        if not self.done:
            self._hooks.abort(self)

    async def _result_here(self) -> GenerationResult:
        if not self.done:
            if self._finished is None:
                self._finished = anyio.Event()
            try:
                await self._finished.wait()
            except BaseException:
                if not self.done:
                    self._hooks.abort(self)
                raise
        if self._error is not None:
            self._raise_error()
        return self._result

    async def __aiter__(self) -> AsyncIterator[StreamDelta]:
        if self._streaming:
            raise RuntimeError(
                f"request {self.request_id!r} is already being streamed by another reader: a handle "
                "has one stream reader at a time (any number may await result())"
            )
        self._streaming = True
        own = self._hooks.event_loop()
        collector = self._collector
        try:
            if foreign_loop(own):
                while True:
                    batch = await maybe_marshal(own, collector.next_batch)
                    if not batch:
                        break
                    for delta in batch:
                        yield delta
            else:  # the reader's step, once per decode step: take, or wait for the next wake
                take, arm = collector.take, collector.arm
                while True:
                    batch = take()
                    if batch:
                        for delta in batch:
                            yield delta
                    elif collector.closed:
                        break
                    else:
                        await arm()
            if self._error is not None:
                self._raise_error()
        finally:
            self._streaming = False
            if not self.done:  # the reader stopped early, or was cancelled
                call_soon_on(self._hooks.event_loop(), lambda: self._hooks.abort(self))

    # ------------------------------------------------------------ router side

    def on_message(self, msg: OutgoingMessage) -> None:
        """One stage message for one of this handle's completions (the router calls it, on
        the loop thread, for every row of every step)."""
        comp = self._by_sub.get(msg.request_id)
        if comp is None or comp.done or self._ended:
            return  # e.g. the abort that follows a stop string
        kind = msg.type
        if kind == "stream":
            self._on_stream(comp, msg.data, getattr(msg.data, "finished", False))  # before on_delta marks a stop
            return
        if kind == "result":
            if comp.index == 0:
                self._stage_result = msg.data
            self._cached_tokens += int(getattr(msg.data, "cached_tokens", 0) or 0)
            delta = comp.on_result(msg.data)
            if delta is not None:
                self._collector.put(delta)
            if comp.index == 0:
                for follower in self._followers:
                    delta = follower.on_result(msg.data)
                    if delta is not None:
                        self._collector.put(delta)
        else:
            self.fail(msg.data)
            return
        if comp.done and all(c.done for c in self._completions):
            self._finish(self._build_result())

    def on_tokens(self, sub_id: str, token_ids: list[int], logprobs: list[float] | None, finish_reason: str | None) -> None:
        """One row of a step's columns for one of this handle's completions: a stream
        delta of ``token_ids`` (ending the completion when ``finish_reason`` is set). A
        row that runs on, of a completion without a tokenizer (what ``on_delta`` would
        do is append the ids and scores), goes straight into the completion and the
        reader's pending delta: this runs for every row of every step."""
        comp = self._by_sub.get(sub_id)
        if comp is None or comp.done or self._ended:
            return  # e.g. the abort that follows a stop string
        if finish_reason is None and comp.ids_only:  # most rows of most steps: no text, no end
            comp.output_ids.extend(token_ids)
            if logprobs is not None:
                comp.logprobs.extend(logprobs)
            self._collector.put_ids(sub_id, comp.index, token_ids, logprobs)
            return
        final = finish_reason is not None
        self._on_stream(comp, StreamDelta(sub_id, token_ids, logprobs, final, finish_reason), final)

    def _on_stream(self, comp: Completion, data: Any, was_final: bool) -> None:
        """A stream delta for ``comp``; ``was_final``: the stage ended the completion with
        it (read before ``on_delta``, which marks a stop string's end too)."""
        delta, stopped = comp.on_delta(data)
        if delta is not None:
            self._collector.put(delta)
        if stopped and not was_final:
            self._hooks.end_completion(comp.sub_id)  # its later terminal is ignored
        if comp.done and all(c.done for c in self._completions):
            self._finish(self._build_result())

    def fail(self, err: Any) -> None:
        """One completion failed: the request fails, its other completions end."""
        if self.done:
            return
        for comp in self._completions:
            if not comp.done:
                comp.fail()
                self._hooks.end_completion(comp.sub_id)
        if not isinstance(err, BaseException):
            err = errors.RequestFailedError(str(err))
        self._error = err.with_traceback(None)
        self._finish(None)

    def _raise_error(self) -> NoReturn:
        """Raise a fresh copy of the stored error. Raising the stored object itself would
        attach the raise's traceback to it: the handle would then hold its reader's frames
        (and through them the engine), a cycle that keeps a closed engine alive until a
        cyclic GC pass. The copy keeps the type, message, attributes and cause."""
        stored = self._error
        assert stored is not None
        try:
            fresh = copy.copy(stored)
        except Exception:  # an exception type that cannot be rebuilt from its args
            fresh = errors.RequestFailedError(str(stored))
        fresh.__cause__ = stored.__cause__
        fresh.__suppress_context__ = True
        try:
            raise fresh
        finally:
            del fresh, stored

    def _finish(self, result: Any) -> None:
        self._result = result
        self._ended = True
        self._collector.close()
        if self._finished is not None:
            self._finished.set()
        self._hooks.done(self)

    def _build_result(self) -> Any:
        outputs = [c.to_output() for c in self._completions]
        base = self._stage_result
        if len(outputs) == 1 and base is not None and not isinstance(base, GenerationResult):
            return base  # a custom result adapter's object: passed through
        first = outputs[0]
        extra = dict(base.extra) if isinstance(base, GenerationResult) else {}
        extra.pop("top_logprobs", None)
        return GenerationResult(
            request_id=self.request_id,
            output_ids=list(first.output_ids),
            finish_reason=first.finish_reason,
            prompt_ids=list(base.prompt_ids) if isinstance(base, GenerationResult) else list(self._prompt_ids),
            output_logprobs=first.output_logprobs,
            text=first.text,
            weight_version=base.weight_version if isinstance(base, GenerationResult) else None,
            extra=extra,
            outputs=outputs,
            top_logprobs=first.top_logprobs,
            cached_tokens=self._cached_tokens,
            hidden_states=first.hidden_states,
            prompt_hidden_states=first.prompt_hidden_states,
            prompt_logprobs=base.prompt_logprobs if isinstance(base, GenerationResult) else None,
            prompt_logprob_ranks=base.prompt_logprob_ranks if isinstance(base, GenerationResult) else None,
        )


class SubmittedStream:
    """``Engine.stream``'s iterator: submits on the first ``__anext__``, then hands out
    the handle's own iteration step by step. Every running stream is resumed once per
    decode step, so a wrapping async generator would cost each of them a generator
    layer per step; here ``__anext__`` returns the handle's awaitable itself."""

    __slots__ = ("_submit", "_deltas")

    def __init__(self, submit: Callable[[], Awaitable[RequestHandle]]) -> None:
        self._submit: Callable[[], Awaitable[RequestHandle]] | None = submit
        self._deltas: Any = None  # the handle's async generator, once submitted

    def __aiter__(self) -> "SubmittedStream":
        return self

    def __anext__(self) -> Awaitable[StreamDelta]:
        deltas = self._deltas
        if deltas is not None:
            return deltas.__anext__()
        return self._first()

    async def _first(self) -> StreamDelta:
        submit, self._submit = self._submit, None
        if submit is None:  # closed, or the submit failed
            raise StopAsyncIteration
        handle = await submit()
        self._deltas = handle.__aiter__()
        return await self._deltas.__anext__()

    async def aclose(self) -> None:
        """Stop reading (the request is aborted when it has not ended)."""
        self._submit = None
        if self._deltas is not None:
            await self._deltas.aclose()
