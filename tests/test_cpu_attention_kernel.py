"""The opt-in CPU decode attention kernel (``cpu_attention_kernel=True``): it reads the
KV pages in place and must give what the page-gather reference gives, close to float
noise, on random page tables and lengths; an engine using it gives the same tokens in
every loop and the reference's greedy tokens on the built-in model."""

from __future__ import annotations

import asyncio

import pytest
import torch

from omni_async import Engine, SamplingParams, errors
from omni_async.kernels.cpu_paged import paged_decode
from omni_async.kv.attention import decode_over_pages

from .conftest import LOOPS, assert_kv_free


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_kernel_matches_the_page_gather(dtype, tol, heads, kv_heads):
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    b, d, ps = 7, 64, 16
    lens = torch.randint(1, 90, (b,), generator=gen)
    pages_per = int((lens.max() + ps - 1) // ps)
    num_pages = b * pages_per + 5
    k_cache = torch.randn(num_pages * ps, kv_heads, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_pages * ps, kv_heads, d, generator=gen).to(dtype)
    pages = torch.randperm(num_pages, generator=gen)[: b * pages_per].view(b, pages_per)
    q = torch.randn(b, heads, d, generator=gen).to(dtype)
    ref = decode_over_pages(q, k_cache, v_cache, pages, ps, lens, d**-0.5)
    got = paged_decode(q, k_cache, v_cache, pages, ps, lens, d**-0.5)
    assert got.dtype == dtype and got.shape == ref.shape
    assert torch.allclose(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_bits_do_not_depend_on_its_batch(threads):
    """The kernel splits its work by query head, by KV head or by row depending on the
    rows and threads; a row's output must be the same bits in every split (the decode
    stack and the per-op path, and a row decoded alone or with 15 others, agree)."""
    gen = torch.Generator().manual_seed(3)
    b, heads, kv_heads, d, ps = 16, 9, 3, 64, 16
    lens = torch.randint(1, 70, (b,), generator=gen)
    num_pages = b * 5 + 3
    k_cache = torch.randn(num_pages * ps, kv_heads, d, generator=gen)
    v_cache = torch.randn(num_pages * ps, kv_heads, d, generator=gen)
    pages = torch.randperm(num_pages, generator=gen)[: b * 5].view(b, 5)
    q = torch.randn(b, heads, d, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = paged_decode(q, k_cache, v_cache, pages, ps, lens, d**-0.5)
        for size in (1, 2, 5):
            for lo in range(0, b, size):
                part = paged_decode(q[lo:lo + size], k_cache, v_cache, pages[lo:lo + size], ps, lens[lo:lo + size], d**-0.5)
                assert torch.equal(part, together[lo:lo + size]), (size, lo)
    finally:
        torch.set_num_threads(before)


def test_engine_tokens_agree_across_loops_and_with_the_reference():
    prompts = [[5, 6, 7], list(range(3, 60)), [9] * 20, list(range(100, 140))]
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)

    async def tokens(**kw):
        engine = Engine.from_pretrained("tiny", **kw)
        async with engine:
            out = await asyncio.gather(*(engine.generate(input_ids=p, sampling=sp) for p in prompts))
        assert_kv_free(engine)
        return [r.output_ids for r in out]

    async def all_runs():
        ref = await tokens()
        return ref, [await tokens(loop=loop, cpu_attention_kernel=True) for loop in LOOPS]

    ref, runs = asyncio.run(all_runs())
    assert all(r == ref for r in runs)


def test_refused_with_tensor_parallelism():
    with pytest.raises(errors.ConfigError, match="cpu_attention_kernel"):
        Engine.from_pretrained("tiny", cpu_attention_kernel=True, tensor_parallel_size=2)
