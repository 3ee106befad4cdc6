"""Lifecycle events go out through structlog to the ``omni_async`` stdlib logger."""

from __future__ import annotations

import logging

from omni_async import SamplingParams

EVENTS = [
    "scheduler_request_build_start",
    "scheduler_request_build_end",
    "scheduler_queue_enter",
    "scheduler_prefill_start",
    "scheduler_first_emit",
    "scheduler_finish",
]


async def test_lifecycle_events_in_order(tiny_engine, caplog):
    caplog.set_level(logging.DEBUG, logger="omni_async")
    engine = tiny_engine()
    async with engine:
        await engine.generate(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=3), request_id="logged")
    lines = [r.getMessage() for r in caplog.records if r.name == "omni_async" and "request_id='logged'" in r.getMessage()]
    seen = [next(e for e in EVENTS if f"event='{e}'" in line) for line in lines if any(f"event='{e}'" in line for e in EVENTS)]
    assert seen == EVENTS
    assert "finish_reason='length'" in lines[-1]


async def test_nothing_is_logged_by_default(tiny_engine, caplog):
    caplog.set_level(logging.WARNING, logger="omni_async")
    engine = tiny_engine()
    async with engine:
        await engine.generate(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=2))
    assert [r for r in caplog.records if r.name == "omni_async"] == []
