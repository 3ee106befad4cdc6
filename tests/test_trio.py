"""The stage runs on anyio alone: the same scheduler, loops and step path under trio."""

from __future__ import annotations

import anyio
import pytest

from omni_async import IncomingMessage, RequestPayload, SamplingParams
from omni_async.builder import build_native_stack, build_scheduler
from omni_async.config import SchedulerConfig

pytest.importorskip("trio")


def _serve(loop: str, prompts: list[list[int]], n: int) -> dict[str, list[int]]:
    config = SchedulerConfig(loop=loop)
    stack = build_native_stack("tiny", config)
    sched = build_scheduler(stack, config)
    out: dict[str, list[int]] = {}

    async def main() -> None:
        async with sched:
            for i, p in enumerate(prompts):
                sampling = SamplingParams(max_new_tokens=n, ignore_eos=True)
                await sched.inbox.send(IncomingMessage(f"r{i}", "new_request", RequestPayload(f"r{i}", p, sampling)))
            with anyio.fail_after(60):
                async for msg in sched.outbox:
                    if msg.type == "result":
                        out[msg.request_id] = msg.data.output_ids
                    assert msg.type != "error", msg.data
                    if len(out) == len(prompts):
                        break
            reply = await sched.admin("model_info")
            assert reply["success"] and reply["data"]["loop"] == loop

    anyio.run(main, backend="trio")
    assert stack.allocator.is_fully_free()
    return out


@pytest.mark.parametrize("loop", ["normal", "overlap", "async_decode"])
def test_stage_serves_under_trio_with_the_same_tokens_as_asyncio(loop):
    prompts = [[1, 2, 3], [7, 8, 9, 10], [42]]
    under_trio = _serve(loop, prompts, 12)
    config = SchedulerConfig(loop=loop)
    stack = build_native_stack("tiny", config)
    sched = build_scheduler(stack, config)
    under_asyncio: dict[str, list[int]] = {}

    async def main() -> None:
        async with sched:
            for i, p in enumerate(prompts):
                sampling = SamplingParams(max_new_tokens=12, ignore_eos=True)
                await sched.inbox.send(IncomingMessage(f"r{i}", "new_request", RequestPayload(f"r{i}", p, sampling)))
            async for msg in sched.outbox:
                if msg.type == "result":
                    under_asyncio[msg.request_id] = msg.data.output_ids
                if len(under_asyncio) == len(prompts):
                    break

    anyio.run(main, backend="asyncio")
    assert under_trio == under_asyncio
    assert all(len(v) == 12 for v in under_trio.values())
