"""The decode step's columns (``core.decode_slots``) build the same steps as the
per-request path: two batch cores, one with the columns and one without, are driven side
by side through the same arrivals, tokens, stop ids, aborts, retractions under KV
pressure, prefix-cache hits, chunked and mixed prefill, in the normal loop's order
(process, then schedule) and the lookahead loops' (schedule the next step before
processing the one in flight); every scheduled step, every outcome and every request's
state must be equal, and the columns' limits equal ``decode_limits``."""

from __future__ import annotations

import random

import pytest

from omni_async.config import SamplingParams, SchedulerConfig
from omni_async.core.batch_core import NativeBatchCore
from omni_async.core.multi_step import DecodeSteps
from omni_async.core.plan import settle
from omni_async.core.request import Request, decode_limits
from omni_async.kv.allocator import PageAllocator

CTX = 160


def make_core(slots: bool, k: int, pages: int, mixed: bool, chunk: int | None) -> NativeBatchCore:
    config = settle(SchedulerConfig(max_running_requests=12, max_prefill_tokens=256, chunked_prefill_size=chunk or 256,
                                    mixed_prefill=mixed, enable_prefix_cache=True))
    core = NativeBatchCore(config, PageAllocator(pages, 4), CTX, decode_steps=DecodeSteps(((3, k),)) if k > 1 else DecodeSteps())
    core.slots.enabled = slots
    return core


def token(rid: str, index: int) -> int:
    return random.Random(f"{rid}/{index}").randrange(40)


def step_view(batch) -> tuple:
    return (batch.mode, [r.rid for r in batch.reqs], batch.epochs, batch.prefix_lens, batch.extend_lens, batch.samples_kept,
            batch.input_ids, [(i, r.rid) for i, r in batch.inflight_inputs], batch.sample_indices, batch.page_counts,
            [list(t[:c]) for t, c in zip(batch.page_tables, batch.page_counts)], batch.row_steps, batch.grammar_rows)


def tokens_for(batch) -> list[int]:
    forwards = max(batch.row_steps or [1])
    return [token(batch.reqs[i].rid, batch.sample_indices[i] + j) for j in range(forwards) for i in range(batch.size)]


def request_view(req: Request) -> tuple:
    return (req.rid, req.output_ids, req.num_cached, req.num_inflight, req.epoch, list(req.pages), req.finish_reason)


def new_request(rng: random.Random, n: int) -> Request:
    prompt = [1, 2, 3, 4, 5, 6, 7, 8][: rng.randint(0, 8)] + [rng.randrange(50) for _ in range(rng.randint(1, 40))]
    sp = SamplingParams(max_new_tokens=rng.randint(5, 60), min_new_tokens=rng.choice([0, 0, 5]),
                        stop_token_ids=rng.choice([[], [], [3]]), ignore_eos=True)
    return Request(rid=f"q{n}", prompt_ids=prompt, sampling=sp)


def drive(seed: int, k: int, pages: int, lookahead: bool, mixed: bool, chunk: int | None) -> tuple[int, int]:
    rng = random.Random(seed)
    cores = [make_core(True, k, pages, mixed, chunk), make_core(False, k, pages, mixed, chunk)]
    reqs: list[list[Request]] = [[], []]
    inflight: list = [None, None]
    arrivals = steps = 0
    scheduled: dict[int, object] = {}  # the columns' core's steps by id (ScheduledBatch.carried names one)
    for _ in range(400):
        if rng.random() < 0.25 and arrivals < 60:
            for _ in range(rng.randint(1, 4)):
                r = new_request(random.Random(f"{seed}/{arrivals}"), arrivals)
                arrivals += 1
                for c, out in zip(cores, reqs):
                    clone = Request(rid=r.rid, prompt_ids=list(r.prompt_ids), sampling=r.sampling)
                    out.append(clone)
                    c.add_request(clone)
        if rng.random() < 0.05 and arrivals:
            rid = f"q{rng.randrange(arrivals)}"
            for c in cores:
                c.abort(rid)
        views = []
        pause = rng.random() < 0.03  # a pause in retract mode: drained, every running request back to waiting
        for i, c in enumerate(cores):
            c.reap_aborted()
            if pause:
                if inflight[i] is not None:
                    views.append([(o.req.rid, o.tokens, o.finished) for o in c.process_result(inflight[i], tokens_for(inflight[i]))])
                    inflight[i] = None
                views.append([r.rid for r in c.retract_all()])
            if not lookahead and inflight[i] is not None:
                views.append([(o.req.rid, o.token, o.tokens, o.finished) for o in c.process_result(inflight[i], tokens_for(inflight[i]))])
                inflight[i] = None
            batch = c.get_next_batch() if c.has_work() else None
            if lookahead and inflight[i] is not None:
                prev = inflight[i]
                views.append([(o.req.rid, o.token, o.tokens, o.finished) for o in c.process_result(prev, tokens_for(prev))])
            inflight[i] = batch
            views.append(None if batch is None else step_view(batch))
            if i == 0 and batch is not None:
                check_carried(batch, scheduled)
            if batch is not None and batch.is_decode and c.slots.reqs is not None:  # the columns' limits: the length rule's
                live = [j for j, r in enumerate(c.slots.reqs) if r.finish_reason is None]
                assert [c.slots.limits[j] for j in live] == decode_limits([c.slots.reqs[j] for j in live], CTX)
        assert views[: len(views) // 2] == views[len(views) // 2 :]
        assert [request_view(r) for r in reqs[0]] == [request_view(r) for r in reqs[1]]
        steps += inflight[0] is not None
    assert [r.finish_reason for r in reqs[0]] == [r.finish_reason for r in reqs[1]]
    assert sum(b.carried is not None for b in scheduled.values()) >= cores[0].slots.hits // 2 or not cores[0].slots.hits
    return cores[0].slots.hits, cores[0].num_retractions


def check_carried(batch, scheduled: dict) -> None:
    """A step that says its rows are an earlier step's at an index array (the runner then
    takes their slots by that mask, ``InputBatch._lookup``) has exactly those rows, in
    those epochs; only a decode step from the columns says so."""
    scheduled[batch.step_id] = batch
    if batch.carried is None:
        return
    assert batch.is_decode
    prev = scheduled[batch.carried[0]]
    idx = batch.carried[1].tolist()
    assert all(a is b for a, b in zip(batch.reqs, [prev.reqs[j] for j in idx])) and len(idx) == batch.size
    assert batch.epochs == [prev.epochs[j] for j in idx]


@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("k", [1, 3, 4])
def test_columns_build_the_same_steps_as_the_per_request_path(lookahead, k):
    hits = retractions = 0
    for seed in range(6):
        h, r = drive(seed, k, pages=rng_pages(seed), lookahead=lookahead, mixed=seed % 2 == 1, chunk=16 if seed % 3 == 0 else None)
        hits, retractions = hits + h, retractions + r
    assert hits > 100  # the columns took most decode steps
    assert retractions > 0  # and KV pressure made the per-request path retract


def rng_pages(seed: int) -> int:
    return 60 if seed % 2 == 0 else 400


def test_the_columns_take_a_steady_running_set_and_keep_its_limits():
    core = make_core(True, 4, 2000, mixed=False, chunk=None)
    for i in range(8):
        core.add_request(Request(rid=f"r{i}", prompt_ids=[5] * (3 + i), sampling=SamplingParams(max_new_tokens=30 + i, ignore_eos=True)))
    batch, seen = core.get_next_batch(), 0
    while batch is not None:
        core.process_result(batch, tokens_for(batch))
        batch = core.get_next_batch()
        if batch is not None and batch.is_decode and core.slots.reqs is not None:
            seen += 1
            assert core.slots.limits.tolist() == decode_limits(core.running, CTX)
    assert seen >= 5 and core.slots.hits >= 5
    assert core.kv_is_fully_free()
