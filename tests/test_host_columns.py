"""The host path's column forms agree with the per-row rules they replace.

A step's length limits are computed once per step for all its rows
(``core.request.decode_limits`` / ``landing_limits``); ``Request.tokens_left`` stays the
rule. These tests hold the two equal over random request states, including tokens in
flight and prompts near the context's end."""

from __future__ import annotations

import random

from omni_async.config import SamplingParams
from omni_async.core.request import Request, decode_limits, landing_limits


def random_requests(rng: random.Random, n: int, ctx: int) -> list[Request]:
    reqs = []
    for i in range(n):
        prompt = [3] * rng.randint(1, ctx - 1)
        req = Request(f"r{i}", prompt, SamplingParams(max_new_tokens=rng.randint(1, 64)))
        req.output_ids = [4] * rng.randint(0, 40)
        req.num_inflight = rng.choice([0, 0, 1, 3, 8, 16])
        reqs.append(req)
    return reqs


def test_decode_limits_equal_tokens_left_when_scheduling():
    rng = random.Random(0)
    for ctx in (64, 128, 2048):
        reqs = random_requests(rng, 300, ctx)
        assert decode_limits(reqs, ctx) == [r.tokens_left(ctx, scheduling=True) for r in reqs]


def test_landing_limits_equal_tokens_left_once_the_step_landed():
    rng = random.Random(1)
    for ctx in (64, 128, 2048):
        reqs = random_requests(rng, 300, ctx)
        landing = [rng.randint(0, r.num_inflight) for r in reqs]
        got = landing_limits(reqs, landing, ctx)
        want = []
        for r, n in zip(reqs, landing):
            r.num_inflight -= n  # what processing does before it checks the limit
            want.append(r.tokens_left(ctx, scheduling=False))
        assert got == want


# ---------------------------------------------------------------- the columns sink

import anyio  # noqa: E402
import pytest  # noqa: E402

from omni_async import IncomingMessage, RequestPayload  # noqa: E402
from omni_async.backends.native.builder import build_native_stack, build_scheduler  # noqa: E402
from omni_async.config import SchedulerConfig  # noqa: E402

from .conftest import LOOPS  # noqa: E402

LIMITS = [5, 9, 14, 3, 11, 7]


async def _serve(loop: str, columns: bool) -> tuple[list, dict[str, list[int]], dict[str, list], bool]:
    """Six requests through a scheduler whose output goes to a recording sink (with a
    columns sink when ``columns``): the deliveries, each request's streamed tokens, its
    terminal messages, and whether the KV ended fully free."""
    config = SchedulerConfig(loop=loop)
    stack = build_native_stack("tiny", config)
    sched = build_scheduler(stack, config)
    deliveries: list = []  # (StepTokens or None, messages)
    streamed: dict[str, list[int]] = {f"r{i}": [] for i in range(len(LIMITS))}
    terminals: dict[str, list] = {rid: [] for rid in streamed}
    done = anyio.Event()

    def take(tokens, messages):
        deliveries.append((tokens, list(messages)))
        if tokens is not None:
            for rid, toks, reason in zip(tokens.request_ids, tokens.token_ids, tokens.finish_reasons):
                assert not terminals[rid], "a row after its request's terminal message"
                streamed[rid] += toks
        for msg in messages:
            if msg.type == "stream":
                assert not terminals[msg.request_id]
                streamed[msg.request_id] += msg.data.token_ids
            else:
                terminals[msg.request_id].append(msg)
        if all(terminals.values()):
            done.set()

    sched.attach_output_sink(lambda msgs: take(None, msgs), columns=take if columns else None)
    async with anyio.create_task_group() as tg:
        tg.start_soon(sched.run)
        for i, n in enumerate(LIMITS):
            sp = SamplingParams(max_new_tokens=n, ignore_eos=True, return_logprob=i % 2 == 0)
            await sched.inbox.send(IncomingMessage(f"r{i}", "new_request", RequestPayload(f"r{i}", [i + 3, 7, 9, 11], sp)))
        await done.wait()
        await sched.aclose()
    return deliveries, streamed, terminals, stack.allocator.is_fully_free()


@pytest.mark.parametrize("loop", LOOPS)
async def test_a_step_reaches_the_columns_sink_as_one_set_of_columns(loop):
    deliveries, streamed, terminals, kv_free = await _serve(loop, columns=True)
    # A decode step of several rows is one StepTokens, and no plain row became a message.
    assert any(tokens is not None and len(tokens) > 1 for tokens, _ in deliveries)
    assert not any(msg.type == "stream" for _, msgs in deliveries for msg in msgs)
    for i, n in enumerate(LIMITS):
        rid = f"r{i}"
        assert len(terminals[rid]) == 1 and terminals[rid][0].type == "result"
        assert streamed[rid] == terminals[rid][0].data.output_ids and len(streamed[rid]) == n
    ends = [(rid, reason) for tokens, _ in deliveries if tokens is not None
            for rid, reason in zip(tokens.request_ids, tokens.finish_reasons) if reason is not None]
    assert sorted(ends) == sorted((f"r{i}", "length") for i in range(len(LIMITS)))
    assert kv_free
    # The message form of the same run: the same tokens, one terminal each.
    _, streamed_msgs, terminals_msgs, _ = await _serve(loop, columns=False)
    assert streamed_msgs == streamed
    assert all(len(t) == 1 for t in terminals_msgs.values())


# ---------------------------------------------------------------- the engine's router on columns


async def _stream_all(engine, lag: bool) -> list[tuple]:
    """Six requests streamed (two with n=2, logprobs on half): per request each
    completion's streamed ids and logprobs, the number of deltas, and the result's."""
    from omni_async import SamplingParams as SP

    async def one(i: int, n: int) -> tuple:
        sp = SP(max_new_tokens=n, ignore_eos=True, return_logprob=i % 2 == 0, n=2 if i % 3 == 0 else 1,
                temperature=0.8 if i % 3 == 0 else 0.0, seed=i)
        handle = await engine.submit(input_ids=[i + 3, 7, 9, 11], sampling=sp)
        if lag:
            await handle.result()  # every step's rows merge into one pending delta per completion
        ids: dict[int, list[int]] = {}
        lps: dict[int, list[float]] = {}
        deltas = 0
        async for d in handle:
            deltas += 1
            ids.setdefault(d.index, []).extend(d.token_ids)
            lps.setdefault(d.index, []).extend(d.logprobs or [])
        res = await handle.result()
        got = [(ids.get(c.index, []), lps.get(c.index, []) or None) for c in res.outputs]
        want = [(c.output_ids, c.output_logprobs) for c in res.outputs]
        return got, want, deltas, [c.finish_reason for c in res.outputs]

    import asyncio

    return await asyncio.gather(*(one(i, n) for i, n in enumerate(LIMITS)))


@pytest.mark.parametrize("loop", LOOPS)
async def test_the_engine_without_a_tokenizer_streams_what_it_returns(loop):
    """The engine's router takes a step's plain rows as columns: what a reader that keeps
    up and one that comes after the end see adds up to the result (n>1, logprobs,
    multi-step rows), and both equal the tokens of the message path (the scheduler's
    own outbox form)."""
    from omni_async import Engine

    runs = {}
    for lag in (False, True):
        engine = Engine.from_pretrained("tiny", loop=loop, decode_steps=3)
        engine.tokenizer = None
        assert engine.scheduler.emission.columns_sink is None
        async with engine:
            assert engine.scheduler.emission.columns_sink is not None
            runs[lag] = await _stream_all(engine, lag)
        assert engine.stack.allocator.is_fully_free()
    for lag, outs in runs.items():
        for (got, want, deltas, reasons), n in zip(outs, LIMITS):
            assert got == want and all(len(ids) == n for ids, _ in got) and reasons == ["length"] * len(got)
            if lag:
                assert deltas == len(got)  # one merged delta per completion
    assert [o[1] for o in runs[False]] == [o[1] for o in runs[True]]
    _, streamed_msgs, _, _ = await _serve(loop, columns=False)
    assert [runs[False][i][1][0][0] for i in (1, 2, 4, 5)] == [streamed_msgs[f"r{i}"] for i in (1, 2, 4, 5)]
