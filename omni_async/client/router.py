"""The engine's per-step router: the stage's messages to the request handles.

The stage delivers one step's messages in one call (its output sink). The router owns the
two tables that call needs: open requests by the caller's id, and stage request ids (one
per completion) to their handle until each one's terminal message. A handle reaches back
only through the :class:`~.handle.HandleHooks` the router gives it, never the engine."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Callable

from .. import errors
from ..messages import OutgoingMessage
from .handle import HandleHooks, RequestHandle
from .wakeups import SlicedWaker

if TYPE_CHECKING:
    from ..messages import StepTokens


class Router:
    def __init__(self, *, abort_stage_request: Callable[[str], None], event_loop: Callable[[], "asyncio.AbstractEventLoop | None"]) -> None:
        self._abort_stage_request = abort_stage_request
        self._handles: dict[str, RequestHandle] = {}  # open requests by user id
        self._routes: dict[str, RequestHandle] = {}  # stage request id -> handle, until its terminal
        self._waker = SlicedWaker()  # a step's readers are woken a slice at a time
        self.hooks = HandleHooks(event_loop, self.abort, self.end_completion, self._forget)

    @property
    def open_requests(self) -> list[str]:
        return sorted(self._handles)

    def is_taken(self, request_id: str, sub_ids: list[str]) -> bool:
        """Whether the id, or one of its completions' ids, belongs to an active request."""
        return request_id in self._handles or any(s in self._routes for s in sub_ids)

    def route(self, sub_id: str, handle: RequestHandle) -> None:
        self._routes[sub_id] = handle

    def unroute(self, sub_ids: list[str]) -> None:
        for sub in sub_ids:
            self._routes.pop(sub, None)

    def open(self, handle: RequestHandle) -> None:
        self._handles[handle.request_id] = handle

    def get(self, request_id: str) -> RequestHandle | None:
        return self._handles.get(request_id)

    def deliver(self, messages: list[OutgoingMessage]) -> None:
        """The stage's output sink: one step's messages, routed to their handles on the
        loop thread; each handle touched is woken once, after the whole batch, in slices.
        This runs for every row of every step: one dict lookup and one call per message,
        the handles kept in first-touched order (a handle hashes by identity)."""
        touched: dict[RequestHandle, None] = {}
        self._route(messages, touched)
        self._waker.wake([handle.wake for handle in touched])

    def deliver_step(self, tokens: "StepTokens", messages: list[OutgoingMessage]) -> None:
        """The stage's columns sink: a step's plain stream rows as columns (each row's
        tokens handed to its handle, no message or delta built on the stage's side),
        then the other messages; each handle touched is woken once, after both."""
        touched: dict[RequestHandle, None] = {}
        routes = self._routes
        for rid, toks, lps, reason in zip(tokens.request_ids, tokens.token_ids, tokens.logprobs, tokens.finish_reasons):
            handle = routes.get(rid)
            if handle is None:
                continue
            try:
                handle.on_tokens(rid, toks, lps, reason)
            except Exception as exc:  # e.g. a tokenizer that raised: this request fails alone
                self._failed(handle, exc)
            touched[handle] = None
        if messages:
            self._route(messages, touched)
        self._waker.wake([handle.wake for handle in touched])

    def _route(self, messages: list[OutgoingMessage], touched: dict[RequestHandle, None]) -> None:
        routes = self._routes
        for msg in messages:
            rid = msg.request_id
            handle = routes.get(rid)
            if handle is None:
                continue
            if msg.type != "stream":
                del routes[rid]  # a terminal message: result or error
            try:
                handle.on_message(msg)
            except Exception as exc:  # e.g. a tokenizer that raised: this request fails alone
                self._failed(handle, exc)
            touched[handle] = None

    @staticmethod
    def _failed(handle: RequestHandle, exc: Exception) -> None:
        failure = errors.RequestFailedError(f"processing the output of {handle.request_id!r} failed: {exc!r}")
        failure.__cause__ = exc
        handle.fail(failure)

    def end_completion(self, sub_id: str) -> None:
        """End one stage request early; its terminal message still comes and is ignored."""
        if sub_id in self._routes:
            self._abort_stage_request(sub_id)

    def abort(self, handle: RequestHandle) -> None:
        for sub_id in handle.sub_ids:
            self.end_completion(sub_id)

    def _forget(self, handle: RequestHandle) -> None:
        if self._handles.get(handle.request_id) is handle:
            del self._handles[handle.request_id]
