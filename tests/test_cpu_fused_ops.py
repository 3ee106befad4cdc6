"""The opt-in fused CPU elementwise kernels (``cpu_fused_ops=True``): each must give what
the torch reference ops give (float32: float noise, the rotary and the residual sum
bit for bit; bfloat16: within its rounding), on decode-sized and prefill-sized (threaded)
row counts; an engine using them gives the reference path's greedy tokens in every loop.
Skipped where no C++ compiler or ninja is found (the kernels are built on first use)."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch

from omni_async import Engine, SamplingParams, errors
from omni_async.kv.attention import AttentionContext, paged_attention
from omni_async.kernels.reference import ReferenceOps
from omni_async.models.decoder import RMSNorm

from .conftest import LOOPS, assert_kv_free


def _can_build() -> bool:
    from torch.utils.cpp_extension import is_ninja_available

    return shutil.which("c++") is not None and is_ninja_available()


pytestmark = pytest.mark.skipif(not _can_build(), reason="needs a C++ compiler and ninja to build the kernels")

# Row counts: one sequence, a decode batch, and a prefill large enough for the threaded path.
ROWS = [1, 64, 700]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def fused():
    from omni_async.kernels.cpu_fused import CpuFusedOps, load

    load()
    return CpuFusedOps()


class _Cache:
    """The two methods of PagedKVCache the ops use, over small caches."""

    def __init__(self, slots: int, kv_heads: int, dim: int, dtype: torch.dtype) -> None:
        self.k = [torch.zeros(slots, kv_heads, dim, dtype=dtype)]
        self.v = [torch.zeros(slots, kv_heads, dim, dtype=dtype)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == ref.dtype == dtype and got.shape == ref.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("eps", [1e-6, 0.25])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_the_reference(fused, dtype, rows, eps, with_delta):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 0.5).to(dtype)
    delta = (torch.randn(rows, 576, generator=gen) * 0.5).to(dtype) if with_delta else None
    norm = RMSNorm(576, eps).to(dtype)
    norm.weight.data = torch.randn(576, generator=gen).to(dtype)
    ref_sum, ref_out = ReferenceOps().add_norm(x, delta, norm)
    got_sum, got_out = fused.add_norm(x, delta, norm)
    assert torch.equal(got_sum, ref_sum)
    _close(got_out, ref_out, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_matches_the_reference(fused, dtype, rows):
    gen = torch.Generator().manual_seed(rows + 1)
    gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-120.0, -88.0, 88.0, 120.0])  # where exp under- and overflows
    ref = ReferenceOps().silu_mul(gate_up)
    got = fused.silu_mul(gate_up)
    assert torch.isfinite(got).all()
    _close(got, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
def test_rope_store_matches_the_reference(fused, dtype, rows, heads, kv_heads):
    gen = torch.Generator().manual_seed(rows + heads)
    d, num_slots = 64, 2048
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)  # strided views, as the model has
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = q.view(rows, heads, d), k.view(rows, kv_heads, d), v.view(rows, kv_heads, d)
    cos, sin = torch.randn(rows, d, generator=gen).to(dtype), torch.randn(rows, d, generator=gen).to(dtype)
    slots = torch.randperm(num_slots, generator=gen)[:rows]
    ref_kv, got_kv = _Cache(num_slots, kv_heads, d, dtype), _Cache(num_slots, kv_heads, d, dtype)
    ref_q, ref_k = ReferenceOps().rope_store(q, k, v, cos, sin, ref_kv, 0, slots)
    got_q, got_k = fused.rope_store(q, k, v, cos, sin, got_kv, 0, slots)
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)
    assert torch.equal(got_kv.k[0], ref_kv.k[0]) and torch.equal(got_kv.v[0], ref_kv.v[0])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_extend_attention_matches_the_reference(dtype, tol, heads, kv_heads):
    """An extend step's attention in one call over the cache (new sequences and one with
    a cached prefix) gives what the per-sequence SDPA loop gives."""
    gen = torch.Generator().manual_seed(heads + kv_heads)
    d, page = 64, 16
    lens, prefixes = [1, 37, 5, 64, 20, 1], [0, 0, 7, 0, 0, 30]
    total = sum(lens)
    q = torch.randn(total, heads, d, generator=gen).to(dtype)
    kv_new = torch.randn(total, 2 * kv_heads, d, generator=gen).to(dtype)
    k_new, v_new = kv_new[:, :kv_heads], kv_new[:, kv_heads:]  # strided, as the model's v is
    k_cache = torch.randn(64 * page, kv_heads, d, generator=gen).to(dtype)
    v_cache = torch.randn(64 * page, kv_heads, d, generator=gen).to(dtype)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    order, slot_lists, next_slot = torch.randperm(64 * page, generator=gen), [], 0  # scattered slots, as pages are
    for start, n, prefix in zip(starts, lens, prefixes):
        slots = order[next_slot : next_slot + prefix + n]
        k_cache[slots[prefix:]], v_cache[slots[prefix:]] = k_new[start : start + n], v_new[start : start + n]
        slot_lists.append(slots)
        next_slot += prefix + n

    def attend(cpu_prefill: bool) -> torch.Tensor:
        ctx = AttentionContext(is_decode=False, slot_mapping=torch.zeros(total, dtype=torch.long), logits_rows=torch.zeros(1))
        ctx.seq_slices, ctx.seq_kv_slots, ctx.cpu_prefill = list(zip(starts, lens, prefixes)), slot_lists, cpu_prefill
        return paged_attention(q, k_cache, v_cache, ctx, d**-0.5, k_new=k_new, v_new=v_new)

    ref, got = attend(False), attend(True)
    assert got.dtype == dtype and got.shape == ref.shape
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


def test_engine_tokens_agree_across_loops_and_with_the_reference():
    """Also through the extend kernel's prefix cases: a prompt over the chunked-prefill
    size, and a second round whose prompts extend the first's (prefix cache hits)."""
    prompts = [[5, 6, 7], list(range(3, 60)), [9] * 20, list(range(100, 140)), [3 + i % 200 for i in range(600)]]
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)

    async def tokens(**kw):
        engine = Engine.from_pretrained("tiny", **kw)
        async with engine:
            assert engine.stack.runner.model.ops.name == ("cpu_fused" if kw.get("cpu_fused_ops") else "reference")
            out = await asyncio.gather(*(engine.generate(input_ids=p, sampling=sp) for p in prompts))
            again = await asyncio.gather(*(engine.generate(input_ids=p + r.output_ids, sampling=sp) for p, r in zip(prompts, out)))
            cached = sum(r.cached_tokens or 0 for r in again)
            fused = engine.scheduler.info()["fused_decode_launches"]
        assert_kv_free(engine)
        return [r.output_ids for r in out + again], cached, fused

    async def all_runs():
        ref = await tokens()
        runs = [await tokens(loop=loop, cpu_fused_ops=True) for loop in LOOPS]
        runs.append(await tokens(cpu_fused_ops=True, cpu_attention_kernel=True))
        # four forwards per step, run as one fused launch through both kernels
        multi = await tokens(cpu_fused_ops=True, cpu_attention_kernel=True, decode_steps=4, loop="async_decode")
        return ref, runs, multi

    (ref, cached, _), runs, multi = asyncio.run(all_runs())
    assert cached > 0
    assert all(r == ref for r, _, _ in runs)
    assert multi[0] == ref and multi[2] > 0


def test_refused_with_tensor_parallelism():
    with pytest.raises(errors.ConfigError, match="cpu_fused_ops"):
        Engine.from_pretrained("tiny", cpu_fused_ops=True, tensor_parallel_size=2)
