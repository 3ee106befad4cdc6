"""The SGLang runner keeps the reference's ModelRunner contract: every hook is called at
its point, over SGLang's ForwardBatch, in the synchronous and the lookahead paths."""

from __future__ import annotations

import asyncio
from collections import Counter

from omni_async import SamplingParams
from omni_async.backends.sglang.runner import SGLangModelRunner
from omni_async.runners.base import ModelRunner

from .conftest import assert_sglang_pools_free, hf_greedy, random_prompts, sglang_engine

HOOKS = [
    "before_prefill",
    "before_decode",
    "post_prefill",
    "post_decode",
    "post_decode_launch",
    "post_decode_resolve",
    "post_process_outputs",
    "on_generation_step_advanced",
]


async def test_hooks_called_over_sglang_forward_batch(sg_checkpoints):
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    folder = sg_checkpoints["llama"]
    prompts = random_prompts(3, 512, 5, 25, seed=66)
    engine = sglang_engine(folder, loop="async_decode")
    runner = engine.stack.runner
    assert isinstance(runner, SGLangModelRunner) and isinstance(runner, ModelRunner)
    calls: Counter[str] = Counter()
    kinds: set[type] = set()

    def wrap(name):
        original = getattr(runner, name)

        def hook(*args, **kwargs):
            calls[name] += 1
            if args and hasattr(args[0], "forward_batch"):
                kinds.add(type(args[0].forward_batch))
            for a in args:
                if hasattr(a, "forward_batch") and isinstance(getattr(a, "forward_batch"), ForwardBatch):
                    kinds.add(ForwardBatch)
            return original(*args, **kwargs)

        setattr(runner, name, hook)

    for name in HOOKS:
        wrap(name)
    async with engine:
        results = await asyncio.gather(
            *[engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=9)) for p in prompts]
        )
        single = await engine.generate(input_ids=prompts[0], sampling=SamplingParams(max_new_tokens=4))
    for res, p in zip(results, prompts):
        assert res.output_ids == hf_greedy(folder, p, 9)
    assert single.output_ids == hf_greedy(folder, prompts[0], 4)
    for name in HOOKS:
        assert calls[name] > 0, f"{name} was never called: {dict(calls)}"
    assert ForwardBatch in kinds
    assert calls["post_decode_launch"] == calls["post_decode_resolve"]  # every lookahead step collected
    assert_sglang_pools_free(engine)


async def test_planning_is_sglang_own(sg_checkpoints):
    """The core plans with SGLang's Scheduler methods, unchanged, and the planner has
    every attribute those methods read (an SGLang upgrade that reads more fails here)."""
    from sglang.srt.managers.scheduler import Scheduler

    from omni_async.backends.sglang.planner import PLANNING_METHODS, SGLangPlanner, planning_attributes_missing

    engine = sglang_engine(sg_checkpoints["llama"])
    planner = engine.stack.core.planner
    assert isinstance(planner, SGLangPlanner) and isinstance(planner, Scheduler)
    for name in PLANNING_METHODS:
        assert getattr(SGLangPlanner, name) is getattr(Scheduler, name), f"{name} is not SGLang's"
    assert planning_attributes_missing(planner) == []
    async with engine:
        assert engine.stack.core.waiting_queue is planner.waiting_queue
        res = await engine.generate(input_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=3))
    assert res.output_ids == hf_greedy(sg_checkpoints["llama"], [5, 6, 7], 3)
