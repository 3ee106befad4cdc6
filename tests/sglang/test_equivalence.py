"""Greedy tokens from backend="sglang" equal backend="native" and transformers, for a mix
of concurrent requests under KV pressure (chunked prefill, radix prefix reuse,
retraction), in all three loops; seeded sampling is identical across loops and backends."""

from __future__ import annotations

import asyncio
import random

import pytest

from omni_async import Engine, SamplingParams

from .conftest import LOOPS, assert_sglang_pools_free, hf_greedy, random_prompts, sglang_engine

LIMITS = dict(
    page_size=4,
    kv_capacity_tokens=200,  # ~1,500 tokens of demand: SGLang must retract
    chunked_prefill_size=32,
    max_prefill_tokens=48,
)


def _workload(vocab: int):
    prompts = random_prompts(14, vocab, 3, 50, seed=7)
    prompts.append(list(prompts[0]))  # a repeated prompt: served from the radix cache
    prompts.append(prompts[1][:20] + [5, 6, 7])  # a shared prefix
    rng = random.Random(11)
    lengths = [rng.randint(1, 20) if i % 4 == 0 else rng.randint(60, 100) for i, _ in enumerate(prompts)]
    return prompts, lengths


async def _run_all(engine: Engine, prompts, lengths, sampled: bool = False):
    async with engine:
        reqs = [
            engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=n))
            for p, n in zip(prompts, lengths)
        ]
        if sampled:
            reqs += [
                engine.generate(
                    input_ids=p,
                    sampling=SamplingParams(max_new_tokens=12, temperature=0.9, top_k=40, top_p=0.95, seed=100 + i),
                    request_id=f"sampled-{i}",
                )
                for i, p in enumerate(prompts[:4])
            ]
        return await asyncio.gather(*reqs)


_EXPECTED: dict[str, list[list[int]]] = {}


def _expected(folder, prompts, lengths) -> list[list[int]]:
    key = str(folder)
    if key not in _EXPECTED:
        _EXPECTED[key] = [hf_greedy(folder, p, n) for p, n in zip(prompts, lengths)]
    return _EXPECTED[key]


_NATIVE: dict[str, list] = {}


async def _native(folder, prompts, lengths):
    """The native backend's answer for the same workload and limits (its own loops are
    tested equal to each other in the main suite; the normal loop is the reference)."""
    key = str(folder)
    if key not in _NATIVE:
        native = Engine.from_pretrained(str(folder), loop="normal", **LIMITS)
        _NATIVE[key] = await _run_all(native, prompts, lengths, sampled=True)
    return _NATIVE[key]


@pytest.mark.parametrize("loop", LOOPS)
async def test_sglang_greedy_equals_native_and_transformers(sg_checkpoints, loop):
    folder = sg_checkpoints["llama"]
    prompts, lengths = _workload(512)
    expected = _expected(folder, prompts, lengths)

    sg = sglang_engine(folder, loop=loop, **LIMITS)
    sg_results = await _run_all(sg, prompts, lengths, sampled=True)
    retractions = sg.stack.core.num_retractions
    assert_sglang_pools_free(sg)

    native_results = await _native(folder, prompts, lengths)

    n = len(prompts)
    for i, (res, exp) in enumerate(zip(sg_results[:n], expected)):
        assert res.output_ids == exp, f"request {i}: sglang {res.output_ids} != transformers {exp}"
        assert res.finish_reason == "length"
    assert [r.output_ids for r in sg_results] == [r.output_ids for r in native_results]
    assert retractions > 0, "the KV capacity was meant to force SGLang to retract"


async def test_sglang_seeded_sampling_identical_across_loops(sg_checkpoints):
    folder = sg_checkpoints["llama"]
    prompts = random_prompts(5, 512, 4, 30, seed=3)
    outs = []
    for loop in LOOPS:
        engine = sglang_engine(folder, loop=loop)
        async with engine:
            res = await asyncio.gather(
                *[
                    engine.generate(
                        input_ids=p,
                        sampling=SamplingParams(
                            max_new_tokens=10, temperature=1.1, min_p=0.02, repetition_penalty=1.3, seed=7 + i
                        ),
                    )
                    for i, p in enumerate(prompts)
                ]
            )
        assert_sglang_pools_free(engine)
        outs.append([r.output_ids for r in res])
    assert outs[0] == outs[1] == outs[2]


async def test_sglang_qwen2_and_stop_tokens(sg_checkpoints):
    """Another family, a stop token, min_new_tokens, logprobs and streaming."""
    folder = sg_checkpoints["qwen2"]
    prompt = random_prompts(1, 512, 12, 12, seed=9)[0]
    ref = hf_greedy(folder, prompt, 12)
    stop = ref[4]
    cut = ref.index(stop) + 1
    engine = sglang_engine(folder, loop="overlap")
    async with engine:
        res = await engine.generate(
            input_ids=prompt, sampling=SamplingParams(max_new_tokens=12, stop_token_ids=[stop], return_logprob=True)
        )
        deltas = [d async for d in engine.stream(input_ids=prompt, sampling=SamplingParams(max_new_tokens=6))]
        info = await engine.model_info()
    assert res.output_ids == ref[:cut] and res.finish_reason == "stop"
    assert res.output_logprobs is not None and len(res.output_logprobs) == cut
    assert [t for d in deltas for t in d.token_ids] == ref[:6] and deltas[-1].finished
    assert info["success"] and info["data"]["backend"] == "sglang"
    assert_sglang_pools_free(engine)


async def test_sglang_without_its_prefix_cache(sg_checkpoints):
    """``enable_prefix_cache=False`` turns SGLang's radix cache off (its chunk cache
    serves instead); tokens still equal transformers under the same KV pressure."""
    folder = sg_checkpoints["llama"]
    prompts, lengths = _workload(512)
    sg = sglang_engine(folder, loop="overlap", enable_prefix_cache=False, **LIMITS)
    results = await _run_all(sg, prompts, lengths)
    assert type(sg.stack.core.tree_cache).__name__ != "RadixCache"
    assert [r.output_ids for r in results] == _expected(folder, prompts, lengths)
