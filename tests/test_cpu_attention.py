"""The CPU attention paths over the paged cache: decode through whole pages equals decode
through single slots, and the half-precision paths (matmul decode, float32 SDPA for extend)
stay close to the float32 result; a bfloat16 engine gives the same tokens in every loop."""

from __future__ import annotations

import asyncio

import pytest
import torch

from omni_async import Engine, SamplingParams
from omni_async.kv.attention import AttentionContext, paged_attention, slots_from_tables

from .conftest import LOOPS, assert_kv_free, random_prompts

H, KVH, D, PS = 6, 2, 16, 4


def _cache(num_pages: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_pages * PS, KVH, D, generator=gen).to(dtype)
    v = torch.randn(num_pages * PS, KVH, D, generator=gen).to(dtype)
    return k, v


def _decode_inputs(lens: list[int], dtype: torch.dtype):
    widest = max(-(-n // PS) for n in lens)
    perm = torch.randperm(len(lens) * widest, generator=torch.Generator().manual_seed(1))
    tables = perm.view(len(lens), widest)
    q = torch.randn(len(lens), H, D, generator=torch.Generator().manual_seed(2)).to(dtype)
    return tables, torch.tensor(lens), q


def _by_slots(q, k, v, tables, lens):
    slots = slots_from_tables(tables, PS)[:, : int(lens.max())]
    ctx = AttentionContext(is_decode=True, slot_mapping=slots[:, 0], logits_rows=torch.arange(len(lens)), kv_slots=slots, kv_lens=lens)
    return paged_attention(q, k, v, ctx, D**-0.5)


def _by_pages(q, k, v, tables, lens):
    ctx = AttentionContext(
        is_decode=True, slot_mapping=tables[:, 0], logits_rows=torch.arange(len(lens)),
        kv_lens=lens, block_tables=tables, page_size=PS,
    )
    return paged_attention(q, k, v, ctx, D**-0.5)


def _reference(q, k, v, tables, lens):
    """Plain float32 softmax attention, one sequence at a time."""
    out = []
    for i, n in enumerate(lens.tolist()):
        slots = slots_from_tables(tables[i : i + 1], PS)[0, :n]
        kk = k[slots].float().repeat_interleave(H // KVH, dim=1)  # [n, H, D]
        vv = v[slots].float().repeat_interleave(H // KVH, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[i].float(), kk) * D**-0.5, dim=-1)
        out.append(torch.einsum("hn,nhd->hd", w, vv))
    return torch.stack(out)


def test_decode_through_pages_equals_decode_through_slots():
    lens = [1, 5, 9, 16, 3]
    tables, kv_lens, q = _decode_inputs(lens, torch.float32)
    k, v = _cache(int(tables.max()) + 1, torch.float32)
    by_pages = _by_pages(q, k, v, tables, kv_lens)
    torch.testing.assert_close(by_pages, _by_slots(q, k, v, tables, kv_lens), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(by_pages, _reference(q, k, v, tables, kv_lens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_decode_is_close_to_float32(dtype):
    lens = [2, 7, 12, 4]
    tables, kv_lens, q = _decode_inputs(lens, dtype)
    k, v = _cache(int(tables.max()) + 1, dtype)
    expected = _reference(q, k, v, tables, kv_lens)
    for got in (_by_pages(q, k, v, tables, kv_lens), _by_slots(q, k, v, tables, kv_lens)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), expected, rtol=0, atol=3e-2)


def test_half_precision_extend_is_close_to_float32():
    k32, v32 = _cache(8, torch.float32)
    q32 = torch.randn(6, H, D, generator=torch.Generator().manual_seed(3))
    slots = torch.arange(10, 16)  # a sequence with 10 cached tokens and 6 new ones
    seq = torch.arange(0, 16)

    def run(dtype):
        ctx = AttentionContext(
            is_decode=False, slot_mapping=slots, logits_rows=torch.tensor([5]),
            seq_slices=[(0, 6, 10)], seq_kv_slots=[seq],
        )
        return paged_attention(q32.to(dtype), k32.to(dtype), v32.to(dtype), ctx, D**-0.5)

    half = run(torch.bfloat16)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), run(torch.float32), rtol=0, atol=3e-2)


async def test_bfloat16_engine_gives_the_same_tokens_in_every_loop():
    prompts = random_prompts(6, 256, 3, 40, seed=5)
    outputs = []
    for loop in LOOPS:
        engine = Engine.from_pretrained("tiny", loop=loop, dtype="bfloat16", page_size=4)
        async with engine:
            results = await asyncio.gather(
                *[engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=12, ignore_eos=True)) for p in prompts]
            )
        assert_kv_free(engine)
        outputs.append([r.output_ids for r in results])
    assert all(len(ids) == 12 for ids in outputs[0])
    assert outputs[0] == outputs[1] == outputs[2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_slots_past_the_length_never_reach_the_output(dtype):
    """Pages come back from the free list holding whatever their last owner wrote (a
    failed request's NaN, say): the slots past a sequence's length must not reach its
    output, whatever they hold (NaN times a zero weight is still NaN)."""
    lens = [2, 7, 12, 4]
    tables, kv_lens, q = _decode_inputs(lens, dtype)
    k, v = _cache(int(tables.max()) + 1, dtype)
    clean = [_by_pages(q, k, v, tables, kv_lens), _by_slots(q, k, v, tables, kv_lens)]
    used = torch.zeros(k.shape[0], dtype=torch.bool)
    for i, n in enumerate(lens):
        used[slots_from_tables(tables[i : i + 1], PS)[0, :n]] = True
    k[~used], v[~used] = float("nan"), float("nan")
    for got, expected in zip((_by_pages(q, k, v, tables, kv_lens), _by_slots(q, k, v, tables, kv_lens)), clean):
        assert bool(torch.isfinite(got).all())
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
