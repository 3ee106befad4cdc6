"""Admission: the path from an arrived ``new_request`` to the batch core.

A payload may be deferred until its stream input makes it ready (re-checked only when a
chunk or done for it arrives), then built: inline when ``request_build_max_workers`` is 1
(admission order kept), else on a thread pool with at most ``request_build_max_pending``
builds in flight and a bounded backlog behind them; past the backlog a request is
refused with the limit in the message. Finished pool builds are admitted in arrival
order: collection stops at the first build still running, so admission order equals
arrival order whatever order builds finish in. Stream input for a request that is not
live yet is buffered here (bounded for ids nothing else knows) and handed over at
admission.
"""

from __future__ import annotations

import concurrent.futures
from collections import OrderedDict, deque
from typing import Any, Callable

from ..config import SchedulerConfig


class Admission:
    def __init__(
        self,
        config: SchedulerConfig,
        is_ready: Callable[[Any, bool], bool] | None = None,
        on_build_done: Callable[[], None] | None = None,
        orphan_cap: int = 1_000,
        recheck_on_chunk: Callable[[str, Any], bool] | None = None,
    ) -> None:
        self._recheck_on_chunk = recheck_on_chunk
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
        # Stream input for ids not live yet. Input for ids admission holds is kept until
        # they are admitted or end; input for ids nothing knows (orphans, oldest first in
        # ``orphans``) is capped at ``orphan_cap`` ids, bursts included.
        self.chunks: dict[str, list[Any]] = {}
        self.done: set[str] = set()
        self.orphans: OrderedDict[str, None] = OrderedDict()
        self.orphan_cap = orphan_cap
        self._ids: set[str] = set()  # every id in pending, backlog, deferred or staged
        self.max_pending_observed = 0
        self._staged: list[Any] = []

    # ------------------------------------------------------------ membership

    def __contains__(self, rid: str) -> bool:
        return rid in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def num_queued_unbuilt(self) -> int:
        """Requests that count towards the waiting queue before they are built: deferred
        ones and ones staged for an inline build (pool builds have their own backlog)."""
        return len(self.deferred) + len(self._staged)

    def active_ids(self) -> list[str]:
        return sorted(self._ids)

    def stats(self) -> dict[str, int]:
        return {
            "request_build_workers": self.workers,
            "request_build_pending": len(self.pending),
            "request_build_max_pending": self.max_pending,
            "request_build_backlog": len(self.backlog),
            "request_build_backlog_limit": self.backlog_limit,
            "request_build_max_pending_observed": self.max_pending_observed,
            "deferred_requests": len(self.deferred),
            "stream_input_buffered_ids": len(self.chunks.keys() | self.done),
            "stream_input_buffered_chunks": sum(len(c) for c in self.chunks.values()),
            "stream_input_orphan_ids": len(self.orphans),
        }

    # ------------------------------------------------------------ arrivals

    def offer(self, payload: Any) -> None:
        """A payload arrives (or a deferred one is re-checked): merge buffered stream
        input into it, then defer it or stage it for building."""
        rid = payload.request_id
        self._ids.add(rid)
        self.orphans.pop(rid, None)
        buffered = self.chunks.pop(rid, [])
        if hasattr(payload, "prefetched_chunks"):
            payload.prefetched_chunks = list(payload.prefetched_chunks or []) + buffered
            payload.prefetched_stream_done = bool(getattr(payload, "prefetched_stream_done", False)) or rid in self.done
        elif buffered:
            self.chunks[rid] = buffered
        stream_done = rid in self.done
        try:
            ready = self._is_ready(payload, stream_done)
        except BaseException:
            self.remove(rid)
            raise
        if not ready:
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
            self._note_orphan(rid)
        if rid in self.deferred and (self._recheck_on_chunk is None or self._recheck_on_chunk(rid, chunk)):
            self.dirty.add(rid)

    def on_done(self, rid: str) -> None:
        self.done.add(rid)
        self._note_orphan(rid)
        if rid in self.deferred:
            self.dirty.add(rid)

    def take_chunks(self, rid: str) -> list[Any]:
        """Stream input that arrived for ``rid`` while it was being built."""
        return self.chunks.pop(rid, [])

    def take_done(self, rid: str) -> bool:
        if rid in self.done:
            self.done.discard(rid)
            return True
        return False

    def release_input(self, rid: str) -> None:
        """Drop whatever stream input is buffered for ``rid``: called on every path that
        ends a request (rejected, aborted, failed, finished, closed), so input that
        reached the stage before the request ended is not kept."""
        self.chunks.pop(rid, None)
        self.done.discard(rid)
        self.orphans.pop(rid, None)

    def _note_orphan(self, rid: str) -> None:
        """Input for an id admission does not hold (unknown, ended, never sent) is
        bounded: past ``orphan_cap`` such ids the oldest one's input is dropped. O(1)
        per message, so the cap holds inside a burst too."""
        if rid in self._ids:
            return
        self.orphans[rid] = None
        while len(self.orphans) > self.orphan_cap:
            old, _ = self.orphans.popitem(last=False)
            self.chunks.pop(old, None)
            self.done.discard(old)

    def take_dirty(self) -> list[Any]:
        payloads = [self.deferred.pop(rid) for rid in sorted(self.dirty) if rid in self.deferred]
        self.dirty.clear()
        return payloads

    # ------------------------------------------------------------ building

    def stage(self, build: Callable[[Any], Any]) -> tuple[list[Any], list[Any]]:
        """Move staged payloads towards building. Returns ``(build_inline, rejected)``:
        with no pool, everything staged is built inline by the caller, in order; with a
        pool, ``build`` is submitted up to ``max_pending`` times (backlog first), the rest
        wait in the backlog, and what overflows the backlog is rejected. (``build`` is
        the caller's, passed per call: stored here it would tie the caller to its part.)"""
        staged, self._staged = self._staged, []
        if self.pool is None:
            for payload in staged:
                self._ids.discard(payload.request_id)
            return staged, []
        rejected: list[Any] = []
        for payload in staged:
            if len(self.backlog) >= self.backlog_limit:
                self._ids.discard(payload.request_id)
                rejected.append(payload)
            else:
                self.backlog.append(payload)
        while self.backlog and len(self.pending) < self.max_pending:
            payload = self.backlog.popleft()
            fut = self.pool.submit(build, payload)
            if self._on_build_done is not None:
                fut.add_done_callback(lambda _f: self._on_build_done())
            self.pending[payload.request_id] = (payload, fut)
        self.max_pending_observed = max(self.max_pending_observed, len(self.pending))
        return [], rejected

    def collect(self) -> list[tuple[Any, Any, BaseException | None]]:
        """Finished builds in arrival order, each ``(payload, data, error)``; stops at
        the first build still running, so a later build that finished first waits for
        it (admission order is arrival order)."""
        done: list[tuple[Any, Any, BaseException | None]] = []
        for rid, (payload, fut) in list(self.pending.items()):
            if not fut.done():
                break
            del self.pending[rid]
            self._ids.discard(rid)
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
        self.release_input(rid)
        self._ids.discard(rid)
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
        self._ids.clear()
        return payloads

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
