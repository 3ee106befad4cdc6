"""Admission: the path from an arrived ``new_request`` to the batch core.

A payload may be deferred until its stream input makes it ready (re-checked only when a
chunk or done for it arrives), then built: inline when ``request_build_max_workers`` is 1
(admission order kept), else on a thread pool with at most ``request_build_max_pending``
builds in flight and a bounded backlog behind them; past the backlog a request is
refused with the limit in the message. Stream input for a request that is not live yet
is buffered here and handed over at admission.
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from typing import Any, Callable

from .config import SchedulerConfig


class Admission:
    def __init__(
        self,
        config: SchedulerConfig,
        build: Callable[[Any], Any],
        is_ready: Callable[[Any, bool], bool] | None = None,
        on_build_done: Callable[[], None] | None = None,
    ) -> None:
        self._build = build
        self._is_ready = is_ready or (lambda payload, stream_done: True)
        self._on_build_done = on_build_done
        self.workers = max(1, config.request_build_max_workers)
        if self.workers > 1:
            self.max_pending = max(1, config.request_build_max_pending or self.workers)
            self.backlog_limit = max(self.max_pending, config.max_queued_requests)
            self.pool: concurrent.futures.ThreadPoolExecutor | None = concurrent.futures.ThreadPoolExecutor(
                max_workers=self.workers, thread_name_prefix="omni-request-build"
            )
        else:
            self.max_pending = 0
            self.backlog_limit = 0
            self.pool = None
        self.pending: dict[str, tuple[Any, concurrent.futures.Future[Any]]] = {}
        self.backlog: deque[Any] = deque()
        self.deferred: dict[str, Any] = {}
        self.dirty: set[str] = set()
        self.chunks: dict[str, list[Any]] = {}
        self.done: set[str] = set()
        self.max_pending_observed = 0
        self._staged: list[Any] = []

    # ------------------------------------------------------------ membership

    def __contains__(self, rid: str) -> bool:
        return rid in self.pending or rid in self.deferred or any(p.request_id == rid for p in self.backlog) or any(
            p.request_id == rid for p in self._staged
        )

    def __len__(self) -> int:
        return len(self.pending) + len(self.backlog) + len(self.deferred) + len(self._staged)

    def num_queued_unbuilt(self) -> int:
        """Requests that count towards the waiting queue before they are built: deferred
        ones and ones staged for an inline build (pool builds have their own backlog)."""
        return len(self.deferred) + len(self._staged)

    def active_ids(self) -> list[str]:
        ids = set(self.pending) | set(self.deferred) | {p.request_id for p in self.backlog}
        ids |= {p.request_id for p in self._staged}
        return sorted(ids)

    def stats(self) -> dict[str, int]:
        return {
            "request_build_workers": self.workers,
            "request_build_pending": len(self.pending),
            "request_build_max_pending": self.max_pending,
            "request_build_backlog": len(self.backlog),
            "request_build_backlog_limit": self.backlog_limit,
            "request_build_max_pending_observed": self.max_pending_observed,
            "deferred_requests": len(self.deferred),
        }

    # ------------------------------------------------------------ arrivals

    def offer(self, payload: Any) -> None:
        """A payload arrives (or a deferred one is re-checked): merge buffered stream
        input into it, then defer it or stage it for building."""
        rid = payload.request_id
        buffered = self.chunks.pop(rid, [])
        if hasattr(payload, "prefetched_chunks"):
            payload.prefetched_chunks = list(payload.prefetched_chunks or []) + buffered
            payload.prefetched_stream_done = bool(getattr(payload, "prefetched_stream_done", False)) or rid in self.done
        elif buffered:
            self.chunks[rid] = buffered
        stream_done = rid in self.done
        if not self._is_ready(payload, stream_done):
            self.deferred[rid] = payload
            return
        self.done.discard(rid)
        self._staged.append(payload)

    def on_chunk(self, rid: str, chunk: Any) -> None:
        """A chunk for a request that is not live: buffer it; a deferred request is
        re-checked on the next pass."""
        payload = self.deferred.get(rid)
        if payload is not None and hasattr(payload, "prefetched_chunks"):
            payload.prefetched_chunks.append(chunk)
        else:
            self.chunks.setdefault(rid, []).append(chunk)
        if rid in self.deferred:
            self.dirty.add(rid)

    def on_done(self, rid: str) -> None:
        self.done.add(rid)
        if rid in self.deferred:
            self.dirty.add(rid)

    def take_dirty(self) -> list[Any]:
        payloads = [self.deferred.pop(rid) for rid in sorted(self.dirty) if rid in self.deferred]
        self.dirty.clear()
        return payloads

    # ------------------------------------------------------------ building

    def stage(self) -> tuple[list[Any], list[Any]]:
        """Move staged payloads towards building. Returns ``(build_inline, rejected)``:
        with no pool, everything staged is built inline by the caller, in order; with a
        pool, builds are submitted up to ``max_pending`` (backlog first), the rest wait
        in the backlog, and what overflows the backlog is rejected."""
        staged, self._staged = self._staged, []
        if self.pool is None:
            return staged, []
        rejected: list[Any] = []
        for payload in staged:
            if len(self.backlog) >= self.backlog_limit:
                rejected.append(payload)
            else:
                self.backlog.append(payload)
        while self.backlog and len(self.pending) < self.max_pending:
            payload = self.backlog.popleft()
            fut = self.pool.submit(self._build, payload)
            if self._on_build_done is not None:
                fut.add_done_callback(lambda _f: self._on_build_done())
            self.pending[payload.request_id] = (payload, fut)
        self.max_pending_observed = max(self.max_pending_observed, len(self.pending))
        return [], rejected

    def collect(self) -> list[tuple[Any, Any, BaseException | None]]:
        """Finished builds, each ``(payload, data, error)``. With a pool, a build is
        admitted as soon as it is done, so one slow build holds back no other request
        (admission order is kept only with inline builds, workers = 1)."""
        done: list[tuple[Any, Any, BaseException | None]] = []
        for rid, (payload, fut) in list(self.pending.items()):
            if not fut.done():
                continue
            del self.pending[rid]
            if fut.cancelled():
                continue
            exc = fut.exception()
            done.append((payload, None if exc else fut.result(), exc))
        return done

    # ------------------------------------------------------------ removal

    def remove(self, rid: str) -> bool:
        """Take a request out of every admission stage (abort). True if it was here."""
        found = False
        entry = self.pending.pop(rid, None)
        if entry is not None:
            entry[1].cancel()
            found = True
        kept = [p for p in self.backlog if p.request_id != rid]
        if len(kept) != len(self.backlog):
            found = True
            self.backlog = deque(kept)
        staged = [p for p in self._staged if p.request_id != rid]
        if len(staged) != len(self._staged):
            found = True
            self._staged = staged
        if self.deferred.pop(rid, None) is not None:
            found = True
        self.dirty.discard(rid)
        self.chunks.pop(rid, None)
        self.done.discard(rid)
        return found

    def drain_all(self) -> list[Any]:
        """Everything still in admission (close): payloads, builds cancelled."""
        payloads = [p for p, _ in self.pending.values()] + list(self.backlog) + list(self.deferred.values()) + self._staged
        for _p, fut in self.pending.values():
            fut.cancel()
        self.pending.clear()
        self.backlog.clear()
        self.deferred.clear()
        self._staged = []
        self.dirty.clear()
        return payloads

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
