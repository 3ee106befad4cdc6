"""Constrained rows several tokens a step: masks computed between a step's forwards
(``core.multi_step.between_steps``, ``runners/multi_forward.py``, ``structured/between.py``).

A masked row's next mask needs the token it just sampled, so it took one token a step
while free rows took the plan's k; a step of mostly masked rows now runs k forwards, the
host reading each forward's tokens, advancing the matchers and filling the next forward's
masks between them. The tokens must be those of one forward a step (greedy, and seeded
sampling: a draw is keyed by its generation index), in every loop."""

# Rows that sample under their masks: optimistic_grammar=False keeps every constrained row
# there (rows sampling first beside them: tests/test_optimistic_grammar.py).

from __future__ import annotations

import asyncio
import json

import anyio
import pytest

pytest.importorskip("llguidance")

from omni_async import Engine, SamplingParams  # noqa: E402

from .conftest import assert_kv_free  # noqa: E402
from .constrained_cases import ENDLESS, SCHEMA, greedy, record_terminals, seeded, submit_constrained  # noqa: E402
from .test_constrained import validate  # noqa: E402

LOOPS = ["normal", "overlap", "async_decode"]
N = 8


def endless(i: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=40 + 3 * i, json_schema=ENDLESS, temperature=0.7, seed=i)


async def run(loop: str, decode_steps: int, sampling: list[SamplingParams]) -> tuple[list, dict]:
    async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu", loop=loop,
                                      decode_steps=decode_steps) as engine:
        results = await asyncio.gather(*[engine.generate(prompt=f"record {i}:", sampling=sp) for i, sp in enumerate(sampling)])
        info = engine.scheduler.info()
    assert_kv_free(engine)
    return results, info


def masked_tokens_a_step(info: dict) -> float:
    """Tokens a masked row sampled per decode step it was in: each step masks its first
    forward's rows (``grammar_mask_rows``), and the forwards after it under masks computed
    between them (``grammar_between_rows``)."""
    return (info["grammar_mask_rows"] + info.get("grammar_between_rows", 0)) / info["grammar_mask_rows"]


def assert_one_forward_outputs(results: list, reference: list, endless_rows: bool, loop: str) -> None:
    """The tokens of one forward a step (``reference``), and each output valid: an endless
    schema's rows run to their length, the others complete their schema."""
    assert [r.output_ids for r in results] == [r.output_ids for r in reference], loop
    for r in results:
        if endless_rows:
            assert r.finish_reason == "length" and r.text.startswith("[{")
        else:
            assert r.finish_reason == "stop", r.text
            validate(json.loads(r.text), SCHEMA)


@pytest.mark.parametrize("make", [greedy, seeded, endless], ids=["greedy", "seeded", "endless"])
async def test_constrained_rows_take_several_tokens_a_step_with_one_forward_a_steps_tokens(make):
    """All rows constrained, four forwards a step: the tokens of one forward a step in the
    three loops, every output valid, and the rows several tokens a step (fewer than half
    the decode steps). Fails where a masked row samples one token a step."""
    sampling = [make(i) for i in range(N)]
    reference, ref_info = await run("normal", 1, sampling)
    for loop in LOOPS:
        results, info = await run(loop, 4, sampling)
        assert_one_forward_outputs(results, reference, make is endless, loop)
        assert info["decode_steps"] <= ref_info["decode_steps"] / 2, (loop, info["decode_steps"], ref_info["decode_steps"])
        assert masked_tokens_a_step(info) > 2, (loop, info)
        assert info["grammar_between_forwards"] > 0 and info["grammar_late_mask_steps"] == 0


@pytest.mark.parametrize("late", [False, True])
async def test_rows_admitted_apart_step_together(late, monkeypatch):
    """Prompts admitted over several prefill steps reach their first decode step apart; the
    overlap loop then waits for the masked rows in flight (``multi_step.waits_for_between``)
    instead of stepping the ready ones alone, so the rows do not settle into groups
    stepping in turn (each step reading the weights k times for part of the batch): about
    one decode step per four tokens of a row, not three (37 before the wait). ``late``
    (``LATE_BETWEEN``): no late step while prompts wait for a slot (27 decode steps with them)."""
    from omni_async.core import multi_step

    monkeypatch.setattr(multi_step, "LATE_BETWEEN", late)
    sampling = [SamplingParams(max_new_tokens=40, json_schema=ENDLESS, temperature=0.7, seed=i) for i in range(16)]
    async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu", loop="overlap", decode_steps=4,
                                      max_prefill_tokens=40) as engine:
        results = await asyncio.gather(*[engine.generate(prompt=f"record number {i}: " * 3, sampling=sp)
                                         for i, sp in enumerate(sampling)])
        info = engine.scheduler.info()
    assert_kv_free(engine)
    assert info["prefill_steps"] > 4  # admitted apart
    assert all(len(r.output_ids) == 40 for r in results)
    assert info["decode_steps"] <= 40 / 4 + 4, info["decode_steps"]


async def test_rows_whose_grammar_ends_mid_step_stop_there():
    """Short schemas complete inside a step of eight forwards: the row ends at its closing
    token (its matcher took it during the step), the forwards after it are dropped, and
    the next rows of the step run on; each output is the one-forward path's."""
    from omni_async.structured import between

    ended: list[int] = []
    real = between.StepMasks.next_mask

    def next_mask(self, j):
        mask = real(self, j)
        ended.append(len(self.batch.ended_ahead))
        return mask

    sampling = [greedy(i) for i in range(N)]
    reference, _ = await run("normal", 1, sampling)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(between.StepMasks, "next_mask", next_mask)
        results, info = await run("overlap", 8, sampling)
    assert max(ended) > 0  # some row's grammar ended before its step's last forward
    assert [r.output_ids for r in results] == [r.output_ids for r in reference]
    for r in results:
        assert r.finish_reason == "stop"
        validate(json.loads(r.text), SCHEMA)


@pytest.mark.parametrize("loop", ["normal", "overlap"])
async def test_free_rows_in_a_mostly_constrained_step_keep_their_tokens(loop):
    """Two free rows beside six masked ones run in the same forward-by-forward steps, their
    masks all ones: their tokens are those they get alone, the others' those of one forward
    a step."""
    free = SamplingParams(max_new_tokens=30, temperature=0.9, seed=5, ignore_eos=True)
    mixed = [free if i < 2 else seeded(i) for i in range(N)]
    reference, _ = await run("normal", 1, mixed)
    alone, _ = await run(loop, 4, [free, free])
    results, info = await run(loop, 4, mixed)
    assert [r.output_ids for r in results] == [r.output_ids for r in reference]
    assert [r.output_ids for r in results[:2]] == [r.output_ids for r in alone]
    assert info["grammar_between_forwards"] > 0


@pytest.mark.parametrize("loop,late", [("overlap", False), ("overlap", True), ("async_decode", True)])
async def test_one_terminal_each_when_rows_abort_while_their_step_masks_between_forwards(loop, late, monkeypatch):
    """Aborts landing while a step computes its masks between forwards (sent from inside
    the step, once the rows have 8 tokens): exactly one terminal message per request, KV
    freed once, the others run to their length; short schemas' rows beside them complete
    mid-step and end once too. ``late``: the steps launched while the one before is in
    flight (``multi_step.LATE_BETWEEN``, tests/test_late_between.py): the aborts land while
    the next step may be scheduled and its first forward enqueued."""
    import time

    from omni_async import IncomingMessage, RequestPayload
    from omni_async.backends.native.builder import build_native_stack, build_scheduler
    from omni_async.config import SchedulerConfig
    from omni_async.core import multi_step
    from omni_async.structured import between

    monkeypatch.setattr(multi_step, "LATE_BETWEEN", late)
    config = SchedulerConfig(loop=loop, decode_steps=4, optimistic_grammar=False)
    stack = build_native_stack("tiny", config)
    sched = build_scheduler(stack, config)
    terminals: dict[str, list[str]] = {}
    lengths: dict[str, int] = {}
    landed: list[bool] = []
    real = between.StepMasks.next_mask

    def aborting(self, j):
        reqs = {r.rid: r for r in self.batch.reqs}
        if not landed and "r1" in reqs and len(reqs["r1"].output_ids) >= 8:
            sched.abort_threadsafe("r1")
            sched.abort_threadsafe("r6")
            time.sleep(0.05)  # the loop marks them while this step runs
            landed.append(reqs["r1"].to_finish is not None or reqs["r1"].finish_reason is not None)
        return real(self, j)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(between.StepMasks, "next_mask", aborting)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sched.run)

            tg.start_soon(record_terminals, sched, terminals, lengths)
            await submit_constrained(sched, N, ENDLESS, 96)
            for i in range(N, N + 4):  # rows whose grammar completes mid-step
                sp = SamplingParams(max_new_tokens=64, json_schema=SCHEMA, temperature=0.7, seed=i)
                await sched.inbox.send(IncomingMessage(f"r{i}", "new_request", RequestPayload(f"r{i}", [i + 1, 2], sp)))
            with anyio.fail_after(120):
                while len(terminals) < N + 4:
                    await anyio.sleep(0.01)
            info = sched.info()
            await sched.aclose()
    assert landed == [True]  # the aborts reached the rows while their step ran
    assert {rid: len(kinds) for rid, kinds in terminals.items()} == {f"r{i}": 1 for i in range(N + 4)}
    assert all(lengths[f"r{i}"] == 96 for i in range(N) if i not in (1, 6))
    assert lengths.get("r1", 0) < 96 and lengths.get("r6", 0) < 96
    assert info["grammar_between_forwards"] > 0
    assert (info["grammar_late_mask_steps"] > 0) == late
    assert stack.allocator.is_fully_free()


async def test_xgrammar_rows_take_several_tokens_a_step_with_one_forward_a_steps_tokens(monkeypatch):
    """The same under xgrammar (no forced runs: every position takes a mask, computed in one
    xgrammar call a forward)."""
    pytest.importorskip("xgrammar")
    monkeypatch.setenv("OMNI_ASYNC_GRAMMAR_BACKEND", "xgrammar")
    sampling = [seeded(i) for i in range(N)]
    reference, ref_info = await run("normal", 1, sampling)
    assert ref_info["grammar_backend"] == "xgrammar"
    for loop in ("normal", "overlap"):
        results, info = await run(loop, 4, sampling)
        assert [r.output_ids for r in results] == [r.output_ids for r in reference], loop
        for r in results:
            assert r.finish_reason == "stop", r.text
            validate(json.loads(r.text), SCHEMA)
        assert masked_tokens_a_step(info) > 2, (loop, info)


@pytest.mark.parametrize("loop,late", [("normal", False), ("overlap", False), ("overlap", True), ("async_decode", True)])
async def test_stop_ids_lengths_and_min_new_tokens_inside_a_step_end_rows_as_one_forward_a_step(loop, late, monkeypatch):
    """A stop id the grammar admits (past ``min_new_tokens``), length limits that fall inside
    a step of four forwards, and the grammar's own end: each row keeps the tokens, and ends
    for the reason, of one forward a step (``step_results.take_between`` against the walk).
    ``late``: the steps launched while the one before is in flight (``LATE_BETWEEN``)."""
    from omni_async.core import multi_step

    monkeypatch.setattr(multi_step, "LATE_BETWEEN", late)
    async with Engine.from_pretrained("tiny", device="cpu") as engine:
        comma = engine.tokenizer.encode(",", add_special_tokens=False)
    sampling = [
        SamplingParams(max_new_tokens=5 + 3 * i, json_schema=ENDLESS, temperature=0.7, seed=i, stop_token_ids=comma,
                       min_new_tokens=4 * (i % 3))
        if i % 2 else seeded(i)
        for i in range(N)
    ]
    reference, _ = await run("normal", 1, sampling)
    results, info = await run(loop, 4, sampling)
    assert [(r.output_ids, r.finish_reason) for r in results] == [(r.output_ids, r.finish_reason) for r in reference]
    assert {r.finish_reason for r in results} >= {"stop", "length"}
    assert info["grammar_between_forwards"] > 0 and (info["grammar_late_mask_steps"] > 0) == late


@pytest.mark.parametrize("late", [False, True])
async def test_a_grammar_failing_inside_a_step_ends_its_request_alone(late, monkeypatch):
    """A grammar that fails at a token its matcher takes between forwards ends its request
    with an error after the tokens before it, as one forward a step does; the other rows run
    on. ``late``: the steps launched while the one before is in flight (``LATE_BETWEEN``)."""
    from omni_async import errors
    from omni_async.core import multi_step

    from .test_late_masks import fail_grammar_at

    monkeypatch.setattr(multi_step, "LATE_BETWEEN", late)

    failing = ("regex", "[a-z]{4,40}")
    fail_grammar_at(monkeypatch, failing, 6)
    outcomes = {}
    for steps in (1, 4):
        async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu", loop="overlap",
                                          decode_steps=steps) as engine:
            others = [engine.generate(prompt=f"r{i}", sampling=endless(i)) for i in range(N - 1)]
            streamed: list[int] = []

            async def fails():
                with pytest.raises(errors.InvalidRequestError, match="failed during generation"):
                    async for delta in engine.stream(prompt="x", sampling=SamplingParams(max_new_tokens=32, regex=failing[1])):
                        streamed.extend(delta.token_ids)

            results, _ = await asyncio.gather(asyncio.gather(*others), fails())
            info = engine.scheduler.info()
        assert_kv_free(engine)
        outcomes[steps] = ([r.output_ids for r in results], list(streamed))
    assert info["grammar_between_forwards"] > 0 and (info["grammar_late_mask_steps"] > 0) == late
    assert outcomes[4] == outcomes[1]
    assert len(outcomes[4][1]) == 5  # the tokens before the failing one went out



@pytest.mark.parametrize("loop", ["normal", "overlap"])
async def test_steps_of_masked_rows_run_past_the_plan_when_asked(loop, monkeypatch):
    """``multi_step.BETWEEN_FORWARDS`` above the plan's k: an all-constrained step runs up
    to that many forwards (at most a page), with one forward a step's tokens, KV freed, and
    fewer decode steps than at the plan's k; free rows beside them keep the plan's k."""
    from omni_async.core import multi_step

    sampling = [endless(i) for i in range(N)]
    reference, _ = await run("normal", 1, sampling)
    at_k, k_info = await run(loop, 4, sampling)
    monkeypatch.setattr(multi_step, "BETWEEN_FORWARDS", 12)
    results, info = await run(loop, 4, sampling)
    assert [r.output_ids for r in results] == [r.output_ids for r in reference] == [r.output_ids for r in at_k]
    assert masked_tokens_a_step(info) > 4, info
    assert info["decode_steps"] < k_info["decode_steps"] * 0.7, (info["decode_steps"], k_info["decode_steps"])
    free = SamplingParams(max_new_tokens=30, temperature=0.9, seed=5, ignore_eos=True)
    mixed = [free if i < 2 else seeded(i) for i in range(N)]
    alone, _ = await run(loop, 4, [free, free])
    results, _ = await run(loop, 4, mixed)
    assert [r.output_ids for r in results[:2]] == [r.output_ids for r in alone]
