"""Multi-step decode (``decode_steps`` = k > 1): one scheduled decode step runs up to k
forwards on the device. The tokens must equal k = 1's in every loop, for greedy and
seeded sampling, whatever ends a request mid-chunk (stop token, length, context, abort,
retraction), and the KV (with prefix caching on) must come back whole."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni_async import Engine, SamplingParams, errors
from omni_async.core.plan import resolve_decode_steps

from .conftest import LOOPS, assert_kv_free


def same(a: list, b: list) -> bool:
    """Tokens and finish reasons equal; logprobs equal up to float noise (batches are
    composed differently, so the float sums are too)."""
    for x, y in zip(a, b, strict=True):
        if x[:2] != y[:2] or x[3:] != y[3:] or (len(x) > 2 and (x[2] is None) != (y[2] is None)):
            return False
        if len(x) > 2 and x[2] is not None and x[2] != pytest.approx(y[2], abs=1e-4):
            return False
    return True


def mixed_requests(seed: int, n: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 250) for _ in range(40)]
    out = []
    for i in range(n):
        prompt = (system if i % 2 else []) + [rng.randrange(3, 250) for _ in range(rng.randint(3, 30))]
        kind = i % 4
        sp = SamplingParams(
            max_new_tokens=rng.randint(3, 30),
            temperature=0.0 if kind == 0 else 0.9,
            top_k=30 if kind == 1 else 0,
            top_p=0.8 if kind == 2 else 1.0,
            repetition_penalty=1.3 if kind == 3 else 1.0,
            seed=100 + i,
            stop_token_ids=[rng.randrange(3, 250) for _ in range(6)],
            min_new_tokens=2 if i % 5 == 0 else 0,
            return_logprob=i % 3 == 0,
        )
        out.append((prompt, sp))
    return out


async def run(reqs, *, retract_at: int | None = None, abort: set[int] = frozenset(), **limits):
    """Every request streamed; returns (tokens, finish reason, logprobs) per request,
    the deltas' sizes, and the stage's info."""
    engine = Engine.from_pretrained("tiny", **limits)
    sizes: list[int] = []
    retracted = asyncio.Event()
    async with engine:

        async def one(i, prompt, sp):
            handle = await engine.submit(input_ids=prompt, sampling=sp, request_id=f"r{i}")
            got: list[int] = []  # completion 0's tokens
            per_completion: dict[int, list[int]] = {}
            try:
                async for delta in handle:
                    per_completion.setdefault(delta.index, []).extend(delta.token_ids)
                    if delta.index == 0:
                        got.extend(delta.token_ids)
                    sizes.append(len(delta.token_ids))
                    if i in abort and len(got) >= 2:
                        await engine.abort(handle.request_id)
                    if retract_at is not None and i == 0 and len(got) >= retract_at and not retracted.is_set():
                        retracted.set()
                        assert (await engine.pause(mode="retract"))["success"]
                        await engine.resume()
            except errors.RequestAbortedError:
                return ("aborted",)
            except errors.RequestFailedError as exc:  # e.g. a grammar needing a stop id min_new_tokens bans
                return ("failed", str(exc))
            res = await handle.result()
            assert res.output_ids == got  # the deltas add up to the result
            assert [c.output_ids for c in res.outputs] == [per_completion.get(c.index, []) for c in res.outputs]
            return (res.output_ids, res.finish_reason, res.output_logprobs, [c.output_ids for c in res.outputs])

        outs = await asyncio.gather(*(one(i, p, sp) for i, (p, sp) in enumerate(reqs)))
        info = engine.scheduler.info()
        model = (await engine.model_info())["data"]
        assert model["kv_free_pages"] == model["kv_total_pages"], "a finished request still holds KV"
    assert_kv_free(engine)
    return outs, sizes, info


async def test_sixteen_forwards_a_step_in_the_normal_loop_equal_one_in_the_other_loops():
    """Up to 16 forwards a step (a page's worth) in the normal loop: its tokens equal one
    forward per step of a lookahead loop, stops and lengths mid-step."""
    reqs = mixed_requests(5, 12)
    one, _, _ = await run(reqs, loop="overlap", max_running_requests=8)
    sixteen, _, _ = await run(reqs, loop="normal", max_running_requests=8, decode_steps=16)
    assert same(sixteen, one)
    assert {o[1] for o in one} >= {"stop", "length"}


async def test_seeded_sampling_without_penalties_equals_one_step_decode():
    """Later forwards reuse the first one's sampling settings when nothing reads the
    tokens sampled so far (no penalty, no ban): their seeds still follow the index."""
    reqs = [(p, SamplingParams(max_new_tokens=sp.max_new_tokens, temperature=0.9, top_p=0.9, seed=sp.seed, ignore_eos=True))
            for p, sp in mixed_requests(8, 10)]
    one, _, _ = await run(reqs, loop="async_decode")
    four, _, _ = await run(reqs, loop="async_decode", decode_steps=4)
    assert same(four, one)


@pytest.mark.parametrize("loop", LOOPS)
async def test_tokens_equal_one_step_decode(loop):
    reqs = mixed_requests(3, 12)
    one, sizes_one, info_one = await run(reqs, loop=loop, max_running_requests=8)
    four, sizes_four, info_four = await run(reqs, loop=loop, max_running_requests=8, decode_steps=4)
    assert same(four, one)
    assert {o[1] for o in one} >= {"stop", "length"}  # both finishes happen, mid-chunk too
    assert max(sizes_four) > 1  # deltas carry several tokens (a lagging reader's merge more)
    assert info_four["decode_steps"] < info_one["decode_steps"] / 2  # fewer host steps
    assert info_four["tokens_out"] == info_one["tokens_out"]


async def test_stop_token_mid_chunk_drops_the_rest():
    prompt = [5, 6, 7, 8, 9, 10]
    base, _, _ = await run([(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))])
    tokens = base[0][0]
    at = next(i for i in range(5, 20) if tokens[i] not in tokens[:i])  # a token first seen there
    sp = SamplingParams(max_new_tokens=20, stop_token_ids=[tokens[at]])
    for loop in LOOPS:
        got, _, _ = await run([(prompt, sp)], loop=loop, decode_steps=4)
        assert got[0][0] == tokens[: at + 1] and got[0][1] == "stop"


async def test_context_limit_mid_chunk():
    limits = dict(context_length=64, decode_steps=4)
    prompt = list(range(3, 3 + 57))  # room for 7 tokens: not a multiple of 4
    one, _, _ = await run([(prompt, SamplingParams(max_new_tokens=50, ignore_eos=True))], context_length=64)
    four, _, _ = await run([(prompt, SamplingParams(max_new_tokens=50, ignore_eos=True))], **limits)
    assert same(four, one) and len(one[0][0]) == 7 and one[0][1] == "length"


@pytest.mark.parametrize("loop", LOOPS)
async def test_retraction_abort_and_prefix_cache_under_pressure(loop):
    """A KV small enough to retract, a pause-retract, an abort and shared prefixes:
    tokens equal k = 1's and every page comes back."""
    reqs = mixed_requests(11, 14)
    for _, sp in reqs:
        sp.ignore_eos = True
    limits = dict(loop=loop, page_size=8, kv_capacity_tokens=360, chunked_prefill_size=48, max_running_requests=8)
    one, _, info_one = await run(reqs, retract_at=6, abort={4}, **limits)
    four, _, info_four = await run(reqs, retract_at=6, abort={4}, decode_steps=4, **limits)
    assert same([o for i, o in enumerate(four) if i != 4], [o for i, o in enumerate(one) if i != 4])
    assert four[4] == ("aborted",)
    assert info_four["num_retractions"] > 0 and info_four["prefix_cache_hit_tokens"] > 0  # the pressure is real


def greedy_requests(seed: int, n: int, **extra) -> list[tuple[list[int], SamplingParams]]:
    """Plain greedy requests (stop ids and lengths vary): their multi-step decodes run fused."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 250) for _ in range(24)]
    return [
        ((system if i % 3 == 0 else []) + [rng.randrange(3, 250) for _ in range(rng.randint(3, 30))],
         SamplingParams(max_new_tokens=rng.randint(5, 40), stop_token_ids=[rng.randrange(3, 250) for _ in range(4)], **extra))
        for i in range(n)
    ]


@pytest.mark.parametrize("loop", LOOPS)
async def test_fused_greedy_decode_equals_one_step_decode(loop):
    """Plain greedy rows run their k forwards as one fused launch (eagerly on CPU):
    stops and lengths mid-chunk, a retraction, an abort and shared prefixes give k = 1's
    tokens, and every page comes back."""
    reqs = greedy_requests(4, 12)
    reqs[0] = (reqs[0][0], SamplingParams(max_new_tokens=40, ignore_eos=True))  # lives to be retracted
    limits = dict(loop=loop, page_size=8, kv_capacity_tokens=400, chunked_prefill_size=48, max_running_requests=8)
    one, _, _ = await run(reqs, retract_at=5, abort={3}, **limits)
    four, _, info = await run(reqs, retract_at=5, abort={3}, decode_steps=4, **limits)
    assert same([o for i, o in enumerate(four) if i != 3], [o for i, o in enumerate(one) if i != 3])
    assert {o[1] for i, o in enumerate(one) if i != 3} >= {"stop", "length"}
    assert info["fused_decode_launches"] > 0 and info["fused_decode_replays"] == 0  # no graphs on CPU
    assert info["num_retractions"] > 0


async def test_a_sampled_row_keeps_the_step_on_the_fused_path():
    """One row with a temperature or a penalty among greedy rows: the step still runs as
    one fused launch, which samples (tokens equal k = 1's). A row with logprobs runs
    forward by forward beside the fused rows, and alone once the others finished."""
    for odd in (dict(temperature=0.8, seed=5), dict(repetition_penalty=1.2), dict(return_logprob=True)):
        reqs = greedy_requests(6, 4)
        reqs[0] = (reqs[0][0], SamplingParams(max_new_tokens=60, ignore_eos=True, **odd))  # outlives the others
        one, _, _ = await run(reqs, max_running_requests=4)
        four, _, info = await run(reqs, max_running_requests=4, decode_steps=4)
        assert same(four, one)
        assert info["fused_decode_launches"] > 0, odd
        assert (info["fused_decode_sampled"] > 0) == ("return_logprob" not in odd), odd


async def test_top_logprobs_fall_back_to_one_forward():
    sp = SamplingParams(max_new_tokens=9, temperature=0.7, seed=4, top_logprobs=3, return_logprob=True)
    eng_one = Engine.from_pretrained("tiny")
    eng_four = Engine.from_pretrained("tiny", decode_steps=4)
    async with eng_one, eng_four:
        a = await eng_one.generate(input_ids=[4, 5, 6], sampling=sp)
        b = await eng_four.generate(input_ids=[4, 5, 6], sampling=sp)
    assert b.output_ids == a.output_ids and b.top_logprobs == a.top_logprobs and len(b.top_logprobs) == 9


@pytest.mark.parametrize("bad", [0, 17, "4"])
def test_decode_steps_is_checked(bad):
    with pytest.raises(errors.ConfigError, match="decode_steps"):
        Engine.from_pretrained("tiny", decode_steps=bad)


@pytest.mark.parametrize("loop", LOOPS)
async def test_follow_up_reuses_the_pages_of_a_chunk_that_ended_early(loop):
    """A chat-style follow-up (prompt = the last prompt + its answer + more) reuses the
    cached pages up to the answer's end. The answer's last launch ran 2 of its 4
    forwards (1 + 4 + 4 + 2 tokens), and its last computed position closes a page
    (22 + 11 - 1 = 32), while a longer companion ran all 4: the forwards past a row's
    end must not touch its KV."""
    prompt = [(33 * i) % 200 + 3 for i in range(22)]  # its answer's last two tokens differ
    sp = SamplingParams(max_new_tokens=11, ignore_eos=True)
    limits = dict(loop=loop, page_size=8)
    engine = Engine.from_pretrained("tiny", decode_steps=4, **limits)
    async with engine:
        # A companion that decodes longer, so the launch runs all 4 forwards.
        long = SamplingParams(max_new_tokens=30, ignore_eos=True)
        first, _ = await asyncio.gather(engine.generate(input_ids=prompt, sampling=sp), engine.generate(input_ids=prompt[:5], sampling=long))
        follow = prompt + first.output_ids + [9, 10]
        second = await engine.generate(input_ids=follow, sampling=sp)
    assert second.cached_tokens >= 32
    plain = Engine.from_pretrained("tiny", enable_prefix_cache=False, **limits)
    async with plain:
        assert (await plain.generate(input_ids=prompt, sampling=sp)).output_ids == first.output_ids
        assert (await plain.generate(input_ids=follow, sampling=sp)).output_ids == second.output_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("loop", LOOPS)
async def test_cuda_graph_path_tokens_equal_one_step_decode(loop):
    """On CUDA the forwards replay the decode graphs back to back (greedy sampled in
    the graph, filtered sampling outside): tokens equal k = 1's, float32."""
    reqs = mixed_requests(5, 12)
    limits = dict(loop=loop, device="cuda", dtype="float32", max_running_requests=8, page_size=8, kv_capacity_tokens=4096)
    one, _, info_one = await run(reqs, decode_steps=1, **limits)
    four, _, info_four = await run(reqs, decode_steps=4, **limits)
    assert same(four, one) and info_four["decode_steps"] < 0.6 * info_one["decode_steps"]
    greedy_reqs = greedy_requests(7, 12)  # all greedy: one fused graph replay per step
    one, _, _ = await run(greedy_reqs, decode_steps=1, **limits)
    four, _, info_four = await run(greedy_reqs, decode_steps=4, **limits)
    assert same(four, one) and info_four["fused_decode_replays"] > 0


def test_decode_steps_is_refused_where_it_does_not_run():
    with pytest.raises(errors.ConfigError, match="tensor_parallel_size"):
        Engine.from_pretrained("tiny", decode_steps=4, tensor_parallel_size=2)
    with pytest.raises(errors.ConfigError, match="sglang.*decode_steps"):
        Engine.from_pretrained("tiny", decode_steps=4, backend="sglang")


def test_auto_takes_more_forwards_on_cuda_at_larger_batches_only():
    auto = resolve_decode_steps(None, "cuda")
    assert [auto.for_batch(n) for n in (1, 63, 64, 255, 256, 512)] == [4, 4, 8, 8, 8, 8] and auto.most == 8
    assert resolve_decode_steps(None, "cpu").for_batch(512) == 1
    assert resolve_decode_steps(None, "cuda", tensor_parallel_size=2).for_batch(512) == 1
    fixed = resolve_decode_steps(3, "cpu")
    assert fixed.for_batch(1) == fixed.for_batch(512) == fixed.most == 3
    assert resolve_decode_steps(1, "cuda").most == 1
    small_pages = resolve_decode_steps(None, "cuda", page_size=4)  # a step adds at most one page per row
    assert [small_pages.for_batch(n) for n in (1, 63, 64, 512)] == [4, 4, 4, 4]
    assert resolve_decode_steps(None, "cuda", page_size=2).for_batch(1) == 2
    assert resolve_decode_steps(None, "cuda", page_size=1).most == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_default_runs_multi_step_at_large_batch():
    """The default (decode_steps=None) on CUDA: four forwards per step below 64 decoding
    requests, eight from 64 on; tokens equal one forward per step throughout."""
    rng = random.Random(2)
    reqs = [([rng.randrange(3, 250) for _ in range(rng.randint(4, 40))], SamplingParams(max_new_tokens=rng.randint(8, 40), ignore_eos=True))
            for _ in range(280)]
    limits = dict(device="cuda", dtype="float32", max_running_requests=320, kv_capacity_tokens=32768, loop="async_decode")
    one, _, info_one = await run(reqs, decode_steps=1, **limits)
    auto, _, info_auto = await run(reqs, **limits)
    assert same(auto, one)
    assert info_auto["decode_steps"] < 0.5 * info_one["decode_steps"]  # 8 forwards while >= 64 decode, then 4
    assert info_auto["fused_decode_replays"] > 0  # all greedy: the fused graphs ran


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_prefill_budget_defaults_and_overrides():
    eng = Engine.from_pretrained("tiny", device="cuda")
    assert (eng.scheduler.config.max_prefill_tokens, eng.scheduler.config.chunked_prefill_size) == (16384, 8192)
    eng = Engine.from_pretrained("tiny", device="cuda", chunked_prefill_size=256)
    assert (eng.scheduler.config.max_prefill_tokens, eng.scheduler.config.chunked_prefill_size) == (16384, 256)
    assert Engine.from_pretrained("tiny").scheduler.config.chunked_prefill_size == 512


async def test_hidden_state_capture_keeps_multi_step_decode():
    """A stage handing out every token's hidden state (a thinker feeding a talker) keeps
    its multi-step decode: each delta carries one row per token, several tokens a step."""
    engine = Engine.from_pretrained("tiny", decode_steps=4)
    engine.stack.runner.capture_hidden = True
    async with engine:
        deltas = [d async for d in engine.stream(input_ids=[3, 4, 5], sampling=SamplingParams(max_new_tokens=9, ignore_eos=True))]
        plain = await engine.generate(input_ids=[3, 4, 5], sampling=SamplingParams(max_new_tokens=9, ignore_eos=True))
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens == plain.output_ids and len(tokens) == 9
    assert all(d.hidden_states is not None and d.hidden_states.shape[0] == len(d.token_ids) for d in deltas if d.token_ids)
    assert sum(1 for d in deltas if d.token_ids) < 9  # several tokens per step: multi-step stayed on


_mix = st.lists(
    st.fixed_dictionaries({
        "prompt": st.lists(st.integers(3, 249), min_size=1, max_size=40),
        "max_new_tokens": st.integers(1, 20),
        "temperature": st.sampled_from([0.0, 0.7]),
        "top_k": st.sampled_from([0, 20]),
        "top_p": st.sampled_from([1.0, 0.9]),
        "repetition_penalty": st.sampled_from([1.0, 1.2]),
        "seed": st.integers(0, 2**31),
        "stop_token_ids": st.lists(st.integers(3, 249), max_size=8),
        "min_new_tokens": st.integers(0, 3),
        "return_logprob": st.booleans(),
        "n": st.sampled_from([1, 1, 2]),
        "regex": st.sampled_from([None, None, r"[a-z]{2,6}( [a-z]{1,5}){0,4}\.", r"(yes|no)(, (yes|no)){0,6}"]),
        "frequency_penalty": st.sampled_from([0.0, 0.4]),
        "logit_bias": st.sampled_from([{}, {71: 5.0, 13: -5.0}]),
    }),
    min_size=1, max_size=6,
)


def test_generated_mixes_equal_one_step_decode(soak):
    """Generated request mixes (sampling, stops, min tokens, logprobs, n, grammars,
    penalties, biases) under several k and every loop: tokens equal one forward per
    step's. ``--soak`` runs many more."""

    @settings(max_examples=200 if soak else 10, deadline=None, suppress_health_check=list(HealthCheck))
    @given(mix=_mix, k=st.sampled_from([2, 3, 4, 8]), loop=st.sampled_from(LOOPS))
    def inner(mix, k, loop):
        reqs = []
        for r in mix:
            fields = {key: v for key, v in r.items() if key != "prompt"}
            fields["min_new_tokens"] = min(fields["min_new_tokens"], fields["max_new_tokens"])
            reqs.append((r["prompt"], SamplingParams(**fields)))

        async def both():
            one, _, _ = await run(reqs, loop=loop, max_running_requests=4, page_size=8)
            many, _, _ = await run(reqs, loop=loop, max_running_requests=4, page_size=8, decode_steps=k)
            return one, many

        one, many = asyncio.run(both())
        assert same(many, one)

    inner()


WORDS = r"[a-z]{2,6}( [a-z]{1,5}){0,4}\."


async def _outputs(loop: str, decode_steps: int, reqs, **kw) -> list[list[int]]:
    engine = Engine.from_pretrained("tiny", loop=loop, decode_steps=decode_steps, page_size=8, **kw)
    async with engine:
        results = await asyncio.gather(*(engine.generate(input_ids=p, sampling=sp) for p, sp in reqs))
    assert_kv_free(engine)
    return [r.output_ids for r in results]


@pytest.mark.parametrize("optimistic", [False, True])
async def test_a_row_that_samples_fewer_forwards_keeps_its_penalties(optimistic):
    """A step of several forwards where one row samples fewer than the others (a row
    under a grammar samples one token under its mask; the step runs on for its
    neighbour): the forwards it does not use must not count as its tokens. They had
    been published to its slot's penalty counts and seen-mask, so a constrained row
    with OpenAI and repetition penalties beside a row with a logit bias drew different
    greedy tokens at four forwards a step than at one."""
    reqs = [([109, 217], SamplingParams(max_new_tokens=30, regex=WORDS, repetition_penalty=1.3, frequency_penalty=0.5)),
            ([175, 232, 113, 154, 52, 129, 29, 243, 173, 102, 78, 132, 130, 7, 86, 159, 226, 105, 233, 75, 7, 43, 54],
             SamplingParams(max_new_tokens=40, ignore_eos=True, logit_bias={71: 5.0}))]
    ref = await _outputs("normal", 1, reqs, optimistic_grammar=False)
    for loop in LOOPS:
        assert await _outputs(loop, 4, reqs, optimistic_grammar=optimistic) == ref, loop


async def test_constrained_rows_with_penalties_beside_free_rows_equal_one_step_decode():
    """A seeded mix: rows under grammars (sampling first and masked) with OpenAI and
    repetition penalties, min_new_tokens and seeds, beside free rows with logit biases,
    at four forwards a step against one, in every loop (greedy and seeded tokens alike)."""
    rng = random.Random(11)
    reqs = []
    for i in range(10):
        prompt = [rng.randrange(3, 250) for _ in range(rng.randint(2, 30))]
        kw = dict(max_new_tokens=rng.randint(4, 28), repetition_penalty=rng.choice([1.0, 1.3]),
                  frequency_penalty=rng.choice([0.0, 0.5]), presence_penalty=rng.choice([0.0, 0.4]))
        if i % 3 == 2:
            kw.update(temperature=0.8, seed=50 + i)
        if i % 2:
            kw.update(regex=WORDS, min_new_tokens=rng.randint(0, 3))
        else:
            kw.update(ignore_eos=True, logit_bias={rng.randrange(3, 250): 5.0, rng.randrange(3, 250): -5.0})
        reqs.append((prompt, SamplingParams(**kw)))
    for optimistic in (False, True):  # (a sampled row sampling first draws other tokens than masking first)
        ref = await _outputs("normal", 1, reqs, optimistic_grammar=optimistic)
        for loop in LOOPS:
            assert await _outputs(loop, 4, reqs, optimistic_grammar=optimistic) == ref, (loop, optimistic)
