"""Several prompts in one ``/v1/completions`` request: one engine request per prompt,
answered as one response whose choices are numbered as OpenAI numbers them (prompt ``i``'s
``j``-th completion is choice ``i * n + j``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any, AsyncIterator

from ..messages import GenerationResult, StreamDelta


def prompt_cached_tokens(result: GenerationResult) -> int:
    """A request's prefix-cache hits counted against its prompt once, as the usage counts
    the prompt once: the engine's figure sums the hits of all ``n`` completions (each
    prefills the prompt), so it is averaged over them; never more than the prompt."""
    n = max(1, len(result.outputs or []))
    return min(len(result.prompt_ids), int(result.cached_tokens) // n)


def combined_result(results: list[GenerationResult], n: int) -> GenerationResult:
    """One result for the response: every prompt's completions, renumbered; prompt ids
    and cached tokens of all prompts (what the usage counts, each prompt once)."""
    if len(results) == 1:
        return dataclasses.replace(results[0], cached_tokens=prompt_cached_tokens(results[0]))
    outputs = [dataclasses.replace(o, index=i * n + o.index) for i, r in enumerate(results) for o in r.outputs]
    first = results[0]
    return dataclasses.replace(
        first,
        outputs=outputs,
        prompt_ids=[t for r in results for t in r.prompt_ids],
        cached_tokens=sum(prompt_cached_tokens(r) for r in results),
    )


async def merged_deltas(streams: list[AsyncIterator[StreamDelta]], n: int) -> AsyncIterator[StreamDelta]:
    """The deltas of all prompts' streams as they come, renumbered. Closing this closes
    every stream (which aborts the requests still running); an error in one is raised."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:  # type: ignore[type-var]
            async for delta in only:
                yield delta
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[StreamDelta]) -> None:
        try:
            async for delta in stream:
                await queue.put((i, delta))
            await queue.put((i, done))
        except Exception as exc:
            await queue.put((i, exc))
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            i, item = await queue.get()
            if item is done:
                open_streams -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield dataclasses.replace(item, index=i * n + item.index)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
