"""How prefill and decode steps share the device while prompts arrive
(``core.mixed_prefill.prefill_turn``): without mixing, running requests sit out one
prefill step at most, then decode; prompts still start; tokens are the same as with
mixing, in every loop. While the running set is nearly full, finished requests are
replaced a few at a time (``core.mixed_prefill.refill_due``)."""

from __future__ import annotations

import pytest

from omni_async import Engine, SamplingParams
from omni_async.core.request import Request, RequestData
from omni_async.core.runner_io import SchedulerOutput, SchedulerRequest

from .conftest import LOOPS, assert_kv_free


def _request(rid: str, prompt_len: int, new_tokens: int) -> Request:
    req = Request(rid=rid, prompt_ids=[3 + (i % 50) for i in range(prompt_len)],
                  sampling=SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    req.data = RequestData(req=req)
    return req


def _steps(engine: Engine, arrivals: dict[int, list[Request]]) -> list[tuple[str, bool]]:
    """Run the core and runner step by step; ``arrivals[i]``: requests added before step i.
    Each step as (``"prefill"`` or ``"decode"``, whether a request was running before it)."""
    core, runner = engine.stack.core, engine.stack.runner
    kinds = []
    for i in range(1000):
        for req in arrivals.get(i, []):
            core.add_request(req)
        if not core.has_work() and i > max(arrivals):
            break
        running_before = any(not r.finished() for r in core.running)
        batch = core.get_next_batch()
        if batch is None:
            continue
        kinds.append(("prefill" if batch.mode.is_extend() else "decode", running_before))
        out = runner.collect(runner.launch(SchedulerOutput([SchedulerRequest(r.rid, r.data) for r in batch.reqs], batch)))
        core.process_result(batch, out.token_ids, out.logprobs)
    return kinds


def test_running_requests_wait_for_one_prefill_step_at_most():
    engine = Engine.from_pretrained("tiny", chunked_prefill_size=32, page_size=8, decode_steps=1)
    running = [_request(f"r{i}", 10, 40) for i in range(3)]
    burst = [_request(f"b{i}", 100, 4) for i in range(4)]  # 400 prompt tokens: several prefill steps
    kinds = _steps(engine, {0: running, 3: burst})
    prefills_while_running = [j for j, (kind, ran) in enumerate(kinds) if kind == "prefill" and ran]
    assert len(prefills_while_running) >= 4, kinds  # the burst took several steps while others decoded
    for j in prefills_while_running:  # never two prefill steps in a row while requests run
        assert j + 1 >= len(kinds) or kinds[j + 1][0] == "decode", kinds
    assert all(r.finish_reason == "length" for r in running + burst)
    assert [len(r.output_ids) for r in burst] == [4] * 4
    assert engine.stack.core.kv_is_fully_free()


def _refill_steps(finish_every: int) -> tuple[list[tuple[str, int, int, int]], list[Request]]:
    """64 running requests (64 slots) of which one finishes every ``finish_every`` decode
    steps, and 8 waiting: each step as (kind, rows, free slots and waiting requests before it)."""
    engine = Engine.from_pretrained("tiny", max_running_requests=64, page_size=8, decode_steps=1)
    core, runner = engine.stack.core, engine.stack.runner
    reqs = [_request(f"r{i}", 6, 2 + finish_every * (i + 1)) for i in range(64)] + [_request(f"w{i}", 6, 3) for i in range(8)]
    for req in reqs:
        core.add_request(req)
    steps = []
    while core.has_work():
        free = 64 - len([r for r in core.running if not r.finished()])
        batch = core.get_next_batch()
        steps.append(("prefill" if batch.mode.is_extend() else "decode", batch.size, free, len(core.waiting)))
        out = runner.collect(runner.launch(SchedulerOutput([SchedulerRequest(r.rid, r.data) for r in batch.reqs], batch)))
        core.process_result(batch, out.token_ids, out.logprobs)
    assert all(r.finish_reason == "length" for r in reqs)
    assert [len(r.output_ids) for r in reqs[64:]] == [3] * 8
    assert core.kv_is_fully_free()
    return steps, reqs


def test_a_nearly_full_running_set_is_refilled_a_few_prompts_at_a_time():
    """One request ends each decode step: the waiting prompts start two or more per
    prefill step (two slots are 1/32 of 64), not one per step after each finish."""
    steps, _ = _refill_steps(finish_every=1)
    refills = [rows for kind, rows, _, _ in steps[1:] if kind == "prefill"]
    assert refills and all(rows >= 2 for rows in refills) and sum(refills) == 8, steps


def test_a_deferred_refill_waits_a_few_decode_steps_at_most():
    """One request ends every 8 decode steps: a free slot waits at most
    ``PREFILL_MAX_DEFERRALS`` decode steps for another, then is refilled alone."""
    from omni_async.core.mixed_prefill import PREFILL_MAX_DEFERRALS

    steps, _ = _refill_steps(finish_every=8)
    assert 1 in [rows for kind, rows, _, _ in steps[1:] if kind == "prefill"], steps  # refilled alone
    run = 0  # decode steps in a row taken while a slot was free and prompts waited
    for kind, _, free, waiting in steps:
        run = run + 1 if kind == "decode" and free and waiting else 0
        assert run <= PREFILL_MAX_DEFERRALS, steps


def test_mixed_prefill_steps_may_follow_each_other():
    """With mixing the running requests ride in each prefill step, so nothing waits."""
    engine = Engine.from_pretrained("tiny", mixed_prefill=True, chunked_prefill_size=32, page_size=8, decode_steps=1)
    kinds = _steps(engine, {0: [_request("r0", 10, 40)], 3: [_request("b0", 200, 4)]})
    runs = [j for j in range(len(kinds) - 1) if kinds[j] == kinds[j + 1] == ("prefill", True)]
    assert runs, kinds
    assert engine.stack.core.stats()["mixed_decode_rows"] > 0


@pytest.mark.parametrize("loop", LOOPS)
async def test_alternating_steps_give_the_mixed_tokens(loop):
    """Streams decoding while a burst of prompts arrives: the same tokens with and
    without mixing (seeded sampling), one terminal each, KV free after."""
    prompts = [[5 + (i * 7 + j) % 90 for j in range(12 + 40 * (i % 3))] for i in range(8)]
    outs = {}
    for mixed in (False, True):
        engine = Engine.from_pretrained("tiny", loop=loop, mixed_prefill=mixed, chunked_prefill_size=32, page_size=8)
        async with engine:
            first = [await engine.submit(input_ids=p, sampling=SamplingParams(max_new_tokens=24, temperature=0.8, seed=i,
                                                                             ignore_eos=True)) for i, p in enumerate(prompts[:3])]
            streams = [h.__aiter__() for h in first]
            for s in streams:
                await s.__anext__()  # they decode before the burst arrives
            later = [await engine.submit(input_ids=p, sampling=SamplingParams(max_new_tokens=24, temperature=0.8, seed=10 + i,
                                                                             ignore_eos=True)) for i, p in enumerate(prompts[3:])]
            results = [await h.result() for h in first + later]
        assert_kv_free(engine)
        outs[mixed] = [r.output_ids for r in results]
        assert all(len(o) == 24 for o in outs[mixed])
    assert outs[False] == outs[True]
