"""Prefix caching in the native backend: page accounting of the cache itself (a model
of reference counts checked after every operation), and end to end: tokens with the
cache equal tokens without it in every loop, under chunked prefill, retraction and
aborts; ``n`` completions share their prompt; flush and weight updates empty it."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni_async import Engine, SamplingParams, errors
from omni_async.kv.allocator import PageAllocator
from omni_async.kv.prefix_cache import PrefixCache

from .conftest import LOOPS, assert_kv_free

PS = 4


def seq(prefix: list[int], n: int, start: int) -> list[int]:
    return prefix + list(range(start, start + n))


# ---------------------------------------------------------------- the cache alone


def test_match_reuses_whole_pages_and_leaves_a_token_to_compute():
    cache = PrefixCache(PageAllocator(16, PS))
    tokens = list(range(10, 22))  # three full pages
    pages = cache.allocate(3)
    assert cache.insert(tokens, pages, 0, len(tokens)) == 3
    cache.release(pages)
    assert cache.cached_pages == 3 and cache.held_pages == 0 and cache.available_pages == 16
    # A request with the same 12 tokens reuses at most 11 of them: two pages.
    assert cache.match(tokens, len(tokens) - 1) == pages[:2]
    # A longer sequence with the same start reuses all three.
    longer = tokens + [1, 2, 3]
    assert cache.match(longer, len(longer) - 1) == pages
    # Same tokens in another order share nothing.
    assert cache.match(tokens[4:] + tokens[:4], 11) == []


def test_eviction_takes_least_recent_leaves_and_never_a_held_page():
    alloc = PageAllocator(6, PS)
    cache = PrefixCache(alloc)
    a = list(range(100, 108))  # two pages
    b = list(range(200, 208))
    pa, pb = cache.allocate(2), cache.allocate(2)
    cache.insert(a, pa, 0, 8)
    cache.insert(b, pb, 0, 8)
    cache.release(pa)
    cache.release(pb)
    held = cache.match(b + [0], 8)  # b held again: most recent and in use
    assert held == pb
    fresh = cache.allocate(4)  # 2 free + 2 evicted, and they must be a's
    assert set(fresh) & set(pb) == set()
    assert set(pa) <= set(fresh)
    assert cache.match(a + [0], 8) == []  # a is gone
    with pytest.raises(errors.KVAllocationError):
        cache.allocate(1)  # the rest is held
    cache.release(fresh)
    cache.release(held)
    assert cache.flush() and alloc.is_fully_free()


def test_duplicate_page_stays_private_and_flush_is_refused_while_held():
    alloc = PageAllocator(8, PS)
    cache = PrefixCache(alloc)
    tokens = list(range(8))
    first, second = cache.allocate(2), cache.allocate(2)
    assert cache.insert(tokens, first, 0, 8) == 2
    assert cache.insert(tokens, second, 0, 8) == 0  # computed twice: the copy is not shared
    assert not cache.flush()  # both requests still hold KV
    cache.release(second)
    cache.release(first)
    assert cache.held_pages == 0 and cache.cached_pages == 2
    assert cache.flush() and alloc.is_fully_free() and cache.cached_pages == 0


def test_invalidate_keeps_held_pages_with_their_holder():
    alloc = PageAllocator(8, PS)
    cache = PrefixCache(alloc)
    tokens = list(range(8))
    pages = cache.allocate(2)
    cache.insert(tokens, pages, 0, 8)
    other = cache.match(tokens + [9], 8)
    cache.invalidate()
    assert cache.match(tokens + [9], 8) == []
    cache.release(other)
    assert alloc.used_pages == 2  # still held by the first holder
    cache.release(pages)
    assert alloc.is_fully_free()


def test_a_bad_free_takes_no_page_back():
    """The pages of a release go back in one call (one per finished request): a double
    free in that call, or a page never handed out, raises before any page of it is
    freed, so the allocator's books stay as they were."""
    alloc = PageAllocator(8, PS)
    a, b = alloc.allocate(2)
    for bad in ([a, b, a], [a, 7]):
        with pytest.raises(errors.KVAllocationError):
            alloc.free(bad)
        assert alloc.used_pages == 2 and alloc.free_pages == 6
    alloc.free([b, a])
    assert alloc.is_fully_free()
    assert alloc.allocate(2) == [a, b]  # freed in order: the last freed is handed out first


def test_release_frees_in_the_order_of_one_page_at_a_time():
    """Releasing a request's private pages in one call leaves the allocator handing out
    the same page ids, in the same order, as releasing them leaf first one by one."""
    one, batched = PageAllocator(16, PS), PageAllocator(16, PS)
    for alloc, by_page in ((one, True), (batched, False)):
        cache = PrefixCache(alloc, enabled=False)
        pages = cache.allocate(5)
        if by_page:
            for page in reversed(pages):
                alloc.free([page])
        else:
            cache.release(pages)
    assert one.allocate(16) == batched.allocate(16)


ops = st.lists(
    st.tuples(st.sampled_from(["start", "grow", "finish", "evict", "invalidate"]), st.integers(0, 7), st.integers(1, 14)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_reference_counts_against_a_model(script):
    """Random requests over a few shared prefixes: a page handed out is never one a
    request holds, the accounting adds up after every operation, and everything is
    free after the last release and a flush."""
    alloc = PageAllocator(12, PS)
    cache = PrefixCache(alloc)
    prefixes = [[1] * 8, [1] * 4 + [2] * 4, [3] * 12]
    live: dict[int, tuple[list[int], list[int]]] = {}  # id -> (tokens, pages)
    next_id = 0

    def holders() -> dict[int, int]:
        count: dict[int, int] = {}
        for _, pages in live.values():
            for p in pages:
                count[p] = count.get(p, 0) + 1
        return count

    for op, k, n in script:
        if op == "start":
            tokens = prefixes[k % 3] + [50 + k] * n
            pages = cache.match(tokens, len(tokens) - 1)
            need = alloc.pages_for(len(tokens)) - len(pages)
            if need > cache.available_pages:
                cache.release(pages)
                continue
            before = set(holders())
            new = cache.allocate(need)
            assert not set(new) & before, "handed out a page in use"
            pages = pages + new
            cache.insert(tokens, pages, 0, len(tokens))
            live[next_id] = (tokens, pages)
            next_id += 1
        elif op == "grow" and live:
            rid = sorted(live)[k % len(live)]
            tokens, pages = live[rid]
            if cache.available_pages:
                before = set(holders())
                new = cache.allocate(1)
                assert not set(new) & before
                pages.extend(new)
                tokens.extend([60 + k] * PS)
        elif op == "finish" and live:
            rid = sorted(live)[k % len(live)]
            tokens, pages = live.pop(rid)
            cache.insert(tokens, pages, 0, len(tokens))
            cache.release(pages)
        elif op == "evict":
            free = cache.available_pages
            if free:
                got = cache.allocate(free)
                assert not set(got) & set(holders())
                cache.release(got)
        elif op == "invalidate":
            cache.invalidate()
        held = holders()
        assert cache.held_pages == len(held)
        assert alloc.used_pages == len(held) + (cache.available_pages - alloc.free_pages)
    for rid in list(live):
        cache.release(live.pop(rid)[1])
    assert cache.flush() and alloc.is_fully_free()


# ---------------------------------------------------------------- end to end


def shared_prefix_mix(seed: int, n: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 250) for _ in range(rng.randint(20, 70))] for _ in range(3)]
    mix = []
    for i in range(n):
        prompt = systems[i % 3] + [rng.randrange(3, 250) for _ in range(rng.randint(1, 30))]
        if i % 4 == 3:
            sp = SamplingParams(max_new_tokens=rng.randint(20, 60), temperature=0.8, top_k=40, seed=i, ignore_eos=True)
        else:
            sp = SamplingParams(max_new_tokens=rng.randint(20, 60), ignore_eos=True)
        mix.append((prompt, sp))
    return mix


async def run_mix(mix, *, aborts=(), **limits):
    engine = Engine.from_pretrained("tiny", **limits)
    async with engine:

        async def one(i, prompt, sp):
            await asyncio.sleep(0.003 * (i % 4))
            handle = await engine.submit(input_ids=prompt, sampling=sp, request_id=f"m{i}")
            got: list[int] = []
            try:
                async for delta in handle:
                    got.extend(delta.token_ids)
                    if i in aborts and len(got) >= 3:
                        await engine.abort(handle.request_id)
                    if i == 0 and len(got) == 5:  # every running request back to waiting
                        assert (await engine.pause(mode="retract"))["success"]
                        await engine.resume()
            except errors.RequestAbortedError:
                return ("aborted", got[:3])
            return (got, (await handle.result()).cached_tokens)

        outs = await asyncio.gather(*(one(i, p, sp) for i, (p, sp) in enumerate(mix)))
        info = (await engine.model_info())["data"]
        assert info["kv_free_pages"] == info["kv_total_pages"], "a finished request still holds KV"
    assert_kv_free(engine)
    return outs, info


@pytest.mark.parametrize("loop", LOOPS)
async def test_tokens_equal_without_the_cache_under_pressure(loop):
    """Shared system prompts, chunked prefill, a KV small enough to retract and evict,
    and aborts: every request's tokens equal the cache-off run's."""
    mix = shared_prefix_mix(7, 18)
    limits = dict(loop=loop, page_size=8, kv_capacity_tokens=400, chunked_prefill_size=48, max_running_requests=8)
    off, info_off = await run_mix(mix, aborts={5}, enable_prefix_cache=False, **limits)
    on, info = await run_mix(mix, aborts={5}, **limits)
    assert [o[0] for o in on] == [o[0] for o in off]
    assert info["prefix_cache_hit_tokens"] > 0 and 0 < info["prefix_cache_hit_rate"] <= 1
    assert info["num_retractions"] > 0 and info["prefix_cache_evicted_pages"] > 0  # the pressure is real
    assert sum(o[1] for o in on if o[0] != "aborted") > 0
    assert info_off["prefix_cache_hit_tokens"] == 0


async def test_shared_system_prompt_is_prefilled_once():
    system = list(range(5, 5 + 64))
    prompts = [system + [200 + i, 201 + i] for i in range(6)]
    engine = Engine.from_pretrained("tiny", page_size=16)
    async with engine:
        results = await asyncio.gather(
            *(engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=4, ignore_eos=True)) for p in prompts)
        )
        info = (await engine.model_info())["data"]
    cached = sorted(r.cached_tokens for r in results)
    assert cached[0] == 0 and cached[1:] == [64] * 5  # the first computes it, the rest reuse it
    assert info["prefix_cache_pages"] >= 4


async def test_n_completions_share_the_prompt():
    prompt = list(range(10, 60))  # three full pages of 16 and two tokens
    engine = Engine.from_pretrained("tiny", page_size=16)
    async with engine:
        res = await engine.generate(input_ids=prompt, sampling=SamplingParams(max_new_tokens=5, n=4, temperature=0.7, seed=3))
    assert res.cached_tokens == 3 * 48
    assert len(res.outputs) == 4


async def test_flush_cache_is_refused_while_requests_run_and_empties_it():
    engine = Engine.from_pretrained("tiny", page_size=8)
    async with engine:
        await engine.generate(input_ids=list(range(3, 40)), sampling=SamplingParams(max_new_tokens=3))
        assert (await engine.model_info())["data"]["prefix_cache_pages"] > 0
        long = await engine.submit(input_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=4000, ignore_eos=True))
        while engine.scheduler.info()["running_batch_size"] == 0:
            await asyncio.sleep(0.005)
        refused = await engine.admin("flush_cache")
        assert not refused["success"] and "active" in refused["message"]
        await engine.abort(long.request_id)
        with pytest.raises(errors.RequestAbortedError):
            await long.result()
        done = await engine.flush_cache()
        assert done["success"], done
        info = (await engine.model_info())["data"]
        assert info["prefix_cache_pages"] == 0 and info["kv_free_pages"] == info["kv_total_pages"]
        again = await engine.generate(input_ids=list(range(3, 40)), sampling=SamplingParams(max_new_tokens=3))
        assert again.cached_tokens == 0
    assert_kv_free(engine)


async def test_weight_update_from_tensor_invalidates_the_cache():
    """New weights, the same prompt: nothing of the old KV is reused, and the tokens are
    those of an engine that never cached anything."""
    prompt = list(range(3, 60))
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine = Engine.from_pretrained("tiny", page_size=8)
    fresh = Engine.from_pretrained("tiny", page_size=8, enable_prefix_cache=False)
    async with engine, fresh:
        await engine.generate(input_ids=prompt, sampling=sp)
        name = "model.layers.0.mlp.down_proj.weight"
        weight = dict(engine.stack.runner.model.named_parameters())[name].detach().clone()
        named = [(name, weight * 1.5)]
        assert (await engine.update_weights_from_tensor(named))["success"]
        assert (await fresh.update_weights_from_tensor(named))["success"]
        assert (await engine.model_info())["data"]["prefix_cache_pages"] == 0
        after = await engine.generate(input_ids=prompt, sampling=sp)
        want = await fresh.generate(input_ids=prompt, sampling=sp)
    assert after.cached_tokens == 0
    assert after.output_ids == want.output_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("loop", LOOPS)
async def test_cuda_tokens_equal_without_the_cache(loop):
    """On CUDA (float32) the extend kernel reads shared prefix pages: tokens equal the
    cache-off run's, with retraction and eviction."""
    mix = shared_prefix_mix(11, 18)
    limits = dict(loop=loop, device="cuda", dtype="float32", page_size=8, kv_capacity_tokens=400,
                  chunked_prefill_size=48, max_running_requests=8)
    off, _ = await run_mix(mix, aborts={5}, enable_prefix_cache=False, **limits)
    on, info = await run_mix(mix, aborts={5}, **limits)
    assert [o[0] for o in on] == [o[0] for o in off]
    assert info["prefix_cache_hit_tokens"] > 0
