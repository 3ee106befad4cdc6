"""Sampling inside the fused multi-step launch: seeded tokens equal those of the same
steps run forward by forward (``fuse_decode_steps=False``), row by row, in every loop,
for every sampling setting the launch serves, mixed in one batch, with rows finishing
mid-chunk; a row the launch cannot serve (logprobs) runs beside it without changing the
fused rows' tokens."""

from __future__ import annotations

import dataclasses

import random

import pytest
import torch

from omni_async import SamplingParams
from omni_async.runners.fused_sampling import sample_all_rows
from omni_async.runners.sampling import SamplingBatch, sample

from .conftest import LOOPS
from .test_multi_step import run, same


def sampled_mix(seed: int, n: int) -> list[tuple[list[int], SamplingParams]]:
    """Every setting the fused launch samples with, one per row in turn, seeded, with
    lengths that end mid-chunk and stop ids."""
    rng = random.Random(seed)
    kinds = [
        dict(temperature=0.9),
        dict(temperature=0.7, top_k=20),
        dict(temperature=1.1, top_p=0.8),
        dict(temperature=0.8, min_p=0.1),
        dict(temperature=0.9, repetition_penalty=1.4),
        dict(temperature=0.6, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
        dict(),  # greedy beside sampled rows
        dict(repetition_penalty=1.3),  # greedy, penalised
        dict(repetition_penalty=50.0),  # greedy: no token twice (a repeat within a chunk shows a stale record)
        dict(temperature=0.3, repetition_penalty=50.0),
        dict(temperature=0.9, suppress_tokens=[rng.randrange(3, 250) for _ in range(30)]),
        dict(temperature=0.9, min_new_tokens=6),  # its stop ids banned for the first tokens
    ]
    out = []
    for i in range(n):
        sp = SamplingParams(max_new_tokens=rng.randint(5, 27), seed=1000 + i,
                            stop_token_ids=[rng.randrange(3, 250) for _ in range(3)], **kinds[i % len(kinds)])
        out.append(([rng.randrange(3, 250) for _ in range(rng.randint(3, 25))], sp))
    return out


@pytest.mark.parametrize("loop", LOOPS)
async def test_fused_sampled_tokens_equal_forward_by_forward(loop):
    reqs = sampled_mix(1, 12)
    limits = dict(loop=loop, max_running_requests=12, decode_steps=4)
    unfused, _, info_unfused = await run(reqs, fuse_decode_steps=False, **limits)
    fused, _, info = await run(reqs, **limits)
    assert same(fused, unfused)
    assert {o[1] for o in unfused} >= {"stop", "length"}
    assert any(len(o[0]) % 4 for o in unfused)  # rows end mid-chunk
    assert info_unfused["fused_decode_launches"] == 0
    assert info["fused_decode_sampled"] > 0 and info["fused_decode_sampled"] == info["fused_decode_launches"]


async def test_a_logprob_row_runs_beside_the_fused_rows():
    """The logprob row's tokens and logprobs equal forward by forward's, and the other
    rows' tokens equal those they get when no row asks for logprobs (all fused)."""
    reqs = sampled_mix(2, 6)
    with_lp = [(p, dataclasses.replace(sp, return_logprob=i == 0, max_new_tokens=30 if i == 0 else sp.max_new_tokens))
               for i, (p, sp) in enumerate(reqs)]
    without_lp = [(p, dataclasses.replace(sp, return_logprob=False)) for p, sp in with_lp]
    limits = dict(max_running_requests=6, decode_steps=4)
    unfused, _, _ = await run(with_lp, fuse_decode_steps=False, **limits)
    split, _, info = await run(with_lp, **limits)
    alone, _, info_alone = await run(without_lp, **limits)
    assert same(split, unfused)
    assert split[0][2] is not None and len(split[0][2]) == len(split[0][0])
    assert [o[:2] for o in split[1:]] == [o[:2] for o in alone[1:]]
    assert info["fused_decode_launches"] > 0 and info["fused_decode_sampled"] > 0
    assert info_alone["fused_decode_launches"] > info["fused_decode_launches"]  # the logprob row alone ran unfused


def test_every_row_through_the_fixed_shape_sampler_equals_sample():
    """The fused launch's sampler (every row through every filter in use) against
    ``sample`` (only the sampled rows through the filters), on random logits."""
    gen = torch.Generator().manual_seed(0)
    b, v = 64, 300
    for trial in range(6):
        logits = torch.randn(b, v, generator=gen) * 4
        logits[3] = float("-inf")  # a row with no admissible token
        temperature = torch.where(torch.rand(b, generator=gen) < 0.3, 0.0, torch.rand(b, generator=gen) + 0.3)
        top_k = torch.where(torch.rand(b, generator=gen) < 0.5, 0, torch.randint(1, v + 20, (b,), generator=gen))
        top_p = torch.where(torch.rand(b, generator=gen) < 0.5, 1.0, torch.rand(b, generator=gen))
        min_p = torch.where(torch.rand(b, generator=gen) < 0.5, 0.0, torch.rand(b, generator=gen) * 0.3)
        penalty = torch.where(torch.rand(b, generator=gen) < 0.5, 1.0, torch.rand(b, generator=gen) + 1)
        seen = torch.rand(b, v, generator=gen) < 0.05
        ban = torch.rand(b, v, generator=gen) < 0.02
        sampled = torch.nonzero(temperature != 0).flatten()
        filters = trial % 2 == 0  # odd trials: top-k / top-p / min-p off in every row, and so skipped by ``sample``
        if not filters:
            top_k, top_p, min_p = torch.zeros_like(top_k), torch.ones_like(top_p), torch.zeros_like(min_p)
        common = dict(temperature=temperature.float(), top_k=top_k, top_p=top_p.float(), min_p=min_p.float(),
                      seeds=torch.randint(0, 2**62, (b,), generator=gen), sample_indices=torch.arange(b) + trial,
                      penalty=penalty.float(), seen=seen, ban=ban)
        ref = sample(logits, SamplingBatch(**common, sampled_rows=sampled, num_sampled=len(sampled),
                                           use_top_k=filters, use_top_p=filters, use_min_p=filters))
        sb = SamplingBatch(**common, num_sampled=b, use_top_k=True, use_top_p=True, use_min_p=True)
        tokens, ok = sample_all_rows(logits, sb)
        assert torch.equal(ok, ref.ok) and not ok[3]
        assert torch.equal(tokens, ref.tokens), trial


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("loop", LOOPS)
async def test_cuda_fused_sampling_graphs_equal_forward_by_forward(loop):
    """On CUDA (float32) the fused launch replays a graph per (bucket, k, sampling mode):
    every mode of the mix, a logprob row split off beside them, tokens equal forward by
    forward's; the modes other than greedy and temperature-only are captured on first use."""
    reqs = sampled_mix(3, 14)
    reqs[1] = (reqs[1][0], dataclasses.replace(reqs[1][1], return_logprob=True))
    limits = dict(loop=loop, device="cuda", dtype="float32", max_running_requests=16, page_size=8,
                  kv_capacity_tokens=8192, decode_steps=4)
    unfused, _, _ = await run(reqs, fuse_decode_steps=False, **limits)
    fused, _, info = await run(reqs, **limits)
    assert same(fused, unfused)
    assert info["fused_decode_replays"] > 0 and info["fused_decode_sampled"] > 0
    assert info["fused_decode_late_captures"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_temperature_steps_replay_the_graphs_captured_at_start():
    """NV256's kind of step (temperature only, seeded, 96 rows, the automatic k): every
    multi-step decode replays a fused graph captured at start-up; tokens equal forward by
    forward's."""
    rng = random.Random(5)
    reqs = [([rng.randrange(3, 250) for _ in range(rng.randint(4, 40))],
             SamplingParams(max_new_tokens=rng.randint(8, 40), temperature=0.6, seed=i, ignore_eos=True)) for i in range(96)]
    limits = dict(device="cuda", dtype="float32", max_running_requests=128, kv_capacity_tokens=32768, loop="overlap")
    unfused, _, _ = await run(reqs, fuse_decode_steps=False, **limits)
    fused, _, info = await run(reqs, **limits)
    assert same(fused, unfused)
    assert info["fused_decode_sampled"] == info["fused_decode_launches"] == info["fused_decode_replays"] > 0
    assert info["fused_decode_late_captures"] == 0
