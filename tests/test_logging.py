"""Lifecycle events reach the ``omni_async`` stdlib logger with their fields as fields;
an application's structlog JSON setup receives them parsed."""

from __future__ import annotations

import io
import json
import logging

import structlog

from omni_async import Engine, SamplingParams

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
    mine = [r for r in caplog.records if r.name == "omni_async" and getattr(r, "request_id", None) == "logged"]
    assert [r.getMessage() for r in mine if r.getMessage() in EVENTS] == EVENTS
    assert mine[-1].finish_reason == "length"
    assert mine[-1].omni_fields == {"request_id": "logged", "finish_reason": "length", "output_tokens": 3}


async def test_nothing_is_logged_by_default(tiny_engine, caplog):
    caplog.set_level(logging.WARNING, logger="omni_async")
    engine = tiny_engine()
    async with engine:
        await engine.generate(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=2))
    assert [r for r in caplog.records if r.name == "omni_async"] == []
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("omni_async").handlers)


async def test_structlog_json_receives_fields():
    """The structlog recipe for stdlib records (ProcessorFormatter + ExtraAdder) renders
    each event as JSON whose fields are real fields."""
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_log_level, structlog.stdlib.ExtraAdder()],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, structlog.processors.JSONRenderer()],
        )
    )
    logger = logging.getLogger("omni_async")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        engine = await Engine.load("tiny", loop="normal")
        async with engine:
            await engine.generate(input_ids=[4, 5, 6], sampling=SamplingParams(max_new_tokens=2), request_id="js")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    events = [json.loads(line) for line in buf.getvalue().splitlines()]
    mine = [e for e in events if e.get("request_id") == "js"]
    assert [e["event"] for e in mine] == EVENTS
    assert mine[-1]["finish_reason"] == "length" and mine[-1]["output_tokens"] == 2
    assert all(e["level"] == "debug" for e in mine)
    names = [e["event"] for e in events]
    for event in ("engine_model_loaded", "scheduler_started", "engine_started", "scheduler_stopped", "engine_stopped"):
        assert event in names, names
    loaded = next(e for e in events if e["event"] == "engine_model_loaded")
    assert loaded["model"] == "tiny" and loaded["load_seconds"] >= 0 and loaded["kv_capacity_tokens"] > 0
