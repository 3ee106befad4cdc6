"""The fused CUDA kernels against the torch reference ops on random inputs (bf16
tolerance), and greedy tokens on CUDA in float32 with fusion equal to the CPU reference.
Skipped without CUDA and Triton; run on the GPU machine."""

from __future__ import annotations

import asyncio

import pytest
import torch

from omni_async import Engine, SamplingParams
from omni_async.kernels import triton_available
from omni_async.kv.cache import PagedKVCache
from omni_async.kernels.reference import ReferenceOps
from omni_async.models.decoder import RMSNorm

pytestmark = pytest.mark.skipif(not triton_available("cuda"), reason="needs CUDA and Triton")

DEV = "cuda"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def tol(dtype: torch.dtype) -> float:
    return 1e-2 if dtype == torch.bfloat16 else 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,hidden", [(1, 896), (37, 896), (300, 128), (5, 1000)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_reference(dtype, rows, hidden, with_delta):
    from omni_async.kernels.fused import FusedOps

    gen = torch.Generator(device=DEV).manual_seed(rows * hidden)
    norm = RMSNorm(hidden, 1e-6).to(DEV, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen, device=DEV))
    x = torch.randn(rows, hidden, generator=gen, device=DEV).to(dtype)
    delta = torch.randn(rows, hidden, generator=gen, device=DEV).to(dtype) if with_delta else None
    ref_sum, ref_y = ReferenceOps().add_norm(x, delta, norm)
    got_sum, got_y = FusedOps().add_norm(x, delta, norm)
    assert rel_err(got_sum, ref_sum) <= tol(dtype) / 10
    assert rel_err(got_y, ref_y) <= tol(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,inter", [(1, 4864), (64, 4864), (7, 100)])
def test_silu_mul_matches_reference(dtype, rows, inter):
    from omni_async.kernels.fused import FusedOps

    gen = torch.Generator(device=DEV).manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen, device=DEV) * 3).to(dtype)
    assert rel_err(FusedOps().silu_mul(gate_up), ReferenceOps().silu_mul(gate_up)) <= tol(dtype)


def test_direct_launches_follow_the_specialisation():
    """Launches that skip Triton's own path reuse a compiled kernel only for calls of the
    same specialisation: alternating aligned and unaligned pointers, a column count of 1,
    of a multiple of 16 and neither, each result equals the reference, and most launches
    went direct."""
    from omni_async.kernels.fused import _SILU_MUL_LAUNCH, silu_mul

    gen = torch.Generator(device=DEV).manual_seed(3)
    before = _SILU_MUL_LAUNCH.direct_launches
    for _ in range(3):
        for rows, inter, offset in [(4, 64, 0), (4, 64, 1), (1, 1, 0), (3, 37, 0), (3, 37, 3), (5, 16, 0)]:
            flat = torch.randn(rows * 2 * inter + offset, generator=gen, device=DEV)
            gate_up = flat[offset:].view(rows, 2 * inter)  # offset 1 or 3: 4 or 12 bytes off 16-byte alignment
            assert rel_err(silu_mul(gate_up), ReferenceOps().silu_mul(gate_up)) <= tol(torch.float32)
    assert _SILU_MUL_LAUNCH.direct_launches - before >= 12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 14, 2, 64), (50, 14, 2, 64), (9, 8, 8, 128), (3, 4, 2, 32), (64, 16, 8, 128)])
@pytest.mark.parametrize("with_norm", [False, True])
def test_rope_store_matches_reference(dtype, tokens, heads, kv_heads, dim, with_norm):
    """With ``with_norm``, Qwen3's per-head q/k RMSNorm in the same kernel."""
    from omni_async.kernels.fused import FusedOps

    gen = torch.Generator(device=DEV).manual_seed(tokens * heads + dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen, device=DEV).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    angles = torch.rand(tokens, dim // 2, generator=gen, device=DEV) * 100
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    slots = torch.randperm(64, generator=gen, device=DEV)[:tokens]
    norms = (None, None)
    if with_norm:
        norms = tuple(RMSNorm(dim, 1e-6).to(DEV, dtype) for _ in range(2))
        with torch.no_grad():
            for n in norms:
                n.weight.copy_(torch.randn(dim, generator=gen, device=DEV) * 0.5 + 1)
    caches = []
    for _ in range(2):
        kv = PagedKVCache(num_layers=2, num_pages=4, page_size=16, num_kv_heads=kv_heads, head_dim=dim, dtype=dtype, device=torch.device(DEV))
        for t in kv.k + kv.v:
            t.fill_(float("nan"))  # poisoned: slots not written stay NaN in both
        caches.append(kv)
    with torch.no_grad():
        ref_q, ref_k = ReferenceOps().rope_store(q, k, v, cos, sin, caches[0], 1, slots, *norms)
        got_q, _ = FusedOps().rope_store(q, k, v, cos, sin, caches[1], 1, slots, *norms)
    assert rel_err(got_q, ref_q) <= tol(dtype)
    assert rel_err(caches[1].k[1][slots], ref_k) <= tol(dtype)
    assert torch.equal(caches[1].v[1][slots], v)
    untouched = torch.ones(64, dtype=torch.bool, device=DEV)
    untouched[slots] = False
    assert caches[1].k[1][untouched].isnan().all() and caches[1].k[0].isnan().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim,theta", [(64, 1e6), (128, 5e5)])
def test_rope_table_matches_reference(dtype, dim, theta):
    """The rotary tables in one kernel: CUDA's cosf and sinf on the reference's float32
    angles, rounded once."""
    from omni_async.kernels.fused import FusedOps
    from omni_async.models.config import ModelConfig
    from omni_async.models.decoder import rope_inv_freq

    cfg = ModelConfig(family="llama", vocab_size=10, hidden_size=2 * dim, intermediate_size=8, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=dim, rope_theta=theta)
    inv = rope_inv_freq(cfg).to(DEV)
    gen = torch.Generator(device=DEV).manual_seed(dim)
    pos = torch.randint(0, 40000, (300,), generator=gen, device=DEV)
    for got, want in zip(FusedOps().rope_table(pos, inv, dtype), ReferenceOps().rope_table(pos, inv, dtype)):
        err = float((got.double() - want.double()).abs().max())
        assert err <= (1.2e-7 if dtype == torch.float32 else 2.0 ** -8)
        assert float((got == want).double().mean()) >= 0.999


def _greedy_tokens(device: str, prompts, n: int, **kw) -> list[list[int]]:
    async def run():
        engine = Engine.from_pretrained("tiny", device=device, dtype="float32", kv_capacity_tokens=8192, **kw)
        async with engine:
            res = await asyncio.gather(
                *[engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=n, ignore_eos=True)) for p in prompts]
            )
            runner = engine.stack.runner
            seen = (runner.fused, runner.graphs)  # closing releases the graphs
        return [r.output_ids for r in res], seen

    return asyncio.run(run())


@pytest.mark.parametrize("loop", ["normal", "overlap", "async_decode"])
def test_fused_float32_greedy_equals_cpu_reference(loop):
    prompts = [[256, *b"hello there"], list(range(40, 140)), [256, *b"fused kernels"] * 7]
    cpu, _ = _greedy_tokens("cpu", prompts, 24, loop=loop)
    fused, (was_fused, graphs) = _greedy_tokens(DEV, prompts, 24, loop=loop, fused_kernels=True)
    assert was_fused and graphs is not None
    assert graphs.replays > 0
    plain, _ = _greedy_tokens(DEV, prompts, 24, loop=loop, fused_kernels=False)
    assert fused == cpu == plain


@pytest.mark.parametrize("filters", [(False, False, False), (True, False, False), (True, True, True), (False, True, False), (False, False, True)])
@pytest.mark.parametrize("bs", [1, 3, 8])
def test_graph_sampling_equals_eager_sampling(filters, bs):
    """Random logits and per-row settings (some rows greedy, some with a filter off):
    the replayed sampling graph picks exactly the tokens of ``sample``."""
    from omni_async.runners.graph_sampling import SamplingGraphs
    from omni_async.runners.sampling import SamplingBatch, sample

    vocab, buckets = 5000, (1, 2, 4, 8)
    gen = torch.Generator(device=DEV).manual_seed(bs * 31 + sum(filters))
    static = {b: torch.empty(b, vocab, device=DEV) for b in buckets}
    graphs = SamplingGraphs(
        static.__getitem__, lambda n: next(b for b in buckets if b >= n), max_batch=8, device=torch.device(DEV)
    )
    use_top_k, use_top_p, use_min_p = filters
    for step in range(3):
        logits = torch.randn(bs, vocab, generator=gen, device=DEV) * 3
        logits[0, 7] = float("-inf")
        b = graphs.bucket_for(bs)
        static[b].normal_(generator=gen)  # rows past the batch hold garbage
        static[b][:bs] = logits
        temperature = torch.rand(bs, generator=gen, device=DEV) + 0.3
        temperature[torch.rand(bs, generator=gen, device=DEV) < 0.3] = 0  # greedy rows
        sampled = torch.nonzero(temperature > 0).flatten()
        sb = SamplingBatch(
            temperature=temperature,
            top_k=torch.randint(0, 40, (bs,), generator=gen, device=DEV) if use_top_k else torch.zeros(bs, dtype=torch.long, device=DEV),
            top_p=torch.rand(bs, generator=gen, device=DEV) * 0.5 + 0.5 if use_top_p else torch.ones(bs, device=DEV),
            min_p=torch.rand(bs, generator=gen, device=DEV) * 0.2 if use_min_p else torch.zeros(bs, device=DEV),
            seeds=torch.randint(0, 1 << 62, (bs,), generator=gen, device=DEV),
            sample_indices=torch.full((bs,), step, dtype=torch.long, device=DEV),
            sampled_rows=sampled if 0 < len(sampled) < bs else None,
            num_sampled=len(sampled),
            use_top_k=use_top_k, use_top_p=use_top_p, use_min_p=use_min_p,
        )
        if not sb.num_sampled:
            continue
        want = sample(logits, sb)
        assert graphs.eligible(sb, 0)
        tokens, ok = graphs.sample(sb)
        assert torch.equal(tokens, want.tokens) and torch.equal(ok, want.ok)
    assert graphs.replays > 0


def test_fused_sampled_tokens_equal_unfused_on_cuda():
    prompts = [[256, *b"sampling in the graph"], list(range(60, 90)), [256, *b"top-p"] * 5]
    params = [
        SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.8, seed=1, ignore_eos=True),
        SamplingParams(max_new_tokens=20, temperature=1.2, top_k=20, min_p=0.05, seed=2, ignore_eos=True),
        SamplingParams(max_new_tokens=20, ignore_eos=True),
    ]

    async def run(fused: bool):
        engine = Engine.from_pretrained("tiny", device=DEV, dtype="float32", kv_capacity_tokens=8192, fused_kernels=fused)
        async with engine:
            res = await asyncio.gather(*[engine.generate(input_ids=p, sampling=s) for p, s in zip(prompts, params)])
            sampling_graphs = engine.stack.runner.sampling_graphs  # closing releases them
        return [r.output_ids for r in res], sampling_graphs

    fused, sampling_graphs = asyncio.run(run(True))
    plain, _ = asyncio.run(run(False))
    assert sampling_graphs is not None and sampling_graphs.replays > 0
    assert fused == plain


@pytest.mark.parametrize("loop", ["normal", "overlap", "async_decode"])
def test_short_prefills_replayed_as_decode_rows_give_the_cpu_tokens(loop):
    """Prompts short enough for a decode graph (runners/prefill_rows.py), one at a time and
    several in one prefill step, a prompt whose prefix is cached the second time: greedy
    tokens equal the CPU reference's, and the prefills did replay graphs."""
    prompts = [[256, *b"short"], list(range(40, 70)), [256, *b"short"] + [7, 8, 9]]
    cpu, _ = _greedy_tokens("cpu", prompts, 16, loop=loop)
    gpu, (_, graphs) = _greedy_tokens(DEV, prompts, 16, loop=loop)
    assert graphs is not None and graphs.prefill_replays > 0
    assert gpu == cpu
