"""Constrained requests shared by the tests of masked decode steps (late masks, masks
between a step's forwards): a small schema, an endless one (rows run to their length), the
greedy and seeded requests, and a scheduler driven through its inbox and outbox (submit,
record each request's terminal messages)."""

from __future__ import annotations

from typing import Any

from omni_async import IncomingMessage, RequestPayload, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
    "required": ["id", "ok"],
    "additionalProperties": False,
}
# An array that cannot complete within any request's length: rows run to their limit.
ENDLESS = {"type": "array", "items": SCHEMA, "minItems": 100_000}


def greedy(i: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=64, json_schema=SCHEMA)


def seeded(i: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=64, json_schema=SCHEMA, temperature=0.8, seed=i, repetition_penalty=1.2)


async def record_terminals(sched: Any, terminals: dict[str, list[str]], lengths: dict[str, int]) -> None:
    """Each request's terminal messages (``result`` / ``error``) in ``terminals``, and its
    result's length in ``lengths``, until the outbox closes."""
    async for msg in sched.outbox:
        if msg.type in ("result", "error"):
            terminals.setdefault(msg.request_id, []).append(msg.type)
            if msg.type == "result":
                lengths[msg.request_id] = len(msg.data.output_ids)


async def submit_constrained(sched: Any, n: int, schema: dict, max_new_tokens: int) -> None:
    """``n`` requests ``r0`` ... under ``schema``, sampled, each with its own seed and prompt."""
    for i in range(n):
        sp = SamplingParams(max_new_tokens=max_new_tokens, json_schema=schema, temperature=0.7, seed=i)
        await sched.inbox.send(IncomingMessage(f"r{i}", "new_request", RequestPayload(f"r{i}", [i + 1, 2, 3], sp)))
