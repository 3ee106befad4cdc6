"""Aborts (waiting and running), pause modes, weight updates and terminal messages on
the SGLang backend; every test ends with SGLang's pools back to full."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from omni_async import SamplingParams, errors
from omni_async.messages import IncomingMessage, RequestPayload

from .conftest import LOOPS, assert_sglang_pools_free, hf_greedy, random_prompts, sglang_engine


async def _deltas(handle, n: int, sink: list) -> None:
    async for delta in handle:
        sink.extend(delta.token_ids)
        if len(sink) >= n:
            return


@pytest.mark.parametrize("loop", LOOPS)
async def test_abort_waiting_and_running(sg_checkpoints, loop):
    folder = sg_checkpoints["llama"]
    a, b, c = random_prompts(3, 512, 6, 20, seed=21)
    engine = sglang_engine(folder, loop=loop, max_running_requests=2)
    async with engine:
        running = await engine.submit(input_ids=a, sampling=SamplingParams(max_new_tokens=200), request_id="run")
        other = await engine.submit(input_ids=c, sampling=SamplingParams(max_new_tokens=24), request_id="other")
        waiting = await engine.submit(input_ids=b, sampling=SamplingParams(max_new_tokens=8), request_id="wait")
        seen: list[int] = []
        it = running.__aiter__()
        while len(seen) < 3:
            seen.extend((await it.__anext__()).token_ids)
        # Two slots, both taken: "wait" sits in SGLang's waiting queue.
        assert engine.stack.core.find("wait") is not None
        assert [r.rid for r in engine.stack.core.waiting_queue] == ["wait"]
        await engine.abort("wait")
        with pytest.raises(errors.RequestAbortedError):
            await waiting.result()
        await engine.abort("run")
        with pytest.raises(errors.RequestAbortedError) as info:
            await running.result()
        out = await other.result()
        partial = info.value.output_ids
        after = await engine.generate(input_ids=b, sampling=SamplingParams(max_new_tokens=8))
    ref = hf_greedy(folder, a, 200)
    assert 3 <= len(partial) < 200 and partial == ref[: len(partial)]
    assert out.output_ids == hf_greedy(folder, c, 24)
    assert after.output_ids == hf_greedy(folder, b, 8)
    assert_sglang_pools_free(engine)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
async def test_pause_and_continue(sg_checkpoints, loop, mode):
    folder = sg_checkpoints["llama"]
    prompts = random_prompts(3, 512, 5, 30, seed=33)
    n_new = 40
    engine = sglang_engine(folder, loop=loop)
    async with engine:
        handles = [
            await engine.submit(input_ids=p, sampling=SamplingParams(max_new_tokens=n_new), request_id=f"p{i}")
            for i, p in enumerate(prompts)
        ]
        tokens: list[list[int]] = [[] for _ in handles]
        iters = [h.__aiter__() for h in handles]
        while len(tokens[0]) < 3:
            tokens[0].extend((await iters[0].__anext__()).token_ids)
        reply = await engine.pause(mode=mode)
        assert reply["success"], reply
        assert reply["data"]["mode"] == mode
        core = engine.stack.core
        if mode == "retract":
            # Every request back in SGLang's waiting queue, its KV released.
            assert reply["data"]["num_paused_requests"] == 3
            assert core.stats()["running_batch_size"] == 0 and len(core.waiting_queue) == 3
            assert core.kv_is_fully_free()
        info = await engine.model_info()
        assert info["data"]["engine_paused"] is True
        progress = engine.scheduler.info()["tokens_out"]
        await asyncio.sleep(0.3)
        assert engine.scheduler.info()["tokens_out"] == progress, "generated while paused"
        assert (await engine.resume())["success"]
        if mode == "abort":
            assert reply["data"]["num_paused_requests"] == 3
            for h in handles:
                with pytest.raises(errors.RequestAbortedError):
                    await h.result()
            fresh = await engine.generate(input_ids=prompts[1], sampling=SamplingParams(max_new_tokens=10))
            assert fresh.output_ids == hf_greedy(folder, prompts[1], 10)
        else:
            results = [await h.result() for h in handles]
            for res, p in zip(results, prompts):
                assert res.output_ids == hf_greedy(folder, p, n_new)
            if mode == "retract":
                assert core.num_retractions >= 3
    assert_sglang_pools_free(engine)


async def test_update_weights_from_disk(sg_checkpoints):
    folder_a, folder_b = sg_checkpoints["llama"], sg_checkpoints["llama_b"]
    prompt = random_prompts(1, 512, 24, 24, seed=44)[0]
    engine = sglang_engine(folder_a, loop="overlap")
    async with engine:
        before = await engine.generate(input_ids=prompt, sampling=SamplingParams(max_new_tokens=12))
        for _ in range(500):  # the lookahead loop releases after its overshoot step
            if engine.stack.tree_cache.evictable_size() > 0:
                break
            await asyncio.sleep(0.01)
        assert engine.stack.tree_cache.evictable_size() > 0  # the prompt's KV is cached
        check_a = await engine.weights_checker()
        reply = await engine.update_weights_from_disk(str(folder_b))
        assert reply["success"], reply
        assert reply["data"]["flush_success"] is True
        assert engine.stack.tree_cache.evictable_size() == 0  # old-weight KV dropped
        check_b = await engine.weights_checker()
        after = await engine.generate(input_ids=prompt, sampling=SamplingParams(max_new_tokens=12))
        bad = await engine.update_weights_from_disk(str(folder_b) + "-missing")
        still = await engine.generate(input_ids=prompt, sampling=SamplingParams(max_new_tokens=12))
        info = await engine.model_info()
    assert before.output_ids == hf_greedy(folder_a, prompt, 12)
    assert after.output_ids == hf_greedy(folder_b, prompt, 12)
    assert check_a["data"] != check_b["data"]
    assert not bad["success"] and bad["message"]
    assert still.output_ids == after.output_ids  # the failed update kept the new weights
    assert info["data"]["model_path"] == str(folder_b)
    assert_sglang_pools_free(engine)


@pytest.mark.parametrize("loop", LOOPS)
async def test_every_request_ends_with_one_terminal_message(sg_checkpoints, loop):
    """Through the stage-facing scheduler: arrivals, aborts at every stage, a retract
    pause, then close with requests still open. One result or error each."""
    folder = sg_checkpoints["llama"]
    engine = sglang_engine(folder, loop=loop, page_size=4, kv_capacity_tokens=160, max_running_requests=4)
    s = engine.scheduler
    prompts = random_prompts(12, 512, 4, 40, seed=55)
    terminal: Counter[str] = Counter()
    kinds: dict[str, str] = {}
    async with s:
        async def consume() -> None:
            async for msg in s.outbox:
                if msg.type in ("result", "error"):
                    terminal[msg.request_id] += 1
                    kinds[msg.request_id] = msg.type

        consumer = asyncio.ensure_future(consume())

        def send(i: int, n: int) -> str:
            rid = f"m{i}"
            payload = RequestPayload(request_id=rid, input_ids=prompts[i % len(prompts)], sampling=SamplingParams(max_new_tokens=n))
            s.inbox.send_nowait(IncomingMessage(rid, "new_request", payload))
            return rid

        rids = [send(i, 30 + 7 * (i % 5)) for i in range(10)]
        s.abort("m9")  # before admission
        await asyncio.sleep(0.05)
        s.abort("m8")  # waiting or running
        while s.stats.decode_steps < 3:
            await asyncio.sleep(0.01)
        s.abort("m0")  # running
        assert (await s.admin("pause_generation", {"mode": "retract"}))["success"]
        assert (await s.admin("continue_generation", {}))["success"]
        rids += [send(10, 20), send(11, 500)]  # the last one is still running at close
        while terminal["m1"] == 0 or terminal["m10"] == 0:
            await asyncio.sleep(0.02)
    await asyncio.wait_for(consumer, 30)
    assert sorted(terminal) == sorted(rids)
    assert all(v == 1 for v in terminal.values()), terminal
    assert kinds["m9"] == kinds["m8"] == kinds["m0"] == kinds["m11"] == "error"
    assert kinds["m1"] == kinds["m10"] == "result"
    assert_sglang_pools_free(engine)


async def test_prompt_logprobs_is_a_typed_error_on_that_request(sg_checkpoints):
    """Scoring prompts is the native runner's: SGLang refuses it by name, and the other
    requests carry on."""
    engine = sglang_engine(sg_checkpoints["llama"])
    async with engine:
        scored = engine.generate(input_ids=[3, 4, 5], sampling=SamplingParams(max_new_tokens=0, prompt_logprobs=1))
        plain = engine.generate(input_ids=[3, 4, 5], sampling=SamplingParams(max_new_tokens=3))
        err, ok = await asyncio.gather(scored, plain, return_exceptions=True)
        assert isinstance(err, errors.InvalidRequestError) and "prompt_logprobs" in str(err)
        assert len(ok.output_ids) == 3
    assert_sglang_pools_free(engine)
