"""The three loops give identical tokens on the same request mix; lookahead ordering;
runner failures inside the lookahead."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni_async import Engine, SamplingParams, errors
from omni_async.runners.native import NativeModelRunner

from .conftest import LOOPS, assert_kv_free


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")  # conftest: tiny steps beside the loop thread


def request_mix(seed: int, n: int, vocab: int = 256) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    mix = []
    for i in range(n):
        prompt = [rng.randrange(0, vocab) for _ in range(rng.randint(1, 90))]
        if i % 3 == 2:
            sp = SamplingParams(max_new_tokens=rng.randint(1, 40), temperature=0.9, top_k=50, seed=rng.randrange(1 << 31), ignore_eos=True)
        else:
            sp = SamplingParams(max_new_tokens=rng.randint(1, 40), ignore_eos=True)
        mix.append((prompt, sp))
    return mix


async def run_mix(loop: str, mix, *, stagger: bool = True, aborts: dict[int, int] | None = None, **limits):
    """Run a mix; request i is aborted after it streamed ``aborts[i]`` tokens.
    Returns per request the output ids or ('aborted', ids)."""
    aborts = aborts or {}
    engine = Engine.from_pretrained("tiny", loop=loop, **limits)
    async with engine:

        async def one(i: int, prompt, sp):
            if stagger:
                await asyncio.sleep(0.002 * (i % 5))
            handle = await engine.submit(input_ids=prompt, sampling=sp, request_id=f"q{i}")
            got: list[int] = []
            try:
                async for delta in handle:
                    got.extend(delta.token_ids)
                    if i in aborts and len(got) >= aborts[i]:
                        await engine.abort(handle.request_id)
            except errors.RequestAbortedError as exc:
                return ("aborted", exc.output_ids)
            return got

        outs = await asyncio.gather(*(one(i, p, sp) for i, (p, sp) in enumerate(mix)))
        retractions = engine.stack.core.num_retractions
    assert_kv_free(engine)
    return outs, retractions


async def test_loops_identical_with_retraction_and_chunking():
    mix = request_mix(3, 20)
    limits = dict(page_size=8, kv_capacity_tokens=8 * 24, chunked_prefill_size=40, max_prefill_tokens=64, max_running_requests=12)
    results = {loop: await run_mix(loop, mix, **limits) for loop in LOOPS}
    ref, retractions = results["normal"]
    assert retractions > 0
    for loop in LOOPS:
        assert results[loop][0] == ref, loop
    for (prompt, sp), out in zip(mix, ref):
        assert len(out) == sp.max_new_tokens


async def test_loops_identical_with_aborts_at_random_steps():
    mix = request_mix(5, 12)
    for _, sp in mix:
        sp.max_new_tokens = 30
    aborts = {1: 3, 4: 10, 7: 1, 10: 20}
    ref, _ = await run_mix("normal", mix, stagger=False)
    for loop in LOOPS:
        outs, _ = await run_mix(loop, mix, aborts=aborts, stagger=False)
        for i, out in enumerate(outs):
            if i in aborts:
                kind, ids = out
                assert kind == "aborted"
                assert len(ids) >= aborts[i]
                assert ids == ref[i][: len(ids)], (loop, i)
            else:
                assert out == ref[i], (loop, i)


async def test_batch_size_crosses_lookahead_threshold_both_ways():
    """bs 1 -> many -> 1 -> many: outputs equal the normal loop."""
    mix = []
    for i in range(6):
        mix.append(([10 + i] * (5 + i), SamplingParams(max_new_tokens=4 + 9 * i, ignore_eos=True)))
    ref, _ = await run_mix("normal", mix, stagger=True)
    for loop in ("overlap", "async_decode"):
        outs, _ = await run_mix(loop, mix, stagger=True, async_decode_min_batch_size=3)
        assert outs == ref


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 10),
    kv_pages=st.integers(20, 60),
    min_bs=st.integers(1, 4),
)
def test_property_random_mixes_identical_across_loops(seed, n, kv_pages, min_bs):
    mix = request_mix(seed, n)

    async def go():
        limits = dict(page_size=8, kv_capacity_tokens=8 * kv_pages, chunked_prefill_size=32, async_decode_min_batch_size=min_bs)
        ref, _ = await run_mix("normal", mix, **limits)
        for loop in ("overlap", "async_decode"):
            outs, _ = await run_mix(loop, mix, **limits)
            assert outs == ref, loop

    asyncio.run(go())


# ---------------------------------------------------------------- lookahead ordering


async def test_scripted_batch_sizes_order_of_sync_launch_resolve_drain():
    """Decode batch sizes 1, 2, 2, 1, 1 then idle, with min batch size 2."""
    from omni_async.core.batch import ForwardMode, ScheduledBatch
    from omni_async.core.batch_core import NativeBatchCore
    from omni_async.core.request import Request, RequestData

    from omni_async.backends.native.builder import build_native_stack
    from omni_async.config import SchedulerConfig
    from omni_async.scheduler import AsyncOmniScheduler

    config = SchedulerConfig(loop="async_decode", async_decode_min_batch_size=2)
    stack = build_native_stack("tiny", config)
    script = [1, 2, 2, 1, 1]
    reqs = [Request(rid=f"s{i}", prompt_ids=[1], sampling=SamplingParams(max_new_tokens=100)) for i in range(2)]
    for r in reqs:
        r.data = RequestData(req=r)

    class ScriptedCore(NativeBatchCore):
        def get_next_batch(self):
            if not script:
                return None
            size = script.pop(0)
            b = ScheduledBatch(
                mode=ForwardMode.DECODE, reqs=reqs[:size], epochs=[0] * size, prefix_lens=[0] * size,
                extend_lens=[1] * size, samples_kept=[True] * size, input_ids=[1] * size,
                sample_indices=[0] * size, page_tables=[[0]] * size, page_counts=[1] * size,
            )
            return b

        def process_result(self, batch, tokens, logprobs=None):
            return []

    # The stage is assembled with the scripted core through its public constructor.
    sched = AsyncOmniScheduler(stack.runner, ScriptedCore(config, stack.allocator, 4096), stack.limits, config=config)
    sched.trace_enabled = True
    engine = Engine(sched, stack=stack)
    lookahead_collects = []
    plain_collect = sched.runner.collect

    def counting_collect(pending):
        lookahead_collects.append(pending.lookahead)
        return plain_collect(pending)

    sched.runner.collect = counting_collect
    async with engine:
        while script:
            await asyncio.sleep(0.01)
        sched.wake()
        await asyncio.sleep(0.05)
        assert sched.stats.trace == ["sync:1", "launch:2", "launch:2", "resolve:2", "drain:2", "sync:1", "sync:1"]
        assert lookahead_collects.count(True) == 2


class FlakyRunner(NativeModelRunner):
    """Raises at a chosen point of the lookahead path, once."""

    fail_at: str = ""
    scheduler = None

    def post_decode_launch(self, result, forward_batch, requests):
        if self.fail_at == "launch" and len(requests) >= 2:
            self.fail_at = ""
            raise RuntimeError("boom in launch")
        return super().post_decode_launch(result, forward_batch, requests)

    def post_decode_resolve(self, launch_buf, result, forward_batch, schedule_batch, requests):
        if self.fail_at == "resolve":
            self.fail_at = ""
            raise RuntimeError("boom in resolve")
        if self.fail_at == "drain" and self.scheduler.stats.trace and self.scheduler.stats.trace[-1].startswith("drain"):
            self.fail_at = ""
            raise RuntimeError("boom in drain")
        return super().post_decode_resolve(launch_buf, result, forward_batch, schedule_batch, requests)


@pytest.mark.parametrize("where", ["launch", "resolve", "drain"])
async def test_a_transient_runner_failure_in_lookahead_is_retried_once(where):
    """A step that raises once: its requests are retried (re-prefilled) and finish with
    the tokens they would have had; the loop serves on."""
    reference = Engine.from_pretrained("tiny", loop="normal")
    engine = Engine.from_pretrained("tiny", loop="async_decode")
    runner = engine.scheduler.runner
    runner.__class__ = FlakyRunner
    runner.fail_at = where
    runner.scheduler = engine.scheduler
    engine.scheduler.trace_enabled = True
    async with engine:
        lens = [3, 40, 40, 40] if where == "drain" else [40, 40, 40, 40]
        if where == "drain":
            lens = [6, 60]
        handles = [
            await engine.submit(input_ids=[i + 1, 2, 3], sampling=SamplingParams(max_new_tokens=n, ignore_eos=True))
            for i, n in enumerate(lens)
        ]
        outcomes = [(await h.result()).output_ids for h in handles]
        assert runner.fail_at == "", "the fault was never injected"
        assert (await engine.model_info())["data"]["failed_steps"] >= 1
        # the loop serves the next requests
        after = await asyncio.gather(
            *[engine.generate(input_ids=[7, i], sampling=SamplingParams(max_new_tokens=12, ignore_eos=True)) for i in range(3)]
        )
        assert all(len(r.output_ids) == 12 for r in after)
    assert_kv_free(engine)
    async with reference:
        expected = [
            (await reference.generate(input_ids=[i + 1, 2, 3], sampling=SamplingParams(max_new_tokens=n, ignore_eos=True))).output_ids
            for i, n in enumerate(lens)
        ]
    assert outcomes == expected


@pytest.mark.parametrize("loop", LOOPS)
async def test_no_stall_when_the_step_in_flight_frees_the_kv_waiting_requests_need(hf_checkpoints, loop):
    """Tiny KV: nothing can be scheduled until the step in flight finishes requests and
    frees their KV; the loop must look again after draining instead of going idle."""
    from .conftest import random_prompts

    prompts = random_prompts(14, 512, 3, 50, seed=7)
    prompts.append(list(prompts[0]))
    prompts.append(prompts[1][:20] + [5, 6, 7])
    rng = random.Random(11)
    lengths = [rng.randint(1, 20) if i % 4 == 0 else rng.randint(60, 100) for i, _ in enumerate(prompts)]
    engine = Engine.from_pretrained(
        str(hf_checkpoints["llama"]), loop=loop, page_size=4, kv_capacity_tokens=200, chunked_prefill_size=32, max_prefill_tokens=48
    )
    async with engine:
        reqs = [engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, lengths)]
        reqs += [
            engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=12, temperature=0.9, top_k=40, top_p=0.95, seed=100 + i))
            for i, p in enumerate(prompts[:4])
        ]
        results = await asyncio.wait_for(asyncio.gather(*reqs), 60)
    assert [len(r.output_ids) for r in results] == lengths + [12] * 4
    assert_kv_free(engine)


@pytest.mark.parametrize("loop", LOOPS)
async def test_a_step_reaches_its_reader_once_the_next_step_runs(loop):
    """A synchronous step's deltas are handed to the readers after the next step is
    launched (and a lookahead step's are processed after it anyway), so the readers' work
    overlaps the device rather than delaying the launch; the last step's go out when the
    loop goes idle. One token a step: when the reader sees its t-th token, step t + 1
    (the prefill is step 1) has been launched, except after the last."""
    engine = Engine.from_pretrained("tiny", loop=loop, decode_steps=1)
    async with engine:
        handle = await engine.submit(input_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=6, ignore_eos=True))
        seen: list[tuple[int, int]] = []
        async for delta in handle:
            seen.append((len(delta.token_ids), engine.scheduler.info()["steps"]))
    assert sum(n for n, _ in seen) == 6
    got = 0
    for n, launched in seen:
        got += n
        assert launched == min(got + 1, 6), seen
