"""The pytest plugin's fixtures (omni_async.testing), used as an application's tests would."""

from __future__ import annotations

import asyncio
import json

import pytest
import pytest_asyncio

from omni_async import Engine, SamplingParams
from omni_async.testing import assert_kv_free

SP = SamplingParams(max_new_tokens=4, ignore_eos=True)


async def test_omni_engine_is_started_in_this_loop(omni_engine):
    assert omni_engine.event_loop is asyncio.get_running_loop()
    res = await omni_engine.generate(prompt="hi", sampling=SP)
    assert len(res.output_ids) == 4 and res.finish_reason == "length"
    assert_kv_free(omni_engine)


async def test_factory_on_the_random_checkpoint(omni_engine_factory, omni_checkpoint):
    assert json.loads((omni_checkpoint / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    engine = await omni_engine_factory(omni_checkpoint, loop="async_decode", max_running_requests=4)
    results = await asyncio.gather(*(engine.generate(prompt=p, sampling=SP) for p in ("a", "b", "c")))
    assert [len(r.output_ids) for r in results] == [4, 4, 4]
    assert engine.scheduler.info()["loop"] == "async_decode"


_FIRST_LOOP: list[asyncio.AbstractEventLoop] = []


@pytest.mark.parametrize("turn", [0, 1])
async def test_session_engine_from_per_test_loops(omni_session_engine, turn):
    """The session engine serves tests whose loops differ (function scope here)."""
    here = asyncio.get_running_loop()
    assert omni_session_engine.event_loop is not here
    if turn == 0:
        _FIRST_LOOP.append(here)
    else:
        assert _FIRST_LOOP and _FIRST_LOOP[0] is not here  # a new loop for this test
    res = await asyncio.wait_for(omni_session_engine.generate(input_ids=[1, 2, 3], sampling=SP), 30)
    deltas = [d async for d in omni_session_engine.stream(input_ids=[1, 2, 3], sampling=SP)]
    assert [t for d in deltas for t in d.token_ids] == res.output_ids


# The README's recipe: a module- (or session-) scoped engine on a matching pytest-asyncio loop.
@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def module_engine():
    async with await Engine.load("tiny") as engine:
        yield engine


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("prompt", ["x", "y"])
async def test_module_scoped_engine_recipe(module_engine, prompt):
    assert module_engine.event_loop is asyncio.get_running_loop()
    res = await module_engine.generate(prompt=prompt, sampling=SP)
    assert len(res.output_ids) == 4


async def test_random_checkpoint_agrees_with_transformers(omni_engine_factory, omni_checkpoint):
    """The written folder is a real Hugging Face checkpoint: transformers loads it, its
    tokenizer encodes as ours does, and greedy tokens agree."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(omni_checkpoint, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(omni_checkpoint)("héllo")["input_ids"]
    with torch.no_grad():
        hf = model.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    engine = await omni_engine_factory(omni_checkpoint)
    ours = await engine.generate(prompt="héllo", sampling=SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert ours.prompt_ids == ids
    assert ours.output_ids == hf
