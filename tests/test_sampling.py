"""Sampling semantics: filters against transformers' processors (chi-square), seeds
reproducible across batch compositions, loops and retraction, repetition penalty and
suppression against a step-by-step transformers reference, logprobs against float64."""

from __future__ import annotations

import dataclasses

import asyncio
import math

import pytest
import torch

from omni_async import Engine, SamplingParams, errors
from omni_async.runners.sampling import RowSampling, sample_rows

from .conftest import LOOPS, _hf_model, assert_kv_free


def chi2_critical(df: int, z: float = 3.72) -> float:
    """Upper quantile of chi-square by Wilson-Hilferty; z=3.72 is about p=1e-4."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def hf_filtered_probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    x = logits[None].clone()
    x = TemperatureLogitsWarper(sp.temperature)(None, x)
    if sp.top_k:
        x = TopKLogitsWarper(sp.top_k)(None, x)
    if sp.top_p < 1:
        x = TopPLogitsWarper(sp.top_p)(None, x)
    if sp.min_p:
        x = MinPLogitsWarper(sp.min_p)(None, x)
    return x.softmax(-1)[0]


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=1.0, min_p=0.08),
        SamplingParams(temperature=0.9, top_k=8, top_p=0.8, min_p=0.02),
    ],
    ids=["plain", "top_k", "top_p", "min_p", "all"],
)
def test_filters_match_transformers_distribution(sp):
    torch.manual_seed(0)
    vocab = 24
    logits = torch.randn(vocab) * 1.5
    expected = hf_filtered_probs(logits, sp)
    allowed = expected > 0
    draws = 6000
    counts = torch.zeros(vocab)
    batch = 200
    for start in range(0, draws, batch):
        rows = [RowSampling(params=sp, request_id="r", sample_index=start + j, output_ids=[], stop_ids=[]) for j in range(batch)]
        tokens, _ = sample_rows(logits.repeat(batch, 1), rows, want_logprobs=False)
        counts += torch.bincount(tokens, minlength=vocab).float()
    assert counts[~allowed].sum() == 0, "sampled a token the filters exclude"
    exp = expected[allowed] * draws
    stat = float(((counts[allowed] - exp) ** 2 / exp).sum())
    df = int(allowed.sum()) - 1
    if df > 0:
        assert stat < chi2_critical(df), f"chi-square {stat:.1f} over df={df}"


def test_seed_outside_range_is_masked_and_reproducible():
    a = SamplingParams(temperature=1.0, seed=-5)
    b = SamplingParams(temperature=1.0, seed=(1 << 63) - 5)
    assert a.resolved_seed is not None and 0 <= a.resolved_seed < (1 << 63)
    assert a.resolved_seed == b.resolved_seed
    logits = torch.randn(3, 50)
    rows = [RowSampling(a, "x", i, [], []) for i in range(3)]
    t1, _ = sample_rows(logits.clone(), rows, False)
    t2, _ = sample_rows(logits.clone(), rows, False)
    assert torch.equal(t1, t2)


SEEDED = SamplingParams(max_new_tokens=24, temperature=1.5, top_p=0.9, seed=1234, ignore_eos=True)


async def _seeded_run(loop: str, companions: int, **limits) -> list[int]:
    engine = Engine.from_pretrained("tiny", loop=loop, **limits)
    async with engine:
        others = [
            engine.generate(input_ids=[40 + i] * (10 + 7 * i), sampling=SamplingParams(max_new_tokens=20 + i, temperature=0.8, ignore_eos=True))
            for i in range(companions)
        ]
        target = engine.generate(input_ids=[3, 1, 4, 1, 5, 9, 2, 6], sampling=SEEDED, request_id="target")
        res = await asyncio.gather(target, *others)
    assert_kv_free(engine)
    return res[0].output_ids


async def test_seeded_tokens_independent_of_batch_loop_and_retraction():
    solo = await _seeded_run("normal", 0)
    assert len(set(solo)) > 3, "sampling should vary"
    for loop in LOOPS:
        assert await _seeded_run(loop, 6) == solo, loop
        squeezed = await _seeded_run(loop, 6, page_size=8, kv_capacity_tokens=8 * 14)
        assert squeezed == solo, f"{loop} under retraction"


def _reference_with_penalty(folder, prompt, n, penalty, suppress, min_new=0, stop=()):
    """Step-by-step greedy over transformers' forward, penalising output tokens only."""
    model = _hf_model(folder)
    seq = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for step in range(n):
            logits = model(torch.tensor([seq])).logits[0, -1].to(torch.float32)
            for t in set(out):
                logits[t] = logits[t] / penalty if logits[t] > 0 else logits[t] * penalty
            for t in suppress:
                logits[t] = float("-inf")
            if step < min_new:
                for t in stop:
                    logits[t] = float("-inf")
            tok = int(torch.argmax(logits))
            out.append(tok)
            seq.append(tok)
            if tok in stop and step >= min_new:
                break
    return out


@pytest.mark.parametrize("loop", LOOPS)
async def test_repetition_penalty_and_suppression_match_reference(hf_checkpoints, loop):
    folder = hf_checkpoints["llama"]
    prompts = [[5, 6, 7, 8], [100, 200, 300], [11] * 30]
    sps = [
        SamplingParams(max_new_tokens=20, repetition_penalty=1.8),
        SamplingParams(max_new_tokens=20, repetition_penalty=0.7, suppress_tokens=[3, 4, 5]),
        SamplingParams(max_new_tokens=20, repetition_penalty=1.3, suppress_tokens=list(range(100, 200))),
    ]
    expected = [
        _reference_with_penalty(folder, p, 20, sp.repetition_penalty, sp.suppress_tokens) for p, sp in zip(prompts, sps)
    ]
    engine = Engine.from_pretrained(str(folder), loop=loop)
    async with engine:
        res = await asyncio.gather(*[engine.generate(input_ids=p, sampling=sp) for p, sp in zip(prompts, sps)])
    for r, exp, sp in zip(res, expected, sps):
        assert r.output_ids == exp
        assert not set(r.output_ids) & set(sp.suppress_tokens)


async def test_min_new_tokens_and_stop_ids(hf_checkpoints):
    folder = hf_checkpoints["llama"]
    prompt = [9, 8, 7]
    free_run = _reference_with_penalty(folder, prompt, 12, 1.0, [])
    stop = free_run[2]  # the third greedy token
    engine = Engine.from_pretrained(str(folder))
    async with engine:
        early = await engine.generate(input_ids=prompt, sampling=SamplingParams(max_new_tokens=12, stop_token_ids=[stop]))
        held = await engine.generate(
            input_ids=prompt, sampling=SamplingParams(max_new_tokens=12, stop_token_ids=[stop], min_new_tokens=6)
        )
    assert early.output_ids == free_run[: free_run.index(stop) + 1]
    assert early.finish_reason == "stop"
    expected_held = _reference_with_penalty(folder, prompt, 12, 1.0, [], min_new=6, stop=[stop])
    assert held.output_ids == expected_held
    assert len(held.output_ids) > 6 or held.finish_reason == "length"


async def test_eos_finishes_unless_ignored(tiny_engine):
    from omni_async.text.tokenizer import ByteTokenizer

    engine = tiny_engine()
    async with engine:
        base = await engine.generate(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=6))
        tok = base.output_ids[1]
    # Treat that token as EOS through a second engine whose model says so.
    engine2 = tiny_engine()
    engine2.scheduler.limits = type(engine2.scheduler.limits)(**{**engine2.scheduler.limits.__dict__, "eos_token_ids": (tok,)})
    async with engine2:
        stopped = await engine2.generate(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=6))
        ignored = await engine2.generate(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert stopped.finish_reason == "stop" and stopped.output_ids == base.output_ids[: base.output_ids.index(tok) + 1]
    assert ignored.output_ids == base.output_ids and ignored.finish_reason == "length"
    assert ByteTokenizer.EOS == 257


@pytest.mark.parametrize("loop", LOOPS)
async def test_logprobs_match_float64_recomputation(hf_checkpoints, loop):
    """Default ("processed") logprobs are those of the distribution sampled from (here
    logits / temperature); ``logprobs_mode="raw"`` gives log_softmax of the raw logits.
    Both against a float64 recomputation with transformers."""
    folder = hf_checkpoints["qwen3"]
    prompt = [12, 34, 56, 78, 90]
    temperature = 0.9
    sp = SamplingParams(max_new_tokens=10, temperature=temperature, seed=7, return_logprob=True, ignore_eos=True)
    engine = Engine.from_pretrained(str(folder), loop=loop)
    async with engine:
        handle = await engine.submit(input_ids=prompt, sampling=sp)
        streamed = []
        async for delta in handle:
            streamed.extend(delta.logprobs or [])
        res = await handle.result()
        raw_sp = dataclasses.replace(sp, logprobs_mode="raw")
        raw = await engine.generate(input_ids=prompt, sampling=raw_sp)
        plain = await engine.generate(input_ids=prompt, sampling=SamplingParams(max_new_tokens=3))
    assert plain.output_logprobs is None
    assert res.output_logprobs == streamed and len(streamed) == 10
    assert raw.output_ids == res.output_ids  # same seed: the mode changes only what is reported
    model = _hf_model(folder).to(torch.float64)
    try:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + res.output_ids])).logits[0].to(torch.float64)
    finally:
        model.to(torch.float32)
    processed_lp = torch.log_softmax(logits / temperature, -1)
    raw_lp = torch.log_softmax(logits, -1)
    for i, tok in enumerate(res.output_ids):
        at = len(prompt) - 1 + i
        assert abs(res.output_logprobs[i] - float(processed_lp[at, tok])) < 1e-4, (i, "processed")
        assert abs(raw.output_logprobs[i] - float(raw_lp[at, tok])) < 1e-4, (i, "raw")


async def test_invalid_sampling_combinations_are_typed_errors(tiny_engine):
    engine = tiny_engine()
    async with engine:
        with pytest.raises(errors.InvalidRequestError, match="min_new_tokens"):
            await engine.generate(input_ids=[1], sampling=SamplingParams.from_dict({"max_new_tokens": 2, "min_new_tokens": 5}))
        with pytest.raises(errors.InvalidRequestError, match="outside the vocabulary"):
            await engine.generate(input_ids=[1], sampling=SamplingParams(suppress_tokens=[100_000]))
        with pytest.raises(errors.InvalidRequestError, match="whole vocabulary"):
            await engine.generate(input_ids=[1], sampling=SamplingParams(suppress_tokens=list(range(320))))
        ok = await engine.generate(input_ids=[1], sampling=SamplingParams(max_new_tokens=2, top_k=100_000, temperature=1.0, seed=1))
        assert len(ok.output_ids) == 2


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_greedy_on_half_logits_is_greedy_on_their_float32(device, dtype):
    """Decode graphs hand back logits in the model's dtype: greedy on them must pick what
    greedy on their (exact) float32 conversion picks, ties included (values quantised
    so that many rows have tied maxima)."""
    from omni_async.runners.sampling import greedy

    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(64, 1000, generator=gen) * 4).round().to(dtype).to(device)
    logits[3] = float("-inf")  # nothing admissible: token 0, not ok
    tokens, ok = greedy(logits)
    ref_tokens, ref_ok = greedy(logits.to(torch.float32))
    assert torch.equal(tokens, ref_tokens) and torch.equal(ok, ref_ok)
    ties = (logits.to(torch.float32) == logits.to(torch.float32).max(dim=-1, keepdim=True).values).sum(dim=-1)
    assert (ties > 1).sum() >= 10  # the case is exercised


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_half_logits_equals_sampling_their_float32(device):
    """``sample`` converts half logits first: seeded draws and logprobs are the same."""
    gen = torch.Generator().manual_seed(9)
    logits = (torch.randn(6, 500, generator=gen) * 3).to(torch.bfloat16).to(device)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=11 + i) for i in range(5)] + [SamplingParams()]
    rows = [RowSampling(sp, f"r{i}", 1, [], []) for i, sp in enumerate(params)]
    half = sample_rows(logits.clone(), rows, True)
    full = sample_rows(logits.to(torch.float32), rows, True)
    assert torch.equal(half[0], full[0]) and torch.equal(half[1], full[1])
