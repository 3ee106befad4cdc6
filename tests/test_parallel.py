"""``SamplingParams(n=k)``: k completions of one prompt; and top logprobs per token."""

from __future__ import annotations

import pytest

from omni_async import Engine, SamplingParams

from .conftest import LOOPS, assert_kv_free


@pytest.mark.parametrize("loop", LOOPS)
async def test_greedy_n_gives_equal_completions(tiny_engine, loop):
    engine = tiny_engine(loop=loop)
    sp = dict(max_new_tokens=20, ignore_eos=True, return_logprob=True)
    async with engine:
        single = await engine.generate(prompt="parallel", sampling=SamplingParams(**sp))
        res = await engine.generate(prompt="parallel", sampling=SamplingParams(n=3, **sp), request_id="par")
        assert engine.open_requests == [] and engine.scheduler.active_request_ids() == []
    assert res.request_id == "par" and [o.index for o in res.outputs] == [0, 1, 2]
    for out in res.outputs:
        assert out.output_ids == single.output_ids and out.text == single.text
        assert out.finish_reason == "length" and out.output_logprobs == pytest.approx(single.output_logprobs, abs=1e-4)
    assert res.output_ids == res.outputs[0].output_ids and res.text == res.outputs[0].text
    assert single.outputs[0].output_ids == single.output_ids and single.outputs[0].text == single.text


async def test_seeded_n_gives_different_completions_deterministically(tiny_engine):
    sp = SamplingParams(n=4, max_new_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
    runs = []
    for loop in ("normal", "async_decode"):
        engine = tiny_engine(loop=loop)
        async with engine:
            runs.append(await engine.generate(prompt="seeded", sampling=sp))
            one = await engine.generate(prompt="seeded", sampling=SamplingParams(max_new_tokens=16, temperature=1.0, seed=11, ignore_eos=True))
    first, second = runs
    outs = [tuple(o.output_ids) for o in first.outputs]
    assert len(set(outs)) == 4  # k different completions
    assert outs == [tuple(o.output_ids) for o in second.outputs]  # the same again
    assert first.outputs[0].output_ids == one.output_ids  # completion 0 keeps the request's seed


async def test_stream_deltas_carry_their_index(tiny_engine):
    engine = tiny_engine()
    sp = SamplingParams(n=3, max_new_tokens=12, temperature=0.8, seed=5, ignore_eos=True)
    async with engine:
        handle = await engine.submit(prompt="indexed", sampling=sp)
        deltas = [d async for d in handle]
        res = await handle.result()
    assert {d.index for d in deltas} == {0, 1, 2}
    for out in res.outputs:
        mine = [d for d in deltas if d.index == out.index]
        assert [t for d in mine for t in d.token_ids] == out.output_ids
        assert "".join(d.text for d in mine) == out.text
        assert mine[-1].finished and sum(d.finished for d in mine) == 1
    assert_kv_free(engine)


async def test_n_with_a_stop_string_and_abort(tiny_engine):
    """One completion ends on a stop string while the others run on; aborting a request
    with several completions ends all of them once."""
    engine = tiny_engine()
    async with engine:
        base = await engine.generate(prompt="stops", sampling=SamplingParams(max_new_tokens=24, ignore_eos=True))
        stop = base.text[8:10]
        greedy = SamplingParams(n=2, max_new_tokens=24, ignore_eos=True, stop=[stop])
        res = await engine.generate(prompt="stops", sampling=greedy)
        assert all(o.finish_reason == "stop" and o.text == base.text[: base.text.find(stop)] for o in res.outputs)
        handle = await engine.submit(prompt="stops", sampling=SamplingParams(n=3, max_new_tokens=3000, ignore_eos=True), request_id="nab")
        async for _ in handle:
            break
        from omni_async.errors import RequestAbortedError

        with pytest.raises(RequestAbortedError):
            await handle.result()
        assert engine.open_requests == []
    assert_kv_free(engine)


async def test_top_logprobs_sorted_with_the_greedy_token_first(tiny_engine):
    engine = tiny_engine()
    sp = SamplingParams(max_new_tokens=10, ignore_eos=True, return_logprob=True, top_logprobs=5)
    async with engine:
        res = await engine.generate(prompt="top", sampling=sp)
        deltas = [d async for d in engine.stream(prompt="top", sampling=sp)]
    assert res.top_logprobs is not None and len(res.top_logprobs) == len(res.output_ids)
    for tok, lp, top in zip(res.output_ids, res.output_logprobs, res.top_logprobs):
        assert len(top) == 5 and top[0][0] == tok and top[0][1] == pytest.approx(lp)
        assert [p for _, p in top] == sorted((p for _, p in top), reverse=True)
    assert [t for d in deltas for t in (d.top_logprobs or [])] == res.top_logprobs
