"""memory_budget: an engine's share of the device's total memory (or bytes), spent on
weights, a reserve and the KV cache, whatever else is loaded; and the pipeline's shares."""

from __future__ import annotations

import pytest

import torch

from omni_async import Engine, RequestPayload, SamplingParams, errors
from omni_async.memory_budget import activation_reserve_bytes, budget_bytes, check_budget, device_total_bytes, plan_memory
from omni_async.pipeline import TwoStagePipeline

from .conftest import LOOPS

GiB = 1 << 30
MiB = 1 << 20


def plan(budget, **over):
    facts = dict(total_bytes=80 * GiB, weights_bytes=3 * GiB, reserve_bytes=1 * GiB, kv_bytes_per_token=28 * 1024, page_size=16)
    return plan_memory(budget, **{**facts, **over})


# ------------------------------------------------------------------ the sizing (pure)


def test_a_fraction_is_of_the_total_and_an_int_is_bytes():
    assert budget_bytes(0.25, 80 * GiB) == 20 * GiB
    assert budget_bytes(1.0, 80 * GiB) == 80 * GiB
    assert budget_bytes(5 * GiB, 80 * GiB) == 5 * GiB
    with pytest.raises(errors.ConfigError, match="exceeds the device"):
        budget_bytes(81 * GiB, 80 * GiB)


@pytest.mark.parametrize("bad", [0.0, 1.5, -0.1, 0, -5, True, "0.5", None])
def test_a_budget_that_is_neither_a_fraction_nor_bytes_is_refused(bad):
    with pytest.raises(errors.ConfigError, match="memory_budget"):
        check_budget(bad)


def test_the_kv_gets_what_weights_and_reserve_leave_in_whole_pages():
    p = plan(0.25)
    left = 20 * GiB - 3 * GiB - 1 * GiB
    assert p.kv_tokens % 16 == 0
    assert p.kv_tokens * 28 * 1024 <= left < (p.kv_tokens + 16) * 28 * 1024
    assert (p.budget_bytes, p.weights_bytes, p.reserve_bytes, p.kv_bytes) == (20 * GiB, 3 * GiB, 1 * GiB, p.kv_tokens * 28 * 1024)


def test_a_share_depends_on_the_total_not_on_what_is_free():
    # The plan has no input for free memory: the same share buys the same KV whichever
    # engine loads first; two shares of one device add up.
    first, second = plan(0.5), plan(0.3, weights_bytes=1 * GiB)
    assert plan(0.5) == first
    assert first.budget_bytes + second.budget_bytes <= 80 * GiB


def test_a_budget_that_cannot_hold_the_weights_and_a_minimum_kv_is_a_config_error():
    with pytest.raises(errors.ConfigError, match="cannot hold the weights"):
        plan(3 * GiB)  # the weights alone
    with pytest.raises(errors.ConfigError, match="minimum KV"):
        plan(4 * GiB + 512 * 28 * 1024, min_kv_tokens=1024)  # weights and reserve, half the minimum KV
    assert plan(4 * GiB + 1024 * 28 * 1024, min_kv_tokens=1024).kv_tokens == 1024


def test_a_given_kv_size_is_checked_against_the_budget():
    assert plan(0.25, kv_tokens=4096).kv_tokens == 4096
    with pytest.raises(errors.ConfigError, match="kv_capacity_tokens"):
        plan(0.25, kv_tokens=1_000_000)


def test_the_reserve_grows_with_the_prefill_chunk_the_batch_and_the_graphs():
    base = dict(hidden_size=1536, intermediate_size=8960, vocab_size=151936, prefill_tokens=8192, max_batch=256, dtype_bytes=2)
    r = activation_reserve_bytes(**base)
    assert activation_reserve_bytes(**{**base, "prefill_tokens": 16384}) > r
    assert activation_reserve_bytes(**{**base, "max_batch": 512}) > r
    assert activation_reserve_bytes(**base, cuda_graph_batch=256, device_type="cuda") > r


# ------------------------------------------------------------------ engines and pipelines


async def test_an_engine_budget_sizes_its_kv_the_same_whatever_was_loaded_before():
    share = 64 * MiB / device_total_bytes(torch.device("cpu"))  # a fraction of the machine's RAM
    alone = Engine.from_pretrained("tiny", memory_budget=share)
    other = Engine.from_pretrained("tiny", kv_capacity_tokens=200_000)  # holds memory while the next loads
    after = Engine.from_pretrained("tiny", memory_budget=share)
    assert alone.scheduler.limits.kv_capacity_tokens == after.scheduler.limits.kv_capacity_tokens
    assert 16 * 1024 < after.scheduler.limits.kv_capacity_tokens < 64 * MiB // 1024
    async with after:
        out = await after.generate(input_ids=[256, 1, 2], sampling=SamplingParams(max_new_tokens=4))
    assert len(out.output_ids) == 4
    del other


def test_an_engine_budget_too_small_for_its_model_is_a_config_error():
    with pytest.raises(errors.ConfigError, match="cannot hold the weights"):
        Engine.from_pretrained("tiny", memory_budget=2 * MiB)


def test_without_a_budget_kv_capacity_tokens_still_sizes_the_kv():
    assert Engine.from_pretrained("tiny", kv_capacity_tokens=4096).scheduler.limits.kv_capacity_tokens == 4096


@pytest.mark.parametrize("shares", [(0.7, 0.5), (1.0, 0.01), (0.5, 1.5)])
def test_pipeline_shares_that_do_not_fit_the_device_are_a_config_error(shares):
    with pytest.raises(errors.ConfigError, match="memory"):
        TwoStagePipeline.from_pretrained("tiny", "tiny", shares=shares)


def test_a_pipeline_share_too_small_for_its_model_is_a_config_error():
    with pytest.raises(errors.ConfigError, match="cannot hold the weights"):
        TwoStagePipeline.from_pretrained("tiny", "tiny", shares=(64 * MiB, 2 * MiB))


@pytest.mark.parametrize("loop", LOOPS)
async def test_the_pipeline_gives_the_thinker_tokens_of_the_thinker_alone(loop):
    prompts = [[256, *b"one thinker"], list(range(30, 70)), [256, *b"three"] * 4]
    params = [SamplingParams(max_new_tokens=14, ignore_eos=True), SamplingParams(max_new_tokens=14, temperature=0.9, seed=3, ignore_eos=True)]
    work = [(p, s) for p in prompts for s in params]
    async with Engine.from_pretrained("tiny", loop=loop, seed=0, memory_budget=64 * MiB) as alone:
        expected = [(await alone.generate(input_ids=p, sampling=s)).output_ids for p, s in work]
    pipe = TwoStagePipeline.from_pretrained("tiny", "tiny", loop=loop, shares=(64 * MiB, 48 * MiB))
    async with pipe:
        handles = [
            await pipe.submit(f"c{i}", RequestPayload(f"c{i}", p, s), RequestPayload(f"c{i}", [], SamplingParams(max_new_tokens=6, ignore_eos=True)))
            for i, (p, s) in enumerate(work)
        ]
        results = [await h.results() for h in handles]
    assert [r["thinker"].output_ids for r in results] == expected
    assert all(len(r["talker"].output_ids) == 6 for r in results)
