"""Greedy tokens equal transformers' generate on random-weight checkpoints (float32, CPU),
with many concurrent requests, chunked prefill, and a KV small enough to force retraction."""

from __future__ import annotations

import asyncio
import random

import pytest

from omni_async import Engine, SamplingParams

from .conftest import LOOPS, assert_kv_free, hf_greedy, random_prompts


@pytest.mark.parametrize("family", ["llama", "llama3rope", "qwen2", "qwen3"])
@pytest.mark.parametrize("loop", LOOPS)
async def test_greedy_matches_transformers_under_pressure(hf_checkpoints, family, loop):
    folder = hf_checkpoints[family]
    prompts = random_prompts(18, 512, 3, 150, seed=7)
    rng = random.Random(11)
    lengths = [rng.randint(1, 40) for _ in prompts]
    expected = [hf_greedy(folder, p, n) for p, n in zip(prompts, lengths)]

    engine = Engine.from_pretrained(
        str(folder),
        loop=loop,
        page_size=8,
        kv_capacity_tokens=8 * 40,  # 320 tokens for ~1,900 tokens of demand: retraction
        chunked_prefill_size=48,
        max_prefill_tokens=64,
    )
    async with engine:
        results = await asyncio.gather(
            *[
                engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=n))
                for p, n in zip(prompts, lengths)
            ]
        )
        core = engine.stack.core
        assert core.num_retractions > 0, "the KV capacity was meant to force retraction"
    for res, exp in zip(results, expected):
        assert res.output_ids == exp
        assert res.finish_reason == "length"
    assert_kv_free(engine)
