"""Optimistic constrained decoding (``structured/optimistic.py``): eligible rows under a
grammar sample as free rows, the grammar checks each token after, and a refused token is
dropped and its position sampled again under the mask (the request rewound a token).

The oracles: greedy tokens equal those of masking every token first (an admissible
argmax is the masked argmax), in all three loops, one forward a step and four; seeded
sampled tokens equal across the loops; every output valid; KV freed; the sampled
distribution that of masking first."""

from __future__ import annotations

import asyncio
import collections
import re

import anyio
import pytest

pytest.importorskip("llguidance")

import torch  # noqa: E402

from .test_late_masks import FailsAt, fail_grammar_at  # noqa: E402

from omni_async import Engine, SamplingParams  # noqa: E402
from omni_async.runners.sampling import RowSampling, row_uniforms, stream_seed  # noqa: E402
from omni_async.structured.optimistic import FIRST_SCORE, LONGEST_MASKED_RUN, LOW_SCORE, eligible, masked_run, scored  # noqa: E402

# Runs the tiny random model mostly samples inside (any character but a digit: most
# guesses admitted) between runs it almost never does (digits: most guesses refused), so
# both the admitted path and the rewinds are exercised.
REGEX = "[^0-9]{6,10}[0-9]{3}[^0-9]{6,10}[0-9]{2}"
LOOPS = ["normal", "overlap", "async_decode"]
N = 6


def greedy(i: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=40, regex=REGEX)


def seeded(i: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=40, regex=REGEX, temperature=0.9, seed=100 + i)


async def run(loop: str, make, decode_steps: int, optimistic: bool = True) -> tuple[list, dict]:
    async with Engine.from_pretrained("tiny", device="cpu", loop=loop, decode_steps=decode_steps,
                                      optimistic_grammar=optimistic) as engine:
        results = await asyncio.gather(*[engine.generate(prompt=f"code {i}:", sampling=make(i)) for i in range(N)])
        info = engine.scheduler.info()
        assert engine.scheduler.core.kv_is_fully_free()  # no request holds KV (cached prefixes may stay)
    return results, info


def valid(results) -> None:
    for r in results:
        assert r.finish_reason == "stop" and re.fullmatch(REGEX, r.text), (r.finish_reason, r.text)


@pytest.mark.parametrize("decode_steps", [1, 4])
async def test_greedy_tokens_equal_masking_first_in_every_loop(decode_steps):
    reference, ref_info = await run("normal", greedy, decode_steps, optimistic=False)
    valid(reference)
    assert ref_info["grammar_optimistic_tokens"] == 0
    for loop in LOOPS:
        results, info = await run(loop, greedy, decode_steps)
        assert [r.output_ids for r in results] == [r.output_ids for r in reference], loop
        assert info["grammar_optimistic_tokens"] > 0 and info["grammar_optimistic_refused"] > 0, info
        # Fewer masks than masking first: the admitted guesses needed none. (Masks of a
        # step's first forward, and of the forwards after it under masks between forwards.)
        masks, ref_masks = (i["grammar_mask_rows"] + i["grammar_between_rows"] for i in (info, ref_info))
        assert masks < ref_masks, (info, ref_info)


@pytest.mark.parametrize("decode_steps", [1, 4])
async def test_seeded_sampled_tokens_equal_across_loops(decode_steps):
    reference, ref_info = await run("normal", seeded, decode_steps)
    valid(reference)
    assert ref_info["grammar_optimistic_refused"] > 0
    for loop in LOOPS[1:]:
        results, _ = await run(loop, seeded, decode_steps)
        assert [r.output_ids for r in results] == [r.output_ids for r in reference], loop


async def test_free_rows_beside_optimistic_rows_keep_their_tokens():
    """Rewinds of constrained rows leave the free rows of the same steps alone."""
    free = [SamplingParams(max_new_tokens=24, temperature=0.7, seed=i, ignore_eos=True) for i in range(3)]

    async def both(loop: str, constrained: bool) -> list:
        async with Engine.from_pretrained("tiny", device="cpu", loop=loop, decode_steps=4, optimistic_grammar=True) as engine:
            extra = [engine.generate(prompt=f"code {i}:", sampling=seeded(i)) for i in range(3)] if constrained else []
            out = await asyncio.gather(*[engine.generate(prompt=f"free {i}:", sampling=sp) for i, sp in enumerate(free)],
                                       *extra)
            if constrained:
                assert engine.scheduler.info()["grammar_optimistic_refused"] > 0
        return [r.output_ids for r in out[: len(free)]]

    alone = await both("normal", False)
    for loop in LOOPS:
        assert await both(loop, True) == alone, loop


def test_a_rewound_row_draws_from_a_fresh_stream():
    """The redraw of a refused position must not reuse the refused draw's random number
    (inverse CDF with the same uniform over the masked distribution is biased towards
    the tokens whose masked interval covers the refused token's): after each rewind the
    row's seed, and so every uniform it draws, changes; with none it is the request's."""
    seeds = torch.tensor([7, 7, 7, 123456789], dtype=torch.long)
    index = torch.tensor([5, 5, 5, 9], dtype=torch.long)
    rewound = torch.tensor([stream_seed(int(s), r) for s, r in zip(seeds, [0, 1, 2, 0])], dtype=torch.long)
    u = row_uniforms(rewound, index)
    assert rewound[0] == 7 and rewound[3] == 123456789  # no rewind: the request's own stream
    assert len({float(x) for x in u[:3]}) == 3
    row = RowSampling(params=SamplingParams(temperature=1.0, seed=7), request_id="r", sample_index=5,
                      output_ids=(), stop_ids=(), rewinds=1)
    assert row.seed() == stream_seed(7, 1) != 7


async def test_redrawn_tokens_follow_the_masked_distribution():
    """Sampled at temperature 4 over a small admissible set, the second token (the first
    comes with the prefill, masked) is drawn first and redrawn under the mask when refused;
    its histogram over 400 seeds stays within sampling noise of masking first."""
    regex = "x[a-h]"
    n = 400

    async def histogram(optimistic: bool) -> collections.Counter:
        async with Engine.from_pretrained("tiny", device="cpu", optimistic_grammar=optimistic) as engine:
            results = await asyncio.gather(*[
                engine.generate(prompt="pick:", sampling=SamplingParams(max_new_tokens=4, regex=regex, temperature=4.0, seed=s))
                for s in range(n)])
            if optimistic:
                assert engine.scheduler.info()["grammar_optimistic_refused"] > 0
        assert all(re.fullmatch(regex, r.text) for r in results)
        return collections.Counter(r.text for r in results)

    first, masked = await histogram(True), await histogram(False)
    assert len(first) >= 6  # the redraws spread over the admissible set
    distance = sum(abs(first[k] - masked[k]) for k in set(first) | set(masked)) / (2 * n)
    assert distance < 0.15, (first, masked)  # two independent 400-draw histograms differ by ~0.05-0.1


async def test_rows_that_read_their_distribution_mask_first():
    """Logprobs, top-p and top-k rows sample under the mask (the unmasked distribution
    would leak into what they read or filter)."""
    params = [SamplingParams(max_new_tokens=12, regex=REGEX, return_logprob=True),
              SamplingParams(max_new_tokens=12, regex=REGEX, temperature=0.8, top_p=0.9, seed=1),
              SamplingParams(max_new_tokens=12, regex=REGEX, temperature=0.8, top_k=5, seed=2)]
    async with Engine.from_pretrained("tiny", device="cpu", optimistic_grammar=True) as engine:
        await asyncio.gather(*[engine.generate(prompt="x:", sampling=sp) for sp in params])
        info = engine.scheduler.info()
    assert info["grammar_optimistic_tokens"] == 0 and info["grammar_optimistic_refused"] == 0, info


def test_eligibility_and_the_masked_runs():
    assert eligible(SamplingParams())
    assert eligible(SamplingParams(temperature=0.6, repetition_penalty=1.1))
    assert eligible(SamplingParams(temperature=0.0, top_p=0.5))  # greedy ignores filters
    assert not eligible(SamplingParams(temperature=0.6, top_p=0.9))
    assert not eligible(SamplingParams(temperature=0.6, min_p=0.1))
    assert not eligible(SamplingParams(return_logprob=True))
    # A row refused from its first guess masks runs at once, doubling, at most
    # LONGEST_MASKED_RUN; admitted guesses bring it back to one position per refusal.
    score, low, runs = FIRST_SCORE, 0, []
    for _ in range(10):
        score = scored(score, False)
        low = low + 1 if score < LOW_SCORE else 0
        runs.append(masked_run(score, low))
    assert runs[:4] == [2, 4, 8, 16] and runs[-1] == LONGEST_MASKED_RUN and runs == sorted(runs), runs
    for _ in range(24):
        score = scored(score, True)
    assert scored(score, False) >= LOW_SCORE  # a row mostly admitted keeps guessing through one refusal
    assert score >= LOW_SCORE and masked_run(score, 3) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("loop", LOOPS)
async def test_cuda_greedy_tokens_equal_masking_first(loop):
    """On CUDA (float32, graphs, the fused multi-step launch at its default tiers): greedy
    rows sampling first and rewound on refusals give the tokens of masking first, beside
    seeded free rows; outputs valid; no request holds KV after."""
    free = [SamplingParams(max_new_tokens=24, temperature=0.7, seed=i, ignore_eos=True) for i in range(4)]
    params = [greedy(i) for i in range(N)] + free
    limits = dict(device="cuda", dtype="float32", kv_capacity_tokens=8192)

    async def outputs(optimistic: bool, loop: str) -> tuple[list, dict]:
        async with Engine.from_pretrained("tiny", loop=loop, optimistic_grammar=optimistic, **limits) as engine:
            results = await asyncio.gather(*[engine.generate(prompt=f"code {i}:", sampling=sp) for i, sp in enumerate(params)])
            info = engine.scheduler.info()
            assert engine.scheduler.core.kv_is_fully_free()
        valid(results[:N])
        return [r.output_ids for r in results], info

    reference, _ = await outputs(False, "normal")
    tokens, info = await outputs(True, loop)
    assert tokens == reference
    assert info["grammar_optimistic_refused"] > 0 and info["grammar_optimistic_tokens"] > 0, info


async def test_a_pause_with_retraction_between_rewinds_keeps_the_tokens():
    """A pause in retract mode sends rows that sample first back to waiting mid-stream
    (their matchers where their kept tokens left them); after resume each re-prefill's
    token masks first and the rows go on: the tokens of a run without the pause.

    Greedy rows: a retracted row's next logits come from its re-prefill, a forward of
    another shape than the decode it replaces, and sampled draws follow that float noise
    (about one run in ten differed with seeded rows, on every checkout tried); greedy
    tokens are what a pause must keep."""
    params = [greedy(i) for i in range(N)]

    async def go(pause: bool) -> list:
        async with Engine.from_pretrained("tiny", device="cpu", loop="overlap", decode_steps=4,
                                          optimistic_grammar=True) as engine:
            core = engine.scheduler.core
            task = asyncio.ensure_future(asyncio.gather(*[engine.generate(prompt=f"code {i}:", sampling=sp)
                                                          for i, sp in enumerate(params)]))
            if pause:
                with anyio.fail_after(60):
                    while not core.running or min(len(r.output_ids) for r in core.running) < 8:
                        await asyncio.sleep(0.002)
                await engine.pause(mode="retract")
                assert core.num_retractions >= 1
                await engine.resume()
            results = await task
            assert engine.scheduler.info()["grammar_optimistic_refused"] > 0
            assert core.kv_is_fully_free()
        valid(results)
        return [r.output_ids for r in results]

    assert await go(True) == await go(False)


async def test_one_terminal_each_when_rows_sampling_first_abort_mid_stream():
    """Aborts of rows that sample first, with steps in flight and rewinds around them:
    exactly one terminal message per request, the others complete, no KV held after."""
    async with Engine.from_pretrained("tiny", device="cpu", loop="async_decode", decode_steps=4,
                                      optimistic_grammar=True) as engine:
        core = engine.scheduler.core
        ids = [f"r{i}" for i in range(N)]
        tasks = [asyncio.ensure_future(engine.generate(prompt=f"code {i}:", sampling=seeded(i), request_id=rid))
                 for i, rid in enumerate(ids)]
        with anyio.fail_after(60):
            while not core.running or min(len(r.output_ids) for r in core.running) < 4:
                await asyncio.sleep(0.002)
        await engine.abort(ids[1])
        await engine.abort(ids[4])
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert core.kv_is_fully_free()
    for i, out in enumerate(outcomes):
        if i in (1, 4):
            assert isinstance(out, BaseException) or out.finish_reason == "abort", out
        else:
            assert not isinstance(out, BaseException) and out.finish_reason == "stop", out


class FailsWhenTaken(FailsAt):
    """The library's matcher failing at the n-th token it admits, through ``try_consume_tokens``."""

    def try_consume_tokens(self, tokens: list[int]) -> int:
        taken = 0
        for t in tokens:  # the n-th token the grammar admits breaks it (a refused one is not taken)
            if self.real.validate_tokens([t]) != 1:
                return taken
            self.seen += 1
            if self.seen >= self.n:
                self.broken = True
                return taken
            self.real.try_consume_tokens([t])
            taken += 1
        return taken



@pytest.mark.usefixtures("llguidance")  # llguidance's lazy failure, through its matcher's validate_tokens
async def test_a_grammar_failing_while_its_row_samples_first_ends_that_request_alone(monkeypatch):
    """llguidance's lazy compilation failing at the 4th token a row's grammar admits (taken
    after sampling, or under the mask after a refusal): that request alone ends with a
    typed error after at most its first three tokens, the others complete, no request holds KV,
    and the grammar is refused at admission from then on."""
    from omni_async import errors

    failing = ("regex", "(.|\\n){4,40}")
    fail_grammar_at(monkeypatch, failing, 4, FailsWhenTaken)
    async with Engine.from_pretrained("tiny", device="cpu", loop="overlap", decode_steps=4,
                                      optimistic_grammar=True) as engine:
        others = asyncio.gather(*[engine.generate(prompt=f"code {i}:", sampling=seeded(i)) for i in range(3)])
        streamed: list[int] = []

        async def fails():
            with pytest.raises(errors.InvalidRequestError, match="failed during generation"):
                async for delta in engine.stream(prompt="x", sampling=SamplingParams(max_new_tokens=32, regex=failing[1])):
                    streamed.extend(delta.token_ids)

        results, _ = await asyncio.gather(others, fails())
        with pytest.raises(errors.InvalidRequestError, match="invalid regex"):  # refused at admission now
            await engine.generate(prompt="y", sampling=SamplingParams(max_new_tokens=8, regex=failing[1]))
        assert engine.scheduler.info()["grammar_optimistic_tokens"] > 0
        assert engine.scheduler.core.kv_is_fully_free()
    # At most the three tokens before the failing one: the step in which the grammar fails
    # delivers none of the row's tokens (an "error" outcome carries no token), so how many of
    # the three arrive depends on how the row's steps fell, which the loop's timing decides
    # (a CI run under load streamed two).
    assert len(streamed) <= 3, streamed
    valid(results)


def test_a_failure_met_while_taking_tokens_refuses_the_grammar_from_then_on():
    """``GrammarMatcher.take`` meeting the library's lazy failure tells the compiler, which
    then refuses the grammar at admission."""
    from omni_async import errors
    from omni_async.structured.grammar import GrammarCompiler
    from omni_async.text.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    compiler = GrammarCompiler(tok, tok.vocab_size, backend="llguidance")  # (its matcher's validate_tokens, wrapped)
    key = ("regex", "[a-z]{4,40}")
    m = compiler.matcher(key)
    m.handle  # its first mask computed, then the library's matcher wrapped
    m._m = FailsWhenTaken(m._m, 2)
    assert m.take(list(b"abc")) == 1 and m.failed  # (byte tokens: their ids are the bytes)
    with pytest.raises(errors.InvalidRequestError, match="invalid regex"):
        compiler.matcher(key)
    compiler.close()


async def test_a_rows_masked_runs_do_not_depend_on_the_steps_size():
    """The admission score is kept token by token whatever a step's size: a run of
    admitted guesses that lifts it back above LOW_SCORE ends the count of low refusals
    even when a refusal follows in the same step. Checked only after the whole step, a
    row sampling four forwards a step masked other positions than at one forward a
    step, and so drew other tokens (a seeded request found by a differential fuzz)."""
    sp = SamplingParams(max_new_tokens=28, temperature=0.8, seed=469, frequency_penalty=0.2, ignore_eos=True,
                        regex=r"[a-z]{2,6}( [a-z]{1,5}){0,4}\.")
    outs = []
    for k in (1, 4):
        engine = Engine.from_pretrained("tiny", loop="normal", optimistic_grammar=True, decode_steps=k, page_size=8)
        async with engine:
            outs.append((await engine.generate(input_ids=[16, 71, 84, 60, 161, 9, 158, 150, 49, 114, 230, 206], sampling=sp)).output_ids)
            assert engine.scheduler.info()["grammar_optimistic_refused"] >= 2
    assert outs[0] == outs[1]


# An array of objects that no request completes (as bench/constrained.py's): rows run to
# their length under a grammar the tiny random model ignores, so most guesses are refused.
ARRAY = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "required": ["name", "age"], "additionalProperties": False,
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 99}}}}


@pytest.mark.parametrize("loop", LOOPS)
async def test_rows_whose_guesses_are_refused_do_not_run_the_launchs_forwards_for_nothing(loop):
    """A row sampling first in a launch of k forwards keeps its tokens only up to its first
    refused one: the rest of its forwards are the device's work for nothing. A row is given
    the forwards its admission score makes likely to be kept, so where the grammar keeps
    refusing (a model that ignores it: the GPU benchmark's random weights) the device
    computes about one row-forward per kept token, as masking first does, instead of
    ~3 (eight forwards a launch); the greedy tokens stay those of masking first."""
    params = [SamplingParams(max_new_tokens=48, json_schema=ARRAY, ignore_eos=True) for _ in range(8)]

    async def outputs(optimistic: bool, loop: str) -> tuple[list, dict]:
        async with Engine.from_pretrained("tiny", device="cpu", loop=loop, decode_steps=8,
                                          optimistic_grammar=optimistic) as engine:
            results = await asyncio.gather(*[engine.generate(prompt=f"row {i}:", sampling=sp) for i, sp in enumerate(params)])
            return results, engine.scheduler.info()

    reference, _ = await outputs(False, "normal")
    results, info = await outputs(True, loop)
    assert [r.output_ids for r in results] == [r.output_ids for r in reference]
    assert info["grammar_optimistic_refused"] > 8  # the model ignores the grammar
    decode_tokens = sum(len(r.output_ids) - 1 for r in results)  # (a prefill samples each row's first)
    assert info["decode_row_forwards"] <= 1.5 * decode_tokens, (info["decode_row_forwards"], decode_tokens)
