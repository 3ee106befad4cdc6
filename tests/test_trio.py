"""The stage runs on anyio alone: the same scheduler, loops and step path under trio."""

from __future__ import annotations

import anyio
import pytest

from omni_async import IncomingMessage, RequestPayload, SamplingParams
from omni_async.backends.native.builder import build_native_stack, build_scheduler
from omni_async.config import SchedulerConfig

pytest.importorskip("trio")


def _serve(backend: str, loop: str, prompts: list[list[int]], n: int) -> dict[str, list[int]]:
    """Serve ``prompts`` through a fresh stage under ``backend``; tokens by request id."""
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
                    assert msg.type != "error", msg.data
                    if msg.type == "result":
                        out[msg.request_id] = msg.data.output_ids
                    if len(out) == len(prompts):
                        break
            reply = await sched.admin("model_info")
            assert reply["success"] and reply["data"]["loop"] == loop

    anyio.run(main, backend=backend)
    assert stack.allocator.is_fully_free()
    return out


@pytest.mark.parametrize("loop", ["normal", "overlap", "async_decode"])
def test_stage_serves_under_trio_with_the_same_tokens_as_asyncio(loop):
    prompts = [[1, 2, 3], [7, 8, 9, 10], [42]]
    under_trio = _serve("trio", loop, prompts, 12)
    assert under_trio == _serve("asyncio", loop, prompts, 12)
    assert all(len(v) == 12 for v in under_trio.values())


@pytest.mark.parametrize("loop", ["normal", "async_decode"])
def test_engine_generates_and_streams_under_trio(loop):
    """The Engine facade under trio: ``async with`` owns the serving task group; generate,
    stream, abort and admin work; tokens equal the asyncio engine's."""
    from omni_async import Engine, errors

    sp = SamplingParams(max_new_tokens=10, ignore_eos=True)

    def run(backend: str):
        engine = Engine.from_pretrained("tiny", loop=loop)
        out = {}

        async def main() -> None:
            async with engine:
                out["result"] = (await engine.generate(input_ids=[1, 2, 3], sampling=sp)).output_ids
                out["stream"] = [t async for d in engine.stream(prompt="hi", sampling=sp) for t in d.token_ids]
                handle = await engine.submit(input_ids=[4, 5], sampling=SamplingParams(max_new_tokens=500), request_id="gone")
                await engine.abort("gone")
                with pytest.raises(errors.RequestAbortedError):
                    await handle.result()
                out["info"] = (await engine.model_info())["success"]

        anyio.run(main, backend=backend)
        assert engine.stack.allocator.is_fully_free()
        return out

    under_trio = run("trio")
    assert under_trio == run("asyncio")
    assert len(under_trio["result"]) == 10 and len(under_trio["stream"]) == 10 and under_trio["info"]
