"""Scoring prompts (``SamplingParams.prompt_logprobs``): every prompt token's
log-probability equals transformers' ``log_softmax(model(ids).logits)`` on a float32
checkpoint, in every loop, under chunked prefill and with the prefix cache warmed by the
same prompt; ``max_new_tokens=0`` ends after the prefill with no token; bad values are a
typed error on that request alone."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from omni_async import Engine, SamplingParams, errors

from .conftest import LOOPS, _hf_model, assert_kv_free, hf_greedy, random_prompts

ATOL = 1e-4
K = 3


def hf_prompt_logprobs(folder, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i scores prompt token i + 1."""
    with torch.no_grad():
        logits = _hf_model(folder)(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def check_scores(folder, prompt: list[int], result, k: int = K, atol: float = ATOL) -> None:
    ref = hf_prompt_logprobs(folder, prompt)
    scores, ranks = result.prompt_logprobs, result.prompt_logprob_ranks
    assert scores is not None and len(scores) == len(prompt) and scores[0] is None
    assert ranks is not None and len(ranks) == len(prompt) and ranks[0] is None
    for i in range(1, len(prompt)):
        row, token, entry = ref[i - 1], prompt[i], scores[i]
        assert list(entry)[0] == token  # the prompt's own token first
        assert entry[token] == pytest.approx(row[token].item(), abs=atol)
        # Tokens whose log-probabilities are within ``atol`` of each other may be ordered
        # either way by another device's reductions: ranks and the top k are checked up to that.
        assert int((row > row[token] + atol).sum()) + 1 <= ranks[i] <= int((row > row[token] - atol).sum()) + 1
        for t, lp in entry.items():
            assert lp == pytest.approx(row[t].item(), abs=atol)
        kth = row.topk(k).values[-1].item() if k else math.inf
        assert sum(lp >= kth - atol for lp in entry.values()) >= k
        assert len(entry) in (k, k + 1) and (len(entry) == k + 1 or token in entry)


@pytest.mark.parametrize("loop", LOOPS)
async def test_prompt_logprobs_equal_transformers(hf_checkpoints, loop):
    folder = hf_checkpoints["qwen2"]
    prompts = random_prompts(4, 512, 2, 45, seed=11) + [[7]]
    engine = Engine.from_pretrained(
        str(folder), loop=loop, page_size=8, chunked_prefill_size=8, max_prefill_tokens=16, enable_prefix_cache=True,
    )
    async with engine:
        # Warm the prefix cache with the same prompts: scoring must not reuse it.
        await asyncio.gather(*[engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=2)) for p in prompts])
        scored = await asyncio.gather(*[
            engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=0, prompt_logprobs=K)) for p in prompts
        ])
        generated = await asyncio.gather(*[
            engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=5, prompt_logprobs=K)) for p in prompts
        ])
    for prompt, res in zip(prompts, scored):
        assert res.output_ids == [] and res.finish_reason == "length"
        check_scores(folder, prompt, res)
    for prompt, res in zip(prompts, generated):
        assert res.output_ids == hf_greedy(folder, prompt, 5)
        check_scores(folder, prompt, res)
    assert_kv_free(engine)


async def test_loops_give_identical_scores(hf_checkpoints):
    folder = hf_checkpoints["llama"]
    prompts = random_prompts(5, 512, 3, 40, seed=4)
    got = []
    for loop in LOOPS:
        async with Engine.from_pretrained(str(folder), loop=loop, page_size=8, chunked_prefill_size=16) as engine:
            results = await asyncio.gather(*[
                engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=i % 3, prompt_logprobs=i))
                for i, p in enumerate(prompts)
            ])
        got.append([(r.output_ids, r.prompt_logprobs, r.prompt_logprob_ranks) for r in results])
    assert got[0] == got[1] == got[2]


@pytest.mark.parametrize("loop", LOOPS)
async def test_scoring_rows_leave_other_rows_alone(hf_checkpoints, loop):
    folder = hf_checkpoints["llama"]
    prompts = random_prompts(4, 512, 5, 30, seed=8)
    async with Engine.from_pretrained(str(folder), loop=loop, page_size=8, chunked_prefill_size=16) as engine:
        mixed = await asyncio.gather(*[
            engine.generate(input_ids=p, sampling=SamplingParams(
                max_new_tokens=6, prompt_logprobs=0 if i % 2 == 0 else None))
            for i, p in enumerate(prompts)
        ])
    for i, (prompt, res) in enumerate(zip(prompts, mixed)):
        assert res.output_ids == hf_greedy(folder, prompt, 6)
        if i % 2:
            assert res.prompt_logprobs is None
        else:
            check_scores(folder, prompt, res, k=0)
    assert_kv_free(engine)


@pytest.mark.parametrize("loop", LOOPS)
async def test_streams_carry_the_scores_once(hf_checkpoints, loop):
    folder = hf_checkpoints["qwen2"]
    prompt = random_prompts(1, 512, 20, 20, seed=2)[0]
    async with Engine.from_pretrained(str(folder), loop=loop, chunked_prefill_size=8) as engine:
        only = [d async for d in engine.stream(input_ids=prompt, sampling=SamplingParams(max_new_tokens=0, prompt_logprobs=1))]
        more = [d async for d in engine.stream(input_ids=prompt, sampling=SamplingParams(max_new_tokens=4, prompt_logprobs=1))]
        whole = await engine.generate(input_ids=prompt, sampling=SamplingParams(max_new_tokens=0, prompt_logprobs=1))
    assert [d.token_ids for d in only] == [[]] and only[-1].finished
    assert only[0].prompt_logprobs == whole.prompt_logprobs
    carried = [d for d in more if d.prompt_logprobs is not None]
    assert len(carried) == 1 and carried[0] is more[0] and more[0].token_ids
    assert carried[0].prompt_logprobs == whole.prompt_logprobs
    assert carried[0].prompt_logprob_ranks == whole.prompt_logprob_ranks
    assert_kv_free(engine)


@pytest.mark.parametrize("loop", LOOPS)
async def test_scores_survive_retraction_aborts_and_n(hf_checkpoints, loop):
    """Under KV pressure requests are retracted and prefilled again (their scores are
    not collected twice); an aborted scoring request ends once; n > 1 scores the prompt
    once per result."""
    folder = hf_checkpoints["qwen2"]
    prompts = random_prompts(12, 512, 3, 100, seed=21)
    engine = Engine.from_pretrained(  # ~1,000 tokens of demand on 192 tokens of KV: retraction
        str(folder), loop=loop, page_size=8, kv_capacity_tokens=8 * 24, chunked_prefill_size=16, max_prefill_tokens=32,
    )
    async with engine:
        aborted = await engine.submit(input_ids=prompts[0][:40] * 2, sampling=SamplingParams(max_new_tokens=0, prompt_logprobs=1))
        results = await asyncio.gather(*[
            engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=40, prompt_logprobs=2, ignore_eos=True))
            for p in prompts
        ], engine.generate(input_ids=prompts[1], sampling=SamplingParams(max_new_tokens=3, n=2, prompt_logprobs=0)),
            engine.abort(aborted.request_id))
        assert engine.stack.core.num_retractions > 0, "the KV capacity was meant to force retraction"
        try:  # aborted while its prefill ran, or finished just before the abort arrived
            assert (await aborted.result()).output_ids == []
        except errors.RequestAbortedError:
            pass
    for prompt, res in zip(prompts, results[: len(prompts)]):
        assert res.output_ids == hf_greedy(folder, prompt, 40)
        check_scores(folder, prompt, res, k=2)
    check_scores(folder, prompts[1], results[len(prompts)], k=0)
    assert_kv_free(engine)


@pytest.mark.parametrize("bad", [
    dict(prompt_logprobs=-1), dict(prompt_logprobs=21), dict(prompt_logprobs=1.5), dict(prompt_logprobs=True),
    dict(max_new_tokens=0), dict(max_new_tokens=-1, prompt_logprobs=0),
])
def test_bad_values_are_typed_errors(bad):
    with pytest.raises(errors.InvalidRequestError, match="prompt_logprobs|max_new_tokens"):
        SamplingParams(**bad)


async def test_bad_request_fails_alone(tiny_engine):
    engine = tiny_engine()
    async with engine:
        sampling = SamplingParams(max_new_tokens=0, prompt_logprobs=2)
        sampling.prompt_logprobs = 99  # assigned after validation: the stage validates again
        good = engine.generate(input_ids=[5, 6, 7, 8], sampling=SamplingParams(max_new_tokens=0, prompt_logprobs=2))
        bad = engine.generate(input_ids=[5, 6, 7, 8], sampling=sampling)
        ok, err = await asyncio.gather(good, bad, return_exceptions=True)
        assert isinstance(err, errors.InvalidRequestError)
        assert len(ok.prompt_logprobs) == 4 and ok.output_ids == []
        after = await engine.generate(input_ids=[5, 6], sampling=SamplingParams(max_new_tokens=3))
        assert len(after.output_ids) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; run on the GPU machine")
@pytest.mark.parametrize("loop", LOOPS)
async def test_cuda_scores_equal_transformers(hf_checkpoints, loop):
    """The CUDA prefill (paged extend kernel, scores copied to pinned host memory behind
    the step) scores as transformers does, float32, with chunked prefill and generation
    running beside it."""
    folder = hf_checkpoints["qwen2"]
    prompts = random_prompts(8, 512, 2, 120, seed=17)
    engine = Engine.from_pretrained(str(folder), device="cuda", loop=loop, dtype=torch.float32, page_size=16,
                                    chunked_prefill_size=32, enable_prefix_cache=True)
    async with engine:
        await asyncio.gather(*[engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=8)) for p in prompts])
        results = await asyncio.gather(*[
            engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=(0, 6)[i % 2], prompt_logprobs=K))
            for i, p in enumerate(prompts)
        ])
    for i, (prompt, res) in enumerate(zip(prompts, results)):
        assert len(res.output_ids) == (0, 6)[i % 2]
        check_scores(folder, prompt, res, atol=5e-4)  # CUDA's float32 reductions differ from the CPU's
    assert_kv_free(engine)


@pytest.mark.parametrize("loop", LOOPS)
async def test_n_completions_score_the_prompt_once(hf_checkpoints, loop):
    """``n`` completions of a scored prompt: the prompt is scored and prefilled once, its
    pages shared by the other completions (they compute only what lies past its last
    full page); the scores equal a single scoring and the completions' tokens are those
    of the same request unscored."""
    folder = hf_checkpoints["qwen2"]
    prompt = random_prompts(1, 512, 101, 101, seed=31)[0]
    n, page = 4, 8
    sp = dict(max_new_tokens=6, n=n, temperature=0.8, seed=5, ignore_eos=True)
    engine = Engine.from_pretrained(str(folder), loop=loop, page_size=page, chunked_prefill_size=32)
    async with engine:
        single = await engine.generate(input_ids=prompt, sampling=SamplingParams(max_new_tokens=0, prompt_logprobs=2))
        await engine.flush_cache()
        unscored = await engine.generate(input_ids=prompt, sampling=SamplingParams(**sp))
        await engine.flush_cache()
        before = engine.scheduler.info()["prefill_tokens"]
        scored = await engine.generate(input_ids=prompt, sampling=SamplingParams(prompt_logprobs=2, **sp))
        prefilled = engine.scheduler.info()["prefill_tokens"] - before
        await engine.flush_cache()
        deltas = [d async for d in engine.stream(input_ids=prompt, sampling=SamplingParams(prompt_logprobs=2, **sp))]
    assert scored.prompt_logprobs == single.prompt_logprobs
    assert scored.prompt_logprob_ranks == single.prompt_logprob_ranks
    check_scores(folder, prompt, scored, k=2)
    assert [o.output_ids for o in scored.outputs] == [o.output_ids for o in unscored.outputs]
    shared = (len(prompt) - 1) // page * page  # the full pages before the last prompt token
    assert prefilled == len(prompt) + (n - 1) * (len(prompt) - shared)
    assert scored.cached_tokens == (n - 1) * shared
    carried = [d for d in deltas if d.prompt_logprobs is not None]
    assert len(carried) == 1 and carried[0].index == 0 and carried[0].prompt_logprobs == single.prompt_logprobs
    assert_kv_free(engine)


async def test_n_scoring_only_completions_prefill_the_prompt_once(hf_checkpoints):
    """``max_new_tokens=0`` with ``n``: the completions are alike (no token), so the
    prompt is prefilled and scored once and every completion ends with its scores."""
    folder = hf_checkpoints["qwen2"]
    prompt = random_prompts(1, 512, 60, 60, seed=32)[0]
    sp = SamplingParams(max_new_tokens=0, n=3, prompt_logprobs=1)
    async with Engine.from_pretrained(str(folder), page_size=8, chunked_prefill_size=16) as engine:
        single = await engine.generate(input_ids=prompt, sampling=SamplingParams(max_new_tokens=0, prompt_logprobs=1))
        before = engine.scheduler.info()["prefill_tokens"]
        res = await engine.generate(input_ids=prompt, sampling=sp)
        assert engine.scheduler.info()["prefill_tokens"] - before == len(prompt)
        deltas = [d async for d in engine.stream(input_ids=prompt, sampling=sp)]
        assert engine.open_requests == []
    assert res.prompt_logprobs == single.prompt_logprobs
    assert [(o.index, o.output_ids, o.finish_reason) for o in res.outputs] == [(i, [], single.finish_reason) for i in range(3)]
    assert sorted(d.index for d in deltas) == [0, 1, 2] and all(d.finished for d in deltas)
    assert all(d.prompt_logprobs == single.prompt_logprobs for d in deltas)
    assert_kv_free(engine)
