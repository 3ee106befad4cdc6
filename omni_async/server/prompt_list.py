"""Several prompts in one ``/v1/completions`` request: one engine request per prompt,
answered as one response whose choices are numbered as OpenAI numbers them (prompt ``i``'s
``j``-th completion is choice ``i * n + j``)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, AsyncIterator

from ..client.collector import OutputCollector
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


def merged_deltas(streams: list[AsyncIterator[StreamDelta]], n: int) -> AsyncIterator[StreamDelta]:
    """The deltas of all prompts' streams as they come, renumbered. Closing this closes
    every stream (which aborts the requests still running); an error in one is raised.
    One prompt's stream is returned as it is (no generator hop per token)."""
    if len(streams) == 1:
        return streams[0]
    return _merged(streams, n)


async def _merged(streams: list[AsyncIterator[StreamDelta]], n: int) -> AsyncIterator[StreamDelta]:
    """Several streams through one collector: a reader that falls behind (its client
    reads slowly) takes one merged delta per completion, not every step's, as the
    engine's own collector gives one stream."""
    pending = OutputCollector()
    failed: list[BaseException] = []

    async def pump(i: int, stream: AsyncIterator[StreamDelta]) -> None:
        try:
            async for delta in stream:
                pending.put(dataclasses.replace(delta, index=i * n + delta.index))
                pending.wake()
        except Exception as exc:
            failed.append(exc)
            pending.wake()
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    ended = asyncio.gather(*tasks, return_exceptions=True)
    ended.add_done_callback(lambda _: (pending.close(), pending.wake()))
    try:
        while True:
            batch = await pending.next_batch()
            for delta in batch:
                yield delta
            if failed:
                raise failed[0]
            if not batch:
                return
    finally:
        for task in tasks:
            task.cancel()
        await ended
