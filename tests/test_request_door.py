"""A request is checked once, at the door it comes through.

``Engine.submit`` checks it (and raises the typed error at once); the stage then takes
that verdict and does not check the request again. Shown through the public surface:
right after ``submit`` returns (before the stage's loop has run), the stage's limits are
tightened so that a second check would refuse the request (or shorten it). Served as
submitted, the request was checked once, at the engine's door; a request written to the
stage's inbox directly is checked there, against the limits of that moment."""

from __future__ import annotations

import dataclasses

import anyio
import pytest

from omni_async import Engine, IncomingMessage, RequestPayload, SamplingParams, errors

from .test_admission import Stage

GREEDY = dict(max_new_tokens=12, ignore_eos=True)

# rule -> (request, the limits a second check would refuse or shorten it under)
CASES = {
    "prompt in the vocabulary": (dict(input_ids=[40, 41, 42]), dict(vocab_size=40)),
    "sampling ids in the vocabulary": (dict(input_ids=[1, 2, 3], suppress_tokens=[45]), dict(vocab_size=45)),
    "KV capacity": (dict(input_ids=[1, 2, 3]), dict(kv_capacity_tokens=8)),
    "context (max_new_tokens clamped)": (dict(input_ids=[1, 2, 3]), dict(context_length=8)),
}


def _request(case: str) -> tuple[list[int], SamplingParams, dict]:
    req, tighter = CASES[case]
    sp = SamplingParams(**GREEDY, suppress_tokens=req.get("suppress_tokens", []))
    return req["input_ids"], sp, tighter


@pytest.mark.parametrize("case", sorted(CASES))
async def test_the_stage_does_not_check_again_what_the_engine_checked(case):
    ids, sp, tighter = _request(case)
    async with Engine.from_pretrained("tiny") as engine:
        await engine.generate(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2))  # serving
        limits = engine.scheduler.limits
        handle = await engine.submit(input_ids=ids, sampling=sp)
        engine.scheduler.limits = dataclasses.replace(limits, **tighter)  # before the stage runs again
        with anyio.fail_after(60):
            result = await handle.result()
        engine.scheduler.limits = limits
    assert len(result.output_ids) == GREEDY["max_new_tokens"]


@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_request_sent_to_the_stage_is_checked_there_against_its_limits(case):
    """The other door: the stage checks what no engine checked (the same rules, against
    its limits of the moment)."""
    ids, sp, tighter = _request(case)
    async with Stage() as st:
        st.sched.limits = dataclasses.replace(st.sched.limits, **tighter)
        await st.sched.inbox.send(IncomingMessage("r", "new_request", RequestPayload("r", list(ids), sp)))
        (msg,) = await st.done("r", timeout=60)
    if "context" in case:
        assert msg.type == "result" and len(msg.data.output_ids) == 8 - len(ids)  # clamped to the room left
    else:
        assert msg.type == "error" and isinstance(msg.data, (errors.InvalidRequestError, errors.RequestRejectedError))
