"""The normal loop's early launch (``core.early_launch``): the next decode step scheduled
from a step's tokens before the step is processed must be the step today's order (process,
then schedule) builds, and change no token and no terminal message.

At the core: two batch cores driven side by side through the same arrivals, tokens, stop
ids, ``min_new_tokens``, aborts (at the head of an iteration, and marked while a step
runs), pauses that retract, and small KV; one takes the early order whenever
``schedule_early`` answers, the other never. Every step, every outcome and every request's
state must be equal, and the early order must have been taken. Through the engine: the
normal loop with and without the early launch and the two lookahead loops give the same
tokens and finish reasons (stop ids, EOS, ``min_new_tokens``, penalties, multi-step decodes,
small KV with retractions), one terminal per request under aborts mid-run, and KV freed."""

from __future__ import annotations

import asyncio
import random

import pytest

from omni_async import Engine, SamplingParams, errors
from omni_async.config import SchedulerConfig
from omni_async.core.batch_core import NativeBatchCore
from omni_async.core.multi_step import DecodeSteps
from omni_async.core.plan import settle
from omni_async.core.request import Request, stop_index
from omni_async.kv.allocator import PageAllocator

from .conftest import LOOPS, assert_kv_free

CTX = 160


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")  # conftest: tiny steps beside the loop thread


# ---------------------------------------------------------------- the core, side by side


def make_core(k: int, pages: int) -> NativeBatchCore:
    config = settle(SchedulerConfig(max_running_requests=12, max_prefill_tokens=256, chunked_prefill_size=256,
                                    enable_prefix_cache=True))
    return NativeBatchCore(config, PageAllocator(pages, 4), CTX, decode_steps=DecodeSteps(((3, k),)) if k > 1 else DecodeSteps())


def token(rid: str, index: int) -> int:
    return random.Random(f"{rid}/{index}").randrange(12)  # small: stop ids come up often


def tokens_for(batch) -> list[int]:
    forwards = max(batch.row_steps or [1])
    return [token(batch.reqs[i].rid, batch.sample_indices[i] + j) for j in range(forwards) for i in range(batch.size)]


def step_view(batch) -> tuple:
    """A step as the runner sees it (page ids aside: the early order allocates the next
    step's pages before the ending rows free theirs, so the ids may differ, not the counts)."""
    return (batch.mode, [r.rid for r in batch.reqs], batch.epochs, batch.prefix_lens, batch.extend_lens, batch.samples_kept,
            batch.input_ids, batch.sample_indices, batch.page_counts, batch.row_steps)


def request_view(req: Request) -> tuple:
    return (req.rid, list(req.output_ids), req.num_cached, req.num_inflight, req.epoch, len(req.pages), req.finish_reason)


def new_request(rng: random.Random, n: int) -> Request:
    prompt = [rng.randrange(50) for _ in range(rng.randint(1, 40) if rng.random() < 0.85 else rng.randint(100, 150))]
    sp = SamplingParams(max_new_tokens=rng.randint(9, 50), min_new_tokens=rng.choice([0, 0, 4, 9]),
                        stop_token_ids=rng.choice([[], [], [3], [5, 7]]), ignore_eos=rng.random() < 0.7)
    return Request(rid=f"q{n}", prompt_ids=prompt, sampling=sp, eos_token_ids=(11,))


def outcome_view(outcomes) -> list:
    return [(o.req.rid, o.token, o.tokens, o.finished) for o in outcomes]


def drive(seed: int, k: int, pages: int) -> tuple[int, int]:
    """Two cores, one iteration at a time: the head (arrivals, aborts, a pause), then the
    step: today's order (schedule, run, process) on one; on the other the step launched
    early by the iteration before, or scheduled now, then the next one scheduled early
    when the core decides it and no event waits for the next head (the stepper's ``wake``),
    then the processing. Returns the early steps taken and the retractions."""
    rng = random.Random(seed)
    early, today = make_core(k, pages), make_core(k, pages)
    cores = (early, today)
    reqs: list[list[Request]] = [[], []]
    ahead = None  # the early core's step launched early
    arrivals = taken = 0
    head = {"arrive": 0, "abort": None, "pause": False}
    for _ in range(500):
        for _ in range(head["arrive"]):
            r = new_request(random.Random(f"{seed}/{arrivals}"), arrivals)
            arrivals += 1
            for c, out in zip(cores, reqs):
                clone = Request(rid=r.rid, prompt_ids=list(r.prompt_ids), sampling=r.sampling, eos_token_ids=r.eos_token_ids)
                out.append(clone)
                c.add_request(clone)
        if head["abort"] is not None:
            for c in cores:
                c.abort(head["abort"])
        views: list[list] = [[], []]
        for c, v in zip(cores, views):
            v.append(sorted(r.rid for r in c.reap_aborted()))
            if head["pause"]:
                assert c is today or ahead is None  # a pause arrived: nothing was launched early
                v.append([r.rid for r in c.retract_all()])
        # What arrives while this step runs waits for the next head (and sets the wake).
        head = {"arrive": rng.randint(1, 4) if rng.random() < 0.2 and arrivals < 60 else 0,
                "abort": f"q{rng.randrange(arrivals)}" if arrivals and rng.random() < 0.04 else None,
                "pause": rng.random() < 0.02}
        wake = bool(head["arrive"] or head["abort"] is not None or head["pause"])
        mid_abort = f"q{rng.randrange(arrivals)}" if arrivals and rng.random() < 0.04 else None
        batch_t = today.get_next_batch() if today.has_work() else None
        batch_e = ahead if ahead is not None else (early.get_next_batch() if early.has_work() else None)
        views[0].append(None if batch_e is None else step_view(batch_e))
        views[1].append(None if batch_t is None else step_view(batch_t))
        assert [request_view(r) for r in reqs[0]] == [request_view(r) for r in reqs[1]]
        if mid_abort is not None:  # marked while the step runs: its processing ends it
            for c in cores:
                c.abort(mid_abort)
        ahead = None
        if batch_e is not None:
            toks = tokens_for(batch_e)
            if not wake:
                ahead = early.schedule_early(batch_e, toks)
                taken += ahead is not None
            views[0].append(outcome_view(early.process_result(batch_e, toks)))
        if batch_t is not None:
            views[1].append(outcome_view(today.process_result(batch_t, tokens_for(batch_t))))
        assert views[0] == views[1]
        if not any(c.has_work() for c in cores) and arrivals >= 60:
            break
    assert [request_view(r) for r in reqs[0]] == [request_view(r) for r in reqs[1]]
    assert early.kv.held_pages == today.kv.held_pages  # (cached pages aside: their ids may differ)
    return taken, early.num_retractions


@pytest.mark.parametrize("k", [1, 4])
def test_the_early_order_builds_the_steps_and_outcomes_of_todays(k):
    taken = retractions = 0
    for seed in range(8):
        t, r = drive(seed, k, pages=50 if seed % 2 else 400)
        taken, retractions = taken + t, retractions + r
    assert taken > 100  # the early order was taken for most steady decode steps
    assert retractions > 0  # and small KV made the core retract between them


def test_a_row_whose_tokens_end_it_is_left_out_of_the_early_step():
    """Stop ids past ``min_new_tokens``, EOS unless ignored, the length limit and an abort
    marked while the step ran: each such row is out of the step launched early, the others
    in it, and the processing ends exactly those rows."""
    core = make_core(4, 400)
    specs = [dict(max_new_tokens=40, stop_token_ids=[3]), dict(max_new_tokens=40, stop_token_ids=[3], min_new_tokens=30),
             dict(max_new_tokens=40, ignore_eos=False), dict(max_new_tokens=40), dict(max_new_tokens=5), dict(max_new_tokens=40)]
    for i, kw in enumerate(specs):
        kw.setdefault("ignore_eos", True)
        core.add_request(Request(rid=f"r{i}", prompt_ids=[i + 1] * 5, sampling=SamplingParams(**kw), eos_token_ids=(11,)))
    batch = core.get_next_batch()
    core.process_result(batch, [7] * batch.size)
    batch = core.get_next_batch()  # one decode step of 4 forwards, every row
    assert batch.is_decode and batch.row_steps == [4] * 6
    n = batch.size
    grid = [[7] * n for _ in range(4)]
    grid[1][0] = 3  # r0: its stop id
    grid[2][1] = 3  # r1: its stop id, before min_new_tokens: runs on
    grid[3][2] = 11  # r2: EOS, not ignored
    grid[0][3] = 11  # r3: EOS, ignored: runs on
    core.abort("r5")  # marked while the step ran
    toks = [t for row in grid for t in row]
    ahead = core.schedule_early(batch, toks)
    assert ahead is not None and [r.rid for r in ahead.reqs] == ["r1", "r3"]  # r4 ends by length (5 tokens)
    assert ahead.input_ids == [grid[3][1], grid[3][3]]
    core.process_result(batch, toks)
    assert {r.rid: r.finish_reason for r in batch.reqs} == {
        "r0": "stop", "r1": None, "r2": "stop", "r3": None, "r4": "length", "r5": "abort"}
    assert ahead.row_steps is None and [r.num_inflight for r in ahead.reqs] == [1, 1]  # two rows: one forward (the tiers)


def test_stop_index_is_the_token_by_token_rule():
    """``request.stop_index`` (the early launch's and a sample-first row's stop rule) against
    the one-token rule of the finish checks (``step_results``: ``token in stop_ids and
    n > min_new_tokens``), over every short row of a small alphabet."""
    from itertools import product

    for stops in (frozenset(), frozenset({1}), frozenset({0, 2})):
        for kept in range(4):
            for least in range(7):
                for length in range(1, 5):
                    for row in product(range(3), repeat=length):
                        want = next((j for j, t in enumerate(row) if t in stops and kept + j + 1 > least), None)
                        assert stop_index(list(row), stops, kept, least) == want


def test_no_early_step_with_a_request_waiting_or_near_the_context():
    core = make_core(4, 400)
    for i in range(4):
        core.add_request(Request(rid=f"r{i}", prompt_ids=[i + 1] * 5, sampling=SamplingParams(max_new_tokens=40, ignore_eos=True)))
    core.process_result(b := core.get_next_batch(), tokens_for(b))
    batch = core.get_next_batch()
    core.add_request(Request(rid="late", prompt_ids=[1] * 5, sampling=SamplingParams(max_new_tokens=4, ignore_eos=True)))
    assert core.schedule_early(batch, tokens_for(batch)) is None  # today's order admits it first
    core.process_result(batch, tokens_for(batch))
    near = make_core(4, 400)
    near.add_request(Request(rid="long", prompt_ids=[1] * (CTX - 4), sampling=SamplingParams(max_new_tokens=40, ignore_eos=True)))
    near.process_result(b := near.get_next_batch(), tokens_for(b))
    batch = near.get_next_batch()
    assert near.schedule_early(batch, tokens_for(batch)) is None


# ---------------------------------------------------------------- through the engine


def engine_mix(seed: int, n: int, stops: list[int]) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    mix = []
    for i in range(n):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 60))]
        kw: dict = dict(max_new_tokens=rng.randint(1, 40), ignore_eos=i % 4 != 0)
        if i % 3 == 1:
            kw.update(stop_token_ids=stops, min_new_tokens=min(kw["max_new_tokens"], rng.choice([0, 3, 8])))
        if i % 5 == 4:
            kw.update(temperature=0.9, top_k=50, seed=rng.randrange(1 << 31))
        if i % 7 == 3:  # penalties read the tokens before: the step launched early must see them
            kw.update(repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.4, logit_bias={5: 2.0})
        mix.append((prompt, SamplingParams(**kw)))
    return mix


async def run_engine(loop: str, mix, *, early: bool = True, aborts: dict[int, int] | None = None, **limits):
    """Per request its tokens and finish reason, or ("aborted", ids); the early steps."""
    aborts = aborts or {}
    engine = Engine.from_pretrained("tiny", loop=loop, **limits)
    if not early:
        engine.stack.core.schedule_early = lambda batch, tokens: None
    async with engine:

        async def one(i: int, prompt, sp):
            handle = await engine.submit(input_ids=prompt, sampling=sp, request_id=f"q{i}")
            got: list[int] = []
            reason = None
            try:
                async for delta in handle:
                    got.extend(delta.token_ids)
                    reason = delta.finish_reason or reason
                    if i in aborts and len(got) >= aborts[i]:
                        await engine.abort(handle.request_id)
            except errors.RequestAbortedError as exc:
                return ("aborted", exc.output_ids)
            return (got, reason)

        outs = await asyncio.gather(*(one(i, p, sp) for i, (p, sp) in enumerate(mix)))
        early_steps = engine.scheduler.info()["early_steps"]
    assert_kv_free(engine)
    return outs, early_steps


def stop_ids_seen(outs) -> list[int]:
    """Two tokens the model writes mid-sequence, as stop ids that will come up."""
    counts: dict[int, int] = {}
    for toks, _ in outs:
        for t in toks[2:]:
            counts[t] = counts.get(t, 0) + 1
    return sorted(counts, key=lambda t: -counts[t])[:2]


@pytest.mark.parametrize("limits", [
    dict(decode_steps=4),
    dict(page_size=8, kv_capacity_tokens=8 * 40, max_running_requests=10, decode_steps=4),
    dict(),
], ids=["multi_step", "small_kv", "one_forward"])
async def test_tokens_and_finishes_equal_with_and_without_the_early_launch(limits):
    probe, _ = await run_engine("normal", engine_mix(5, 6, []), **limits)
    mix = engine_mix(5, 18, stop_ids_seen(probe))
    ref, taken = await run_engine("normal", mix, **limits)
    assert taken > 0
    assert any(reason == "stop" for _, reason in ref)
    off, none_taken = await run_engine("normal", mix, early=False, **limits)
    assert none_taken == 0 and off == ref
    for loop in LOOPS[1:]:
        got, _ = await run_engine(loop, mix, **limits)
        assert got == ref, loop


async def test_aborts_mid_run_one_terminal_each_and_kv_freed():
    mix = engine_mix(9, 16, [])
    full, _ = await run_engine("normal", mix, early=False, decode_steps=4)
    aborts = {i: 5 for i in range(0, 16, 3)}
    got, taken = await run_engine("normal", mix, aborts=aborts, decode_steps=4)
    assert taken > 0
    for i, (out, ref) in enumerate(zip(got, full)):
        if out[0] == "aborted":
            assert i in aborts and out[1] == ref[0][: len(out[1])]  # what it kept is today's prefix
        else:
            assert out == ref  # ran to its end (or finished before its abort)
