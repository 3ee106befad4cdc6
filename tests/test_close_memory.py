"""Closing returns every byte at once: no tensor of a closed engine outlives ``aclose()``
and nothing of it waits for a cyclic GC pass (the collector is disabled here while it
matters). Tensors are found through the collector's object list, not through the engine."""

from __future__ import annotations

import asyncio
import gc
import warnings
import weakref
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch

from omni_async import Engine, SamplingParams

from .conftest import LOOPS

PROMPTS = [[256, *b"close me"], list(range(40, 90)), [256, *b"and me"] * 3]
GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)


def live_tensors() -> dict[int, torch.Tensor]:
    with warnings.catch_warnings():  # isinstance on torch's deprecated aliases warns
        warnings.simplefilter("ignore")
        return {id(o): o for o in gc.get_objects() if isinstance(o, torch.Tensor)}


@contextmanager
def cyclic_gc_off() -> Iterator[None]:
    gc.collect()  # what earlier tests left
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def serve_some(engine: Engine) -> list[list[int]]:
    async with engine:
        results = await asyncio.gather(
            *(engine.generate(input_ids=p, sampling=s) for p in PROMPTS for s in (GREEDY, SAMPLED))
        )
    return [r.output_ids for r in results]


async def warm_up(loop: str) -> None:
    """One engine first, so what torch creates once per process is not counted."""
    await serve_some(Engine.from_pretrained("tiny", loop=loop, kv_capacity_tokens=4096))


@pytest.mark.parametrize("loop", LOOPS)
async def test_closing_an_engine_leaves_none_of_its_tensors_alive(loop):
    await warm_up(loop)
    with cyclic_gc_off():
        before = set(live_tensors())
        engine = Engine.from_pretrained("tiny", loop=loop, kv_capacity_tokens=4096)
        params = sum(1 for _ in engine.stack.loaded.model.parameters())
        async with engine:
            await asyncio.gather(*(engine.generate(input_ids=p, sampling=s) for p in PROMPTS for s in (GREEDY, SAMPLED)))
            mine = [weakref.ref(t) for i, t in live_tensors().items() if i not in before]
        assert len(mine) > params  # the weights, the KV pages, the step buffers
        alive = [r() for r in mine if r() is not None]
        # The engine is still held here: closing alone let go of its tensors.
        assert alive == [], f"{len(alive)} tensors outlived aclose(): {[tuple(t.shape) for t in alive[:5]]}"
        assert not engine.open_requests
        gone = weakref.ref(engine)
        del engine
        assert gone() is None, "a closed engine is held in a reference cycle"


async def test_ten_engines_opened_and_closed_in_a_row_leave_nothing_behind():
    await warm_up("overlap")
    with cyclic_gc_off():
        baseline = live_tensors()
        engines = []
        for i in range(10):
            engine = Engine.from_pretrained("tiny", loop=LOOPS[i % len(LOOPS)], seed=i, kv_capacity_tokens=4096)
            outputs = await serve_some(engine)
            assert all(len(o) == 10 for o in outputs)
            engines.append(weakref.ref(engine))
            del engine
        left = {i: t for i, t in live_tensors().items() if i not in baseline}
        assert left == {}, f"{len(left)} tensors left, {sum(t.untyped_storage().nbytes() for t in left.values())} bytes"
        assert [r for r in engines if r() is not None] == []


@pytest.mark.parametrize("loop", LOOPS)
async def test_two_engines_in_one_event_loop_give_the_tokens_each_gives_alone(loop):
    def make(seed: int) -> Engine:
        return Engine.from_pretrained("tiny", loop=loop, seed=seed, kv_capacity_tokens=4096)

    alone = [await serve_some(make(0)), await serve_some(make(1))]
    together = await asyncio.gather(serve_some(make(0)), serve_some(make(1)))
    assert alone[0] != alone[1]  # two different models
    assert list(together) == alone
