"""Admission: the request-build pool, backlog limits, deferral on stream input, buffered
chunks, the thread-safe door, queue limits, and bounded tombstones."""

from __future__ import annotations

import asyncio
import threading
import time

import anyio
import pytest

from omni_async import IncomingMessage, RequestPayload, SamplingParams, errors
from omni_async.backends.native.builder import build_native_stack, build_scheduler
from omni_async.config import SchedulerConfig

from .test_abort_close import wait_until


class Stage:
    """A scheduler on the tiny model with an outbox collector, for stage-level tests."""

    def __init__(self, **cfg):
        callbacks = {k: cfg.pop(k) for k in list(cfg) if k in ("request_builder", "request_build_ready", "stream_chunk_handler", "stream_done_handler", "abort_callback", "recheck_on_chunk", "result_adapter")}
        self.config = SchedulerConfig(**cfg)
        self.stack = build_native_stack("tiny", self.config)
        self.sched = build_scheduler(self.stack, self.config, **callbacks)
        self.messages: list = []
        self.terminal: dict[str, object] = {}

    async def __aenter__(self):
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self.sched.run)
        self._tg.start_soon(self._collect)
        return self

    async def __aexit__(self, *exc):
        await self.sched.aclose()
        await self._tg.__aexit__(*exc)
        assert self.stack.allocator.is_fully_free()

    async def _collect(self):
        async for msg in self.sched.outbox:
            self.messages.append(msg)
            if msg.type in ("result", "error"):
                assert msg.request_id not in self.terminal, f"second terminal for {msg.request_id}"
                self.terminal[msg.request_id] = msg

    async def send(self, rid, ids=(1, 2, 3), n=4, **sp):
        sp.setdefault("ignore_eos", True)
        await self.sched.inbox.send(IncomingMessage(rid, "new_request", RequestPayload(rid, list(ids), SamplingParams(max_new_tokens=n, **sp))))

    async def done(self, *rids, timeout=30.0):
        await wait_until(lambda: all(r in self.terminal for r in rids), timeout)
        return [self.terminal[r] for r in rids]


async def test_slow_build_on_the_pool_does_not_stall_decoding():
    """A build blocks until a request admitted before it has finished decoding. Inline,
    that would deadlock the loop; on the pool the other request decodes meanwhile."""
    other_done = threading.Event()
    stage_ref = {}

    def builder(payload):
        if payload.request_id == "slow":
            assert other_done.wait(20), "the loop stalled while a build was running"
        return stage_ref["s"].sched.default_request_builder(payload)

    async with Stage(request_build_max_workers=2, request_builder=builder) as st:
        stage_ref["s"] = st
        await st.send("first", n=40)
        await wait_until(lambda: "first" in st.sched.control.active_request_ids() and not st.sched.intake.admission.active_ids())
        await st.send("slow", n=2)
        (first,) = await st.done("first")
        assert first.type == "result" and len(first.data.output_ids) == 40
        other_done.set()
        (slow,) = await st.done("slow")
        assert slow.type == "result"


async def test_pool_builds_are_admitted_in_arrival_order_when_they_finish_in_reverse():
    """Builds finish last-to-first; admission (and so the waiting queue) keeps arrival order."""
    gates = {f"r{i}": threading.Event() for i in range(4)}
    admitted: list[str] = []
    stage_ref = {}

    def builder(payload):
        assert gates[payload.request_id].wait(20)
        data = stage_ref["s"].sched.default_request_builder(payload)
        return data

    def ready_release():
        for rid in reversed(list(gates)):
            gates[rid].set()
            time.sleep(0.02)

    async with Stage(request_build_max_workers=4, request_builder=builder) as st:
        stage_ref["s"] = st
        for rid in gates:
            await st.send(rid, n=2)
        await anyio.sleep(0.05)
        await anyio.to_thread.run_sync(ready_release)
        msgs = await st.done(*gates)
        assert all(m.type == "result" for m in msgs)
        firsts = [m.request_id for m in st.messages if m.type == "stream"]
        order = list(dict.fromkeys(firsts))
        admitted.extend(order)
    assert admitted == list(gates), admitted


async def test_inline_builds_keep_admission_order():
    order = []
    stage_ref = {}

    def builder(payload):
        order.append(payload.request_id)
        return stage_ref["s"].sched.default_request_builder(payload)

    async with Stage(request_builder=builder) as st:
        stage_ref["s"] = st
        for i in range(8):
            await st.send(f"r{i}", n=2)
        await st.done(*[f"r{i}" for i in range(8)])
    assert order == [f"r{i}" for i in range(8)]


async def test_backlog_overflow_is_rejected_with_the_limit():
    gate = threading.Event()
    stage_ref = {}

    def builder(payload):
        gate.wait(20)
        return stage_ref["s"].sched.default_request_builder(payload)

    async with Stage(request_build_max_workers=2, request_build_max_pending=2, max_queued_requests=3, request_builder=builder) as st:
        stage_ref["s"] = st
        for i in range(8):
            await st.send(f"b{i}", n=2)
        # 2 building, 3 in the backlog (max of pending and max_queued), 3 refused
        await wait_until(lambda: sum(1 for m in st.terminal.values() if m.type == "error") >= 3)
        refused = [rid for rid, m in st.terminal.items() if m.type == "error"]
        for rid in refused:
            err = st.terminal[rid].data
            assert isinstance(err, errors.RequestRejectedError)
            assert "backlog is full" in str(err) and "backlog_limit=3" in str(err)
        gate.set()
        await st.done(*[f"b{i}" for i in range(8)])
        served = [rid for rid, m in st.terminal.items() if m.type == "result"]
        assert len(served) == 5 and len(refused) == 3


async def test_build_failure_errors_that_request_only():
    stage_ref = {}

    def builder(payload):
        if payload.request_id == "bad":
            raise KeyError("no such voice")
        return stage_ref["s"].sched.default_request_builder(payload)

    for workers in (1, 3):
        async with Stage(request_build_max_workers=workers, request_builder=builder) as st:
            stage_ref["s"] = st
            await st.send("good1", n=3)
            await st.send("bad", n=3)
            await st.send("good2", n=3)
            good1, bad, good2 = await st.done("good1", "bad", "good2")
            assert bad.type == "error" and isinstance(bad.data, errors.RequestFailedError)
            assert "no such voice" in str(bad.data) and isinstance(bad.data.__cause__, KeyError)
            assert good1.type == good2.type == "result"


async def test_queue_full_is_visible_backpressure():
    async with Stage(max_queued_requests=2, max_running_requests=1) as st:
        await st.send("run", n=300)
        await wait_until(lambda: st.stack.core.running)
        await st.send("q1", n=2)
        await st.send("q2", n=2)
        await st.send("q3", n=2)
        (q3,) = await st.done("q3")
        assert q3.type == "error" and isinstance(q3.data, errors.RequestRejectedError)
        assert "queue full" in str(q3.data) and "max_queued_requests=2" in str(q3.data)
        st.sched.abort("run")
        assert [m.type for m in await st.done("run", "q1", "q2")] == ["error", "result", "result"]


async def test_deferred_request_waits_for_chunks_and_rechecks_only_on_input():
    checks = []

    def ready(payload, stream_done):
        if payload.request_id != "d":
            return True
        checks.append(len(payload.prefetched_chunks))
        return len(payload.prefetched_chunks) >= 3 or stream_done

    seen_chunks: dict[str, list] = {}

    def on_chunk(data, chunk):
        seen_chunks.setdefault(data.request_id, []).append(chunk)

    async with Stage(request_build_ready=ready, stream_chunk_handler=on_chunk) as st:
        sched = st.sched
        # chunks that arrive before the request are buffered and handed over
        await sched.inbox.send(IncomingMessage("d", "stream_chunk", "c0"))
        await st.send("d", n=30)
        await wait_until(lambda: "d" in sched.admission.deferred)
        n_checks = len(checks)
        for _ in range(5):  # unrelated traffic does not re-check the deferred request
            await st.send(f"x{_}", n=1)
        await st.done(*[f"x{i}" for i in range(5)])
        assert len(checks) == n_checks
        await sched.inbox.send(IncomingMessage("d", "stream_chunk", "c1"))
        await wait_until(lambda: len(checks) == n_checks + 1)
        assert "d" in sched.admission.deferred
        await sched.inbox.send(IncomingMessage("d", "stream_chunk", "c2"))
        await wait_until(lambda: "d" in sched.emission.live)
        data = sched.emission.live["d"]
        assert data.payload.prefetched_chunks == ["c0", "c1", "c2"]
        await sched.inbox.send(IncomingMessage("d", "stream_chunk", "c3"))
        await sched.inbox.send(IncomingMessage("d", "stream_done"))
        (d,) = await st.done("d")
        assert d.type == "result"
    assert seen_chunks["d"] == ["c0", "c1", "c2", "c3"]
    assert data.stream_done is True


async def test_abort_reaches_every_admission_stage():
    gate = threading.Event()
    stage_ref = {}
    aborted_cb = []

    def builder(payload):
        if payload.request_id.startswith("slow"):
            gate.wait(20)
        return stage_ref["s"].sched.default_request_builder(payload)

    async with Stage(
        request_build_max_workers=2,
        request_build_max_pending=1,
        request_builder=builder,
        request_build_ready=lambda p, done: not p.request_id.startswith("defer"),
        abort_callback=aborted_cb.append,
    ) as st:
        stage_ref["s"] = st
        sched = st.sched
        await st.send("slow-pending", n=2)
        await st.send("slow-backlog", n=2)
        await st.send("defer-me", n=2)
        await sched.inbox.send(IncomingMessage("ghost", "stream_chunk", "x"))
        await wait_until(lambda: "slow-pending" in sched.admission.pending and "defer-me" in sched.admission.deferred)
        assert any(p.request_id == "slow-backlog" for p in sched.admission.backlog)
        for rid in ("slow-pending", "slow-backlog", "defer-me", "ghost"):
            sched.abort(rid)
        gate.set()
        msgs = await st.done("slow-pending", "slow-backlog", "defer-me")
        assert all(m.type == "error" and isinstance(m.data, errors.RequestAbortedError) for m in msgs)
        assert "ghost" not in sched.admission.chunks
        # an id aborted before it arrives is refused on arrival, exactly once
        sched.abort("early")
        await st.send("early", n=2)
        (early,) = await st.done("early")
        assert isinstance(early.data, errors.RequestAbortedError)
        await asyncio.sleep(0.05)
        assert sched.admission.active_ids() == []
    assert aborted_cb == ["slow-pending", "slow-backlog", "defer-me", "ghost", "early"]


async def test_tombstones_are_bounded():
    async with Stage(aborted_id_cap=100, aborted_id_keep=50) as st:
        for i in range(1000):
            st.sched.abort(f"gone-{i}")
        assert len(st.sched.intake.tombstones) <= 100
        assert "gone-999" in st.sched.intake.tombstones and "gone-0" not in st.sched.intake.tombstones


async def test_thread_safe_door_submit_and_abort_from_a_plain_thread():
    async with Stage() as st:
        sched = st.sched
        errors_seen = []

        def worker():
            try:
                for i in range(6):
                    n = 500 if i == 5 else 3
                    sched.submit_threadsafe(
                        IncomingMessage(f"t{i}", "new_request", RequestPayload(f"t{i}", [1, 2, i], SamplingParams(max_new_tokens=n, ignore_eos=True)))
                    )
                while "t5" not in sched.emission.live or not sched.emission.live["t5"].req.output_ids:
                    threading.Event().wait(0.001)
                sched.abort_threadsafe("t5")
            except Exception as exc:  # pragma: no cover - reported below
                errors_seen.append(exc)

        th = threading.Thread(target=worker)
        th.start()
        msgs = await st.done(*[f"t{i}" for i in range(6)])
        th.join()
        assert errors_seen == []
        assert [m.type for m in msgs] == ["result"] * 5 + ["error"]
        assert isinstance(msgs[5].data, errors.RequestAbortedError)


class _ActiveAtLaunch:
    """A runner mixin recording how many requests the stage had admitted at each launch."""

    def launch(self, sched_output, lookahead=False):
        self.active_at_launch.append(self.active())
        return super().launch(sched_output, lookahead=lookahead)


@pytest.mark.parametrize("loop", ["normal", "overlap"])
async def test_a_cold_burst_launches_its_first_prefill_before_admitting_the_rest(loop):
    """40 requests arrive at once on an idle engine: the first prefill launches once one
    prefill budget of them is admitted, and every request is still served."""
    from omni_async import Engine

    engine = Engine.from_pretrained("tiny", loop=loop, max_prefill_tokens=256, chunked_prefill_size=256)
    runner = engine.stack.runner
    runner.__class__ = type("ActiveAtLaunchRunner", (_ActiveAtLaunch, type(runner)), {})
    runner.active_at_launch = []
    runner.active = lambda: engine.scheduler.info()["active_requests"]
    prompts = [[3 + i, 4, 5, 6] * 16 for i in range(40)]  # 64 tokens each: 4 fill the budget
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True)
    async with engine:
        results = await asyncio.gather(*(engine.generate(input_ids=p, sampling=sp) for p in prompts))
        again = await engine.generate(input_ids=prompts[-1], sampling=sp)
    assert all(len(r.output_ids) == 3 for r in results)
    assert results[-1].output_ids == again.output_ids
    assert runner.active_at_launch[0] <= 4, runner.active_at_launch[:5]
    assert max(runner.active_at_launch) >= 36  # the rest were admitted while it ran


async def test_a_cold_burst_whose_first_budget_is_refused_still_serves_the_rest():
    """The first prefill budget of a cold burst is all refused at the build: the loop
    must take the rest of the burst without waiting for another message."""
    async with Stage(max_prefill_tokens=64, chunked_prefill_size=64) as st:
        bad = [f"bad{i}" for i in range(4)]
        good = [f"good{i}" for i in range(3)]
        for rid in bad:  # 64 tokens each, one out of the vocabulary
            payload = RequestPayload(rid, [5] * 63 + [10**9], SamplingParams(max_new_tokens=4, ignore_eos=True))
            st.sched.inbox.send_nowait(IncomingMessage(rid, "new_request", payload))
        for rid in good:
            payload = RequestPayload(rid, [5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True))
            st.sched.inbox.send_nowait(IncomingMessage(rid, "new_request", payload))
        out = await st.done(*bad, *good, timeout=20.0)
    assert [m.type for m in out] == ["error"] * 4 + ["result"] * 3
    assert all(isinstance(m.data, errors.InvalidRequestError) for m in out[:4])
