"""Stream input buffered for a request that ends before it is admitted (bad input, a full
backlog, an abort while building) is released, and input for unknown ids stays capped
inside a burst: the stage's info() counts what it holds."""

from __future__ import annotations

import threading

from omni_async import IncomingMessage, RequestPayload, SamplingParams, errors

from .test_abort_close import wait_until
from .test_admission import Stage

CHUNK = b"x" * 2048  # what a streaming upstream stage might send per chunk


def _buffered(st: Stage) -> tuple[int, int]:
    info = st.sched.info()
    return info["stream_input_buffered_ids"], info["stream_input_buffered_chunks"]


def _send_with_input(st: Stage, rid: str, ids: list[int], chunks: int = 5) -> None:
    """A request and its stream input, all queued at once (no await in between)."""
    inbox = st.sched.inbox
    inbox.send_nowait(IncomingMessage(rid, "new_request", RequestPayload(rid, ids, SamplingParams(max_new_tokens=2))))
    for _ in range(chunks):
        inbox.send_nowait(IncomingMessage(rid, "stream_chunk", CHUNK))
    inbox.send_nowait(IncomingMessage(rid, "stream_done"))


async def test_a_burst_of_rejected_requests_leaves_no_stream_input_behind():
    """2,000 requests with a token outside the vocabulary, each followed by five chunks
    and a done, sent at once: every one is refused at its build, and none of their
    input is kept (before, all 10,000 chunks and 2,000 done markers stayed)."""
    async with Stage() as st:
        bad = [st.sched.limits.vocab_size + 7]
        rids = [f"bad{i}" for i in range(2000)]
        for rid in rids:
            _send_with_input(st, rid, bad)
        msgs = await st.done(*rids, timeout=120)
        assert all(m.type == "error" and isinstance(m.data, errors.InvalidRequestError) for m in msgs)
        assert _buffered(st) == (0, 0)
        # the stage still serves, and input for a good request still reaches it
        _send_with_input(st, "good", [1, 2, 3], chunks=2)
        (good,) = await st.done("good")
        assert good.type == "result"
        assert _buffered(st) == (0, 0)


async def test_input_for_unknown_ids_stays_capped_inside_a_burst():
    async with Stage() as st:
        inbox = st.sched.inbox
        for i in range(3000):
            inbox.send_nowait(IncomingMessage(f"ghost{i}", "stream_chunk", CHUNK))
            inbox.send_nowait(IncomingMessage(f"ghost{i}", "stream_done"))
        await st.send("x", n=2)
        await st.done("x")
        ids, chunks = _buffered(st)
        assert ids <= 1000 and chunks <= 1000
        assert st.sched.info()["stream_input_orphan_ids"] == ids


async def test_input_of_requests_refused_by_a_full_backlog_is_released():
    gate = threading.Event()
    stage_ref = {}

    def builder(payload):
        gate.wait(20)
        return stage_ref["s"].sched.default_request_builder(payload)

    async with Stage(request_build_max_workers=2, request_build_max_pending=2, max_queued_requests=2, request_builder=builder) as st:
        stage_ref["s"] = st
        rids = [f"b{i}" for i in range(12)]
        for i in range(0, len(rids), 2):  # two per loop pass: the queue limit is 2
            for rid in rids[i:i + 2]:
                _send_with_input(st, rid, [1, 2, 3])
            group = rids[i:i + 2]
            await wait_until(lambda: all(r in st.terminal or r in st.sched.admission for r in group))
        refused = [rid for rid, m in st.terminal.items() if m.type == "error"]
        assert len(refused) == 8
        assert all("backlog is full" in str(st.terminal[r].data) for r in refused)
        # only the 4 requests still held (2 building, 2 in the backlog) keep input
        assert _buffered(st) == (4, 20)
        gate.set()
        served = await st.done(*[r for r in rids if r not in refused])
        assert all(m.type == "result" for m in served)
        assert _buffered(st) == (0, 0)


async def test_input_of_a_request_aborted_while_it_builds_inline_is_released():
    """An abort from another thread lands while the loop builds inline (between two
    builds of a burst): the request ends aborted, its buffered input goes with it."""
    stage_ref = {}
    aborted = threading.Event()

    def builder(payload):
        if payload.request_id == "a0" and not aborted.is_set():
            aborted.set()
            threading.Thread(target=stage_ref["s"].sched.abort_threadsafe, args=("a40",)).start()
        return stage_ref["s"].sched.default_request_builder(payload)

    async with Stage(request_builder=builder) as st:
        stage_ref["s"] = st
        rids = [f"a{i}" for i in range(64)]
        for rid in rids:
            _send_with_input(st, rid, [1, 2, 3], chunks=1)
        msgs = dict(zip(rids, await st.done(*rids, timeout=60)))
        assert isinstance(msgs["a40"].data, errors.RequestAbortedError), msgs["a40"]
        assert _buffered(st) == (0, 0)
