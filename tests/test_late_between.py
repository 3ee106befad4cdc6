"""Late masks for steps with masks between forwards (``core.multi_step.LATE_BETWEEN``, issue 61).

When most rows sample under masks and take several forwards a step under masks computed
between them, the loop used to drain before each such step (``multi_step.waits_for_between``):
the device idled while the host collected, processed, scheduled and launched. Under the
switch the step is launched while the one before is in flight: its launch enqueues the
first forward (its inputs are the tokens in flight, on the device), and once the step
before is processed the runner fills that forward's masks, samples it and runs the
forwards after it under masks between them (``multi_forward.Forwards``,
``ModelRunner.sample_pending``). The tokens must stay those of one forward a step, every
request must end once with its KV freed, and the late path must be taken (the counters).
Stop ids, lengths, aborts and a grammar failing inside late steps: tests/test_masks_between.py
(``late``)."""

# optimistic_grammar=False keeps every constrained row sampling under its mask (as
# tests/test_masks_between.py, whose helpers these tests share).

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("llguidance")

from omni_async import Engine, SamplingParams  # noqa: E402
from omni_async.core import multi_step  # noqa: E402

from .conftest import assert_kv_free  # noqa: E402
from .constrained_cases import SCHEMA, greedy, seeded  # noqa: E402
from .test_constrained import validate  # noqa: E402
from .test_masks_between import assert_one_forward_outputs, endless, masked_tokens_a_step  # noqa: E402

N = 8


@pytest.fixture
def late(monkeypatch):
    monkeypatch.setattr(multi_step, "LATE_BETWEEN", True)


async def run(loop: str, decode_steps: int, sampling: list[SamplingParams]) -> tuple[list, dict, list[str]]:
    async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu", loop=loop,
                                      decode_steps=decode_steps) as engine:
        engine.scheduler.trace_enabled = True
        results = await asyncio.gather(*[engine.generate(prompt=f"record {i}:", sampling=sp) for i, sp in enumerate(sampling)])
        info = engine.scheduler.info()
        trace = list(engine.scheduler.stats.trace)
    assert_kv_free(engine)
    return results, info, trace


def drains(trace: list[str]) -> int:
    """Steps processed by a drain before the next was launched (the wait this feature
    removes), and steps run in sync."""
    return sum(t.startswith(("drain:", "sync:")) for t in trace)


@pytest.mark.parametrize("make", [greedy, seeded, endless], ids=["greedy", "seeded", "endless"])
async def test_late_between_steps_keep_one_forward_a_steps_tokens_in_every_loop(make, late):
    """All rows constrained, four forwards a step, the switch on: the tokens of one forward a
    step in the three loops, every output valid, KV freed; under the lookahead loops the
    steps sample late (their first forward's masks after the step before was processed)
    and the loop no longer drains before each of them."""
    sampling = [make(i) for i in range(N)]
    reference, _, _ = await run("normal", 1, sampling)
    for loop in ("normal", "overlap", "async_decode"):
        results, info, trace = await run(loop, 4, sampling)
        assert_one_forward_outputs(results, reference, make is endless, loop)
        assert masked_tokens_a_step(info) > 2, (loop, info)
        if loop == "normal":  # nothing in flight at scheduling: today's steps
            assert info["grammar_late_mask_steps"] == 0
            continue
        assert info["grammar_late_mask_steps"] > 0 and info["grammar_between_forwards"] > 0, (loop, info)
        assert info["grammar_late_mask_steps"] >= info["decode_steps"] - 3, (loop, info["decode_steps"], trace)
        assert drains(trace) <= 2, (loop, trace)


async def test_the_switch_off_drains_as_before():
    """The switch off (the default): no late step, the loop drains before each step of
    masked rows, as ``test_masks_between`` expects; the switch on removes those drains.
    Fails where the switch does nothing."""
    assert multi_step.LATE_BETWEEN is False
    sampling = [endless(i) for i in range(N)]
    off, off_info, off_trace = await run("overlap", 4, sampling)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(multi_step, "LATE_BETWEEN", True)
        on, on_info, on_trace = await run("overlap", 4, sampling)
    assert [r.output_ids for r in on] == [r.output_ids for r in off]
    assert off_info["grammar_late_mask_steps"] == 0 and on_info["grammar_late_mask_steps"] > 0
    assert drains(off_trace) >= off_info["decode_steps"] - 3 and drains(on_trace) <= 2, (off_trace, on_trace)
    assert on_info["decode_steps"] <= off_info["decode_steps"] + 1


@pytest.mark.parametrize("loop", ["overlap", "async_decode"])
async def test_rows_whose_grammar_ends_mid_step_while_the_next_is_in_flight(loop, late):
    """Short schemas complete inside steps of eight forwards while the next step, launched
    late, holds their rows: those rows drop that step's tokens; each output is one forward
    a step's, each request ends once, KV freed (``run``)."""
    sampling = [greedy(i) if i % 2 else seeded(i) for i in range(N)]
    reference, _, _ = await run("normal", 1, sampling)
    results, info, _ = await run(loop, 8, sampling)
    assert [r.output_ids for r in results] == [r.output_ids for r in reference]
    for r in results:
        assert r.finish_reason == "stop"
        validate(json.loads(r.text), SCHEMA)
    assert info["grammar_late_mask_steps"] > 0


async def test_steps_past_the_plan_launch_late_too(late, monkeypatch):
    """``multi_step.BETWEEN_FORWARDS`` above the plan's k composes with the switch: longer
    steps, launched late, one forward a step's tokens."""
    monkeypatch.setattr(multi_step, "BETWEEN_FORWARDS", 12)
    sampling = [endless(i) for i in range(N)]
    reference, _, _ = await run("normal", 1, sampling)
    results, info, trace = await run("overlap", 4, sampling)
    assert [r.output_ids for r in results] == [r.output_ids for r in reference]
    assert masked_tokens_a_step(info) > 4, info
    assert info["grammar_late_mask_steps"] > 0 and drains(trace) <= 2, trace


@pytest.mark.parametrize("loop", ["overlap", "async_decode"])
async def test_retraction_under_pressure_waits_for_the_step_whose_matchers_ran_ahead(loop, late, monkeypatch):
    """A KV small enough to retract masked rows: a row whose matcher took tokens of a step
    in flight (``Request.num_ahead``) is not retracted before that step is processed (it
    would resume with them taken, ``NativeBatchCore._retract_until_decode_fits``): the
    tokens stay one forward a step's and every page comes back. (On the CPU the launch's
    matchers usually had not taken them yet, so the tokens alone do not show it: every
    row retracted must have none taken ahead.)"""
    from omni_async.core.batch_core import NativeBatchCore

    retracted: list[int] = []
    real = NativeBatchCore._retract

    def retract(self, req):
        retracted.append(req.num_ahead)
        return real(self, req)

    monkeypatch.setattr(NativeBatchCore, "_retract", retract)
    sampling = [endless(i) for i in range(N)]
    pressure = dict(page_size=8, kv_capacity_tokens=280, max_running_requests=8)

    async def outputs_of(loop_: str, steps: int) -> tuple[list, dict]:
        async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu", loop=loop_,
                                          decode_steps=steps, **pressure) as engine:
            # Every request queued before the first step (paused in place, then resumed).
            await engine.pause(mode="in_place")
            handles = [await engine.submit(prompt=f"record {i}:", sampling=sp) for i, sp in enumerate(sampling)]
            await engine.resume()
            results = [await h.result() for h in handles]
            info = engine.scheduler.info()
        assert_kv_free(engine)
        return [r.output_ids for r in results], info

    reference, _ = await outputs_of("normal", 1)
    # Whether the KV runs short before rows finish depends on how the steps fell (about one
    # run in ten on a loaded 2-core machine retracted none): up to three runs, each with the
    # reference's tokens, until one retracts.
    for _ in range(3):
        retracted.clear()
        outputs, info = await outputs_of(loop, 4)
        assert outputs == reference
        assert info["grammar_late_mask_steps"] > 0, info["grammar_late_mask_steps"]
        assert not any(retracted), retracted
        if info["num_retractions"]:
            break
    assert info["num_retractions"] > 0 and retracted, "no run retracted"
