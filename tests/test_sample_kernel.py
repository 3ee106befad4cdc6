"""The temperature-only sampling kernel (what CUDA runs for such batches) against the torch
path: the same tokens for the same seeds and generation indices, except where the row's
target falls within the two paths' rounding gap of a boundary of its cumulative distribution (counted:
none on random data); greedy rows take the argmax; rows with no admissible token give
``ok = False`` and token 0. On the CPU through Triton's interpreter, in a process of its
own (the interpreter is chosen when kernels are defined); on CUDA directly, and through
the fused multi-step graphs."""

from __future__ import annotations

import random

import pytest
import torch

from omni_async import SamplingParams
from omni_async.runners import sampling
from omni_async.runners.sampling import SamplingBatch, kernel_sample, sample, temperature_only

from .test_multi_step import run, same
from .triton_interpreter import RANGE_SHIM, run_interpreted

# Shared by the interpreter's script and the CUDA test: compare the kernel with the torch
# path on one batch, return (rows compared, draws within the bound of a boundary).

COMPARE = r'''
import torch
from omni_async.kernels.sample import sample_temperature
from omni_async.runners import sampling
from omni_async.runners.sampling import SamplingBatch, row_uniforms, sample


def near_boundary(x, temp, seeds, idx, tokens):
    """Rows whose target lies closer to an edge of the torch path's chosen token's
    interval than four times the largest gap between the two paths' cumulative
    distributions: the torch path's (float32 probabilities, each rounded after dividing
    by the float32 sum) and the kernel's formula (float32 weights, float64 sums)."""
    x = x.float()
    m = torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    z = (m - m.max(-1, keepdim=True).values) / temp.clamp_min(1e-30)[:, None]
    cdf = z.softmax(-1).double().cumsum(-1)
    total = cdf[:, -1]
    weights = z.exp().double().cumsum(-1)
    gap = (cdf / total[:, None] - weights / weights[:, -1:]).abs().max(-1).values * total
    bound = 4 * gap + 1e-15 * total
    target = row_uniforms(seeds, idx) * total
    hi = cdf.gather(1, tokens[:, None])[:, 0]
    lo = torch.where(tokens > 0, cdf.gather(1, (tokens - 1).clamp_min(0)[:, None])[:, 0], 0.0)
    return ((target - lo).abs() < bound) | ((hi - target).abs() < bound)


def compare(x, temp, seeds, idx):
    b = x.shape[0]
    sampled = torch.nonzero(temp != 0).flatten()
    sb = SamplingBatch(temperature=temp, top_k=torch.zeros(b, dtype=torch.long, device=x.device),
                       top_p=torch.ones(b, device=x.device), min_p=torch.zeros(b, device=x.device), seeds=seeds,
                       sample_indices=idx, sampled_rows=sampled if 0 < len(sampled) < b else None,
                       num_sampled=len(sampled))
    kernel_on = sampling.SAMPLE_KERNEL
    sampling.SAMPLE_KERNEL = False  # the torch path, on any device
    try:
        ref = sample(x, sb)
    finally:
        sampling.SAMPLE_KERNEL = kernel_on
    tokens, ok = sample_temperature(x, temp, seeds, idx)
    assert tokens.dtype == torch.long and ok.dtype == torch.bool
    assert torch.equal(ok, ref.ok), (ok, ref.ok)
    near = near_boundary(x, temp, seeds, idx, ref.tokens) & ref.ok & (temp != 0)
    differ = tokens != ref.tokens
    assert not (differ & ~near).any(), (tokens[differ], ref.tokens[differ])
    return b, int(near.sum())


def trials(device, dtype, shapes):
    """Random batches: small vocabularies with special rows, and Qwen2's vocabulary."""
    g = torch.Generator(device=device).manual_seed(0)
    rows = near = 0
    for trial, (b, v) in enumerate(shapes):
        x = (torch.randn(b, v, generator=g, device=device) * (1 + 2 * trial % 5)).to(dtype)
        temp = torch.rand(b, generator=g, device=device) * 1.5 + 0.05
        temp[1::7] = 0  # greedy rows in the same launch
        if b > 8:
            x[0] = float("-inf")  # nothing admissible: ok False, token 0
            x[2, 3] = float("nan")  # NaN: ok False, token 0
            x[3, ::2] = float("-inf")  # half the vocabulary masked
            x[4, 5] = float("inf")  # a +inf logit: drawn (or taken) with certainty
            temp[5] = 1e-6  # a near point mass
        seeds = torch.randint(0, 2**62, (b,), generator=g, device=device)
        idx = torch.randint(0, 2**40, (b,), generator=g, device=device)
        n, k = compare(x, temp, seeds, idx)
        rows, near = rows + n, near + k
        if b > 8:
            got, ok = sample_temperature(x, temp, seeds, idx)
            assert not ok[0] and not ok[2] and got[0] == 0 and got[2] == 0 and ok[3] and got[4] == 5
    return rows, near
'''

SCRIPT = COMPARE + r'''
rows, near = trials("cpu", torch.float32, [(32, 300), (16, 5000), (32, 70), (2, 151936), (1, 151936)])
rows_bf16, near_bf16 = trials("cpu", torch.bfloat16, [(16, 300), (1, 151936)])
assert near == near_bf16 == 0, (near, near_bf16)
# Strided columns (the fused launch's settings) and greedy rows equal to argmax.
g = torch.Generator().manual_seed(1)
x = torch.randn(16, 1000, generator=g)
fp = torch.rand(16, 5, generator=g) + 0.2
fp[::2, 0] = 0
seeds = torch.randint(0, 2**62, (16, 3), generator=g)
idx = torch.arange(16) + 7
tokens, ok = sample_temperature(x, fp[:, 0], seeds[:, 2], idx)
want, _ = sample_temperature(x, fp[:, 0].contiguous(), seeds[:, 2].contiguous(), idx)
assert torch.equal(tokens, want) and ok.all()
assert torch.equal(tokens[::2], x[::2].argmax(-1))
# Each row's vocabulary split into parts (the small batches' parallelism): the same tokens
# however it is split, the last part shorter than the others or not.
x = torch.randn(4, 41000, generator=g) * 2
x[1, 40999] = 50.0  # the maximum in the last block of the last part
temp = torch.tensor([0.7, 0.0, 1.3, 0.2])
seeds, idx = torch.randint(0, 2**62, (4,), generator=g), torch.arange(4)
want = sample_temperature(x, temp, seeds, idx, parts=1)
for parts in (2, 3, 4, 11):
    got = sample_temperature(x, temp, seeds, idx, parts=parts)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), parts
assert want[0][1] == 40999 and want[1].all()
print("ok", rows + rows_bf16)
'''


@pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the compiled kernel's tests below run instead")
def test_kernel_tokens_equal_the_torch_path_in_the_interpreter():
    done = run_interpreted(RANGE_SHIM + SCRIPT, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().startswith("ok"), done.stderr[-3000:]


def _batch(b: int, temperature: list[float], **extra) -> SamplingBatch:
    fields = dict(temperature=torch.tensor(temperature), top_k=torch.zeros(b, dtype=torch.long), top_p=torch.ones(b),
                  min_p=torch.zeros(b), seeds=torch.arange(b), sample_indices=torch.zeros(b, dtype=torch.long),
                  num_sampled=sum(t != 0 for t in temperature))
    fields.update(extra)
    return SamplingBatch(**fields)


def test_only_temperature_only_batches_route_and_never_on_cpu():
    """The routing rule: some row samples, nothing but a temperature anywhere; the CPU
    keeps the torch path (the reference) whatever the batch."""
    assert temperature_only(_batch(2, [0.7, 0.0]))
    assert not temperature_only(_batch(2, [0.0, 0.0]))  # plain greedy: its own argmax
    assert not temperature_only(_batch(2, [0.7, 0.0]), top_k_logprobs=2)
    for extra in (dict(use_top_k=True), dict(use_top_p=True), dict(use_min_p=True), dict(want_logprobs=True),
                  dict(penalty=torch.ones(2)), dict(ban=torch.zeros(2, 5, dtype=torch.bool))):
        assert not temperature_only(_batch(2, [0.7, 0.0], **extra)), extra
    # A grammar's bitmask: the kernel reads it beside the logits (tests/test_grammar_bitmask_kernel.py).
    assert temperature_only(_batch(2, [0.7, 0.0], allowed=torch.zeros(2, 1, dtype=torch.int32)))
    assert kernel_sample(torch.randn(2, 5), _batch(2, [0.7, 0.0], allowed=torch.full((2, 1), -1, dtype=torch.int32))) is None
    assert kernel_sample(torch.randn(2, 5), _batch(2, [0.7, 0.0])) is None


def test_the_draw_never_reaches_past_the_vocabulary():
    """Why the torch path needs no argmax fallback: the largest uniform is 1 - 2**-33, so
    the target stays below the last cumulative value even for a point mass."""
    sb = _batch(1, [1e-30], seeds=torch.tensor([12345]))
    for last in range(3):
        x = torch.full((1, 3), -50.0)
        x[0, last] = 0.0
        assert sample(x, sb).tokens.tolist() == [last]


needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and __import__("importlib").util.find_spec("triton")), reason="needs CUDA and Triton")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_tokens_equal_the_torch_path(dtype):
    ns: dict = {}
    exec(COMPARE, ns)
    rows, near = ns["trials"]("cuda", dtype, [(64, 300), (64, 5000), (64, 70), (256, 151936), (3, 151936), (1, 151936)])
    assert rows > 0 and near == 0
    # NV256's shape: 256 rows at Qwen2's vocabulary.
    g = torch.Generator(device="cuda").manual_seed(2)
    x = (torch.randn(256, 151936, generator=g, device="cuda") * 3).to(dtype)
    temp = torch.full((256,), 0.6, device="cuda")
    temp[::5] = 0
    seeds = torch.randint(0, 2**62, (256,), generator=g, device="cuda")
    _, near = ns["compare"](x, temp, seeds, torch.arange(256, device="cuda") * 31 + 5)
    assert near == 0


@needs_cuda
@pytest.mark.parametrize("loop", ["overlap", "async_decode", "normal"])
async def test_cuda_fused_graphs_sample_with_the_kernel(loop):
    """The fused multi-step decode's graphs (temperature-only rows, greedy rows beside
    them) sample through the kernel, and their tokens equal those of the torch path in
    the same graphs and forward by forward."""
    from omni_async.kernels import sample as kernel

    rng = random.Random(7)
    reqs = [([rng.randrange(3, 250) for _ in range(rng.randint(4, 40))],
             SamplingParams(max_new_tokens=rng.randint(8, 40), temperature=0.0 if i % 5 == 0 else 0.6, seed=i,
                            ignore_eos=True)) for i in range(48)]
    limits = dict(device="cuda", dtype="float32", max_running_requests=64, kv_capacity_tokens=32768, loop=loop,
                  decode_steps=4)
    sampling.SAMPLE_KERNEL = False
    try:
        torch_path, _, info_torch = await run(reqs, **limits)
    finally:
        sampling.SAMPLE_KERNEL = True
    before = kernel.captured
    fused, _, info = await run(reqs, **limits)
    unfused, _, _ = await run(reqs, fuse_decode_steps=False, **limits)
    assert kernel.captured > before  # captured into the fused graphs (the decode graphs only take argmax)
    assert info["fused_decode_replays"] > 0 and info["fused_decode_sampled"] > 0
    assert same(fused, torch_path) and same(unfused, fused)
