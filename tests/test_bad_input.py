"""Bad input gets a clear, typed error on that request alone: the loop and every other
request carry on (their tokens equal a solo run), and no KV page is left behind.

Engines run the built-in ``tiny`` model on the normal loop. Most tests submit a couple of
good requests, wait until they are generating, send the bad one, and then check the good
ones against a solo run of each.
"""

from __future__ import annotations

import asyncio
import math
import random

import anyio
import pytest

from omni_async import Engine, SamplingParams
from omni_async.backends.native.builder import build_native_stack, build_scheduler
from omni_async.config import SchedulerConfig
from omni_async.errors import (
    InvalidRequestError,
    OmniAsyncError,
    RequestAbortedError,
    RequestFailedError,
    RequestRejectedError,
    SchedulerClosedError,
)
from omni_async.messages import GenerationResult, IncomingMessage, RequestPayload
from omni_async.text.tokenizer import ByteTokenizer

from .conftest import assert_kv_free

TINY_VOCAB = ByteTokenizer.VOCAB_SIZE  # 320
TINY_CONTEXT = 4096

_rng = random.Random(5)
# Good requests: one greedy from text, one seeded sampling from ids. Seeded draws are keyed
# by (seed, index), so both must equal a solo run whatever else shares the batch.
GOOD = [
    dict(prompt="The thinker writes text; the talker speaks it.", sampling=dict(max_new_tokens=24, ignore_eos=True)),
    dict(
        input_ids=[_rng.randrange(0, 256) for _ in range(23)],
        sampling=dict(max_new_tokens=24, temperature=0.9, top_k=40, top_p=0.95, seed=1234, ignore_eos=True),
    ),
]

_SOLO: list[list[int]] = []


async def solo_outputs() -> list[list[int]]:
    """Each good request alone on a fresh engine (computed once)."""
    if not _SOLO:
        for good in GOOD:
            engine = Engine.from_pretrained("tiny", loop="normal")
            async with engine:
                res = await engine.generate(**_copy(good))
            assert_kv_free(engine)
            _SOLO.append(res.output_ids)
        assert all(len(o) == 24 for o in _SOLO)
    return _SOLO


def _copy(req: dict) -> dict:
    out = dict(req)
    out["sampling"] = SamplingParams.from_dict(req["sampling"])
    return out


async def _wait_until_generating(engine: Engine, rids: list[str], baseline: int = 0) -> None:
    """Wait until the requests are admitted and the engine has produced a token beyond
    ``baseline`` (its ``stats.tokens_out`` before they were submitted)."""
    sched = engine.scheduler
    with anyio.fail_after(30):
        while sched.stats.tokens_out <= baseline or not set(rids) <= set(sched.active_request_ids()):
            await asyncio.sleep(0.001)
    # They have many steps left: whatever is submitted now really runs alongside them.
    assert set(rids) <= set(sched.active_request_ids())


async def run_bad_among_good(engine: Engine, bad_kwargs: dict) -> BaseException | GenerationResult:
    """Submit the good requests, wait until they generate, submit the bad one, return what
    the bad request produced (its exception), and check the good ones against solo runs."""
    expected = await solo_outputs()
    handles = [await engine.submit(**_copy(g)) for g in GOOD]
    await _wait_until_generating(engine, [h.request_id for h in handles])
    try:
        outcome: BaseException | GenerationResult = await engine.generate(**bad_kwargs)
    except Exception as exc:  # what we are here to look at
        outcome = exc
    results = [await h.result() for h in handles]
    assert [r.output_ids for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)
    # The loop still serves new work after the bad request (greedy: a prefix of the solo run).
    short = _copy(GOOD[0])
    short["sampling"].max_new_tokens = 6
    after = await engine.generate(**short)
    assert after.output_ids == expected[0][:6]
    return outcome


def _ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


# (id, engine kwargs, bad request kwargs, expected type, substrings of the message)
BAD_REQUESTS = [
    ("empty-input-ids", {}, dict(input_ids=[]), InvalidRequestError, ["empty prompt"]),
    ("empty-prompt", {}, dict(prompt=""), InvalidRequestError, ["empty prompt"]),
    ("no-prompt-at-all", {}, dict(sampling=SamplingParams()), InvalidRequestError, ["empty prompt"]),
    ("negative-id", {}, dict(input_ids=[5, -1, 7]), InvalidRequestError, ["input_ids[1]", "-1", "outside the vocabulary", "[0, 320)"]),
    ("id-equal-vocab", {}, dict(input_ids=[5, 6, 320]), InvalidRequestError, ["input_ids[2]", "320", "outside the vocabulary"]),
    ("id-huge", {}, dict(input_ids=[10**12]), InvalidRequestError, ["input_ids[0]", "outside the vocabulary"]),
    ("id-float", {}, dict(input_ids=[1, 2.0]), InvalidRequestError, ["input_ids[1]", "not an int"]),
    ("id-str", {}, dict(input_ids=[1, "2"]), InvalidRequestError, ["input_ids[1]", "not an int"]),
    ("id-none", {}, dict(input_ids=[None]), InvalidRequestError, ["input_ids[0]", "not an int"]),
    ("id-bool", {}, dict(input_ids=[True, 3]), InvalidRequestError, ["input_ids[0]", "not an int"]),
    ("ids-not-a-list",
        {},
        dict(input_ids=7),
        InvalidRequestError,
        ["input_ids"]),
    (
        "over-context",
        {},
        dict(input_ids=_ids(4100), sampling=SamplingParams(max_new_tokens=200)),
        RequestRejectedError,
        ["prompt has 4100 tokens", "context length is 4096", "over by 5"],
    ),
    (
        "absurd-max-new-tokens-over-kv",
        dict(kv_capacity_tokens=256),
        dict(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=10**12)),
        RequestRejectedError,
        ["KV cache capacity 256", f"by {4096 - 256}"],
    ),
    (
        "over-kv-capacity",
        dict(kv_capacity_tokens=256),
        dict(input_ids=_ids(200), sampling=SamplingParams(max_new_tokens=100)),
        RequestRejectedError,
        ["KV cache capacity 256", "by 44", "kv_capacity_tokens"],
    ),
    ("unknown-field", {}, dict(input_ids=[1, 2], foo=1), InvalidRequestError, ["unknown request field", "foo"]),
    ("unknown-sampling-field", {}, dict(input_ids=[1, 2], sampling={"bogus": 1}), InvalidRequestError, ["unknown SamplingParams field", "bogus"]),
    ("sampling-wrong-type", {}, dict(input_ids=[1, 2], sampling=0.5), InvalidRequestError, ["sampling must be"]),
    ("prompt-and-ids", {}, dict(prompt="a", input_ids=[1]), InvalidRequestError, ["either prompt or input_ids"]),
    ("prompt-not-str", {}, dict(prompt=b"bytes"), InvalidRequestError, ["prompt must be a str"]),
    ("request-id-empty", {}, dict(input_ids=[1], request_id=""), InvalidRequestError, ["request_id"]),
]

BAD_SAMPLING = [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": -3}, "max_new_tokens"),
    ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": 1}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"),
    ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"seed": "x"}, "seed"),
]


@pytest.mark.parametrize(
    "engine_kw,bad,exc_type,parts",
    [
        pytest.param(*case.values[1:], id=case.values[0], marks=case.marks)
        if isinstance(case, type(pytest.param(None)))
        else pytest.param(*case[1:], id=case[0])
        for case in BAD_REQUESTS
    ],
)
async def test_bad_request_fails_alone(tiny_engine, engine_kw, bad, exc_type, parts):
    engine = tiny_engine(**engine_kw)
    async with engine:
        outcome = await run_bad_among_good(engine, bad)
        assert isinstance(outcome, exc_type), f"expected {exc_type.__name__}, got {outcome!r}"
        assert isinstance(outcome, OmniAsyncError)
        for part in parts:
            assert part in str(outcome), f"{part!r} not in {str(outcome)!r}"
        assert engine.scheduler.active_request_ids() == []
        assert engine.open_requests == []
    assert_kv_free(engine)


@pytest.mark.parametrize("values,name", BAD_SAMPLING, ids=[str(v) for v, _ in BAD_SAMPLING])
def test_bad_sampling_values_are_refused(values, name):
    """Directly and through from_dict: InvalidRequestError naming the field."""
    with pytest.raises(InvalidRequestError, match=f"invalid sampling: .*{name}"):
        SamplingParams(**values)
    with pytest.raises(InvalidRequestError, match=f"invalid sampling: .*{name}"):
        SamplingParams.from_dict(values)


async def test_bad_sampling_values_among_good_requests(tiny_engine):
    """Every bad sampling value, as a SamplingParams built by hand or as a dict, each
    refused on its own request while the good ones generate."""
    expected = await solo_outputs()
    engine = tiny_engine()
    async with engine:
        handles = [await engine.submit(**_copy(g)) for g in GOOD]
        await _wait_until_generating(engine, [h.request_id for h in handles])
        for values, name in BAD_SAMPLING:
            with pytest.raises(InvalidRequestError, match=name):
                await engine.generate(input_ids=[1, 2, 3], sampling=dict(values))
            with pytest.raises(InvalidRequestError, match=name):
                await engine.generate(input_ids=[1, 2, 3], sampling=SamplingParams(**values))
        assert [(await h.result()).output_ids for h in handles] == expected
        assert engine.open_requests == []
    assert_kv_free(engine)


async def test_sampling_made_invalid_after_construction_is_caught_by_the_scheduler(tiny_engine):
    """A SamplingParams mutated after validation reaches the scheduler, which validates again."""
    sp = SamplingParams(max_new_tokens=4)
    sp.top_p = 0.0
    engine = tiny_engine()
    async with engine:
        outcome = await run_bad_among_good(engine, dict(input_ids=[1, 2, 3], sampling=sp))
    assert isinstance(outcome, InvalidRequestError), repr(outcome)
    assert "top_p" in str(outcome)
    assert_kv_free(engine)


def test_sampling_from_dict_unknown_field():
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict({"bogus": 1, "max_new_tokens": 3})
    msg = str(info.value)
    assert "unknown SamplingParams field(s): bogus" in msg
    assert "max_new_tokens" in msg  # lists the known fields
    assert SamplingParams.from_dict({"max_new_tokens": 3}).max_new_tokens == 3
    assert SamplingParams.from_dict(None) == SamplingParams()


async def test_limits_are_inclusive_at_the_boundary(tiny_engine):
    """Exactly at the context length / KV capacity is served; one token more is refused by 1."""
    ids = _ids(200, seed=3)
    engine = tiny_engine(kv_capacity_tokens=256)
    async with engine:
        res = await engine.generate(input_ids=ids, sampling=SamplingParams(max_new_tokens=56, ignore_eos=True))
        assert len(res.output_ids) == 56 and res.finish_reason == "length"
        with pytest.raises(RequestRejectedError, match=r"KV cache capacity 256 by 1;"):
            await engine.generate(input_ids=ids, sampling=SamplingParams(max_new_tokens=57))
    assert_kv_free(engine)

    engine = tiny_engine(context_length=256)
    async with engine:
        res = await engine.generate(input_ids=ids, sampling=SamplingParams(max_new_tokens=56, ignore_eos=True))
        assert len(res.output_ids) == 56
        # Past the context, max_new_tokens is clamped to the room left (the request is served).
        res = await engine.generate(input_ids=ids, sampling=SamplingParams(max_new_tokens=57, ignore_eos=True))
        assert len(res.output_ids) == 56 and res.finish_reason == "length"
        with pytest.raises(RequestRejectedError, match=r"prompt has 256 tokens.*over by 1\)"):
            await engine.generate(input_ids=_ids(256, seed=4), sampling=SamplingParams(max_new_tokens=1))
    assert_kv_free(engine)


async def test_duplicate_request_id(tiny_engine):
    expected = await solo_outputs()
    engine = tiny_engine()
    async with engine:
        first = await engine.submit(**_copy(GOOD[0]), request_id="dup")
        other = await engine.submit(**_copy(GOOD[1]))
        await _wait_until_generating(engine, ["dup", other.request_id])
        with pytest.raises(RequestRejectedError, match="duplicate request id 'dup'"):
            await engine.submit(input_ids=[1, 2, 3], request_id="dup")
        with pytest.raises(RequestRejectedError, match="duplicate request id 'dup'"):
            await engine.generate(**_copy(GOOD[1]), request_id="dup")
        res = await first.result()
        assert res.request_id == "dup"
        assert res.output_ids == expected[0]
        assert (await other.result()).output_ids == expected[1]
        # Once the first has finished, the id is free again.
        again = await engine.generate(**_copy(GOOD[1]), request_id="dup")
        assert again.output_ids == expected[1]
    assert_kv_free(engine)


async def test_submit_after_close_and_requests_open_at_close(tiny_engine):
    engine = tiny_engine()
    async with engine:
        warm = await engine.generate(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=2))
        assert len(warm.output_ids) == 2
        baseline = engine.scheduler.stats.tokens_out
        long = await engine.submit(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=3000, ignore_eos=True))
        await _wait_until_generating(engine, [long.request_id], baseline)
    # Closed with the request open: it ends with SchedulerClosedError (an abort).
    with pytest.raises(SchedulerClosedError, match="closed") as info:
        await long.result()
    assert isinstance(info.value, RequestAbortedError)
    assert 0 < len(info.value.output_ids) < 3000
    # Every way in after close.
    with pytest.raises(SchedulerClosedError, match="closed"):
        await engine.submit(input_ids=[1, 2, 3])
    with pytest.raises(SchedulerClosedError, match="closed"):
        await engine.generate(input_ids=[1, 2, 3])
    with pytest.raises(SchedulerClosedError, match="closed"):
        async for _ in engine.stream(input_ids=[1, 2, 3]):
            pass
    assert_kv_free(engine)


async def test_invalid_first_request_then_clean_close(tiny_engine):
    """The very first call on a fresh engine is invalid (raised before anything awaited):
    the caller gets the typed error and the engine still closes cleanly."""
    engine = tiny_engine()
    async with engine:
        with pytest.raises(InvalidRequestError, match="empty prompt"):
            await engine.generate(prompt="")
    assert_kv_free(engine)


# ---------------------------------------------------------------- the scheduler's own door


def _fresh_scheduler():
    config = SchedulerConfig(loop="normal")
    stack = build_native_stack("tiny", config)
    return stack, build_scheduler(stack, config)


async def _read_outbox(scheduler, expected_terminals: dict[str, int], timeout: float = 30.0):
    terminals: dict[str, list] = {rid: [] for rid in expected_terminals}
    streams: dict[str, list[int]] = {}
    with anyio.fail_after(timeout):
        while any(len(terminals[r]) < n for r, n in expected_terminals.items()):
            msg = await scheduler.outbox.receive()
            if msg.type == "stream":
                streams.setdefault(msg.request_id, []).extend(msg.data.token_ids)
                continue
            assert msg.request_id in terminals, f"unexpected terminal for {msg.request_id!r}"
            terminals[msg.request_id].append(msg)
    return terminals, streams


async def test_raw_inbox_bad_payloads_get_error_messages():
    stack, scheduler = _fresh_scheduler()
    good_sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    msgs = [
        IncomingMessage("good", "new_request", RequestPayload("good", [1, 2, 3], good_sp)),
        IncomingMessage("good-dict", "new_request", {"request_id": "good-dict", "input_ids": [4, 5, 6], "sampling": {"max_new_tokens": 12, "ignore_eos": True}}),
        IncomingMessage("unknown-key", "new_request", {"request_id": "unknown-key", "input_ids": [1, 2], "foo": 1}),
        IncomingMessage("str-payload", "new_request", "hello"),
        IncomingMessage("none-payload", "new_request", None),
        IncomingMessage("int-payload", "new_request", 42),
        IncomingMessage("bogus-sampling", "new_request", {"request_id": "bogus-sampling", "input_ids": [1], "sampling": {"bogus": 1}}),
        IncomingMessage("bad-sampling", "new_request", {"request_id": "bad-sampling", "input_ids": [1], "sampling": {"top_k": -1}}),
        IncomingMessage("sampling-dict-in-payload", "new_request", RequestPayload("sampling-dict-in-payload", [1], {"max_new_tokens": 2})),
        IncomingMessage("id-mismatch", "new_request", RequestPayload("someone-else", [1, 2])),
        IncomingMessage("ids-str", "new_request", RequestPayload("ids-str", "abc")),
        IncomingMessage("ids-none", "new_request", {"request_id": "ids-none", "input_ids": None}),
        IncomingMessage("oov", "new_request", RequestPayload("oov", [1, TINY_VOCAB])),
        IncomingMessage("kind", "no_such_type", None),
        IncomingMessage("good", "new_request", RequestPayload("good", [7, 8, 9], good_sp)),  # duplicate
    ]
    expected_errors = {
        "unknown-key": (InvalidRequestError, "unknown request field(s): foo"),
        "str-payload": (InvalidRequestError, "unsupported payload type str"),
        "none-payload": (InvalidRequestError, "unsupported payload type NoneType"),
        "int-payload": (InvalidRequestError, "unsupported payload type int"),
        "bogus-sampling": (InvalidRequestError, "bogus"),
        "bad-sampling": (InvalidRequestError, "top_k"),
        "sampling-dict-in-payload": (InvalidRequestError, "sampling must be a SamplingParams"),
        "id-mismatch": (InvalidRequestError, "differs from message id"),
        "ids-str": (InvalidRequestError, "input_ids must be a list of ints"),
        "ids-none": (InvalidRequestError, "empty prompt"),
        "oov": (InvalidRequestError, "outside the vocabulary"),
        "kind": (InvalidRequestError, "unknown message type 'no_such_type'"),
    }
    async with scheduler:
        for m in msgs:
            scheduler.inbox.send_nowait(m)
        want = {rid: 1 for rid in expected_errors} | {"good": 2, "good-dict": 1}
        terminals, streams = await _read_outbox(scheduler, want)

        for rid, (etype, part) in expected_errors.items():
            (msg,) = terminals[rid]
            assert msg.type == "error", (rid, msg)
            assert type(msg.data) is etype, (rid, msg.data)
            assert part in str(msg.data), (rid, str(msg.data))

        # The duplicate is refused; the original completes.
        dup_err, good_res = terminals["good"]
        assert dup_err.type == "error" and isinstance(dup_err.data, RequestRejectedError)
        assert "duplicate request id 'good'" in str(dup_err.data)
        assert good_res.type == "result" and good_res.data.prompt_ids == [1, 2, 3]
        assert len(good_res.data.output_ids) == 12
        assert streams["good"] == good_res.data.output_ids
        (gd,) = terminals["good-dict"]
        assert gd.type == "result" and len(gd.data.output_ids) == 12

        # The same requests through a solo scheduler give the same tokens.
        assert scheduler.active_request_ids() == []
    assert stack.allocator.is_fully_free()

    stack2, solo = _fresh_scheduler()
    async with solo:
        solo.inbox.send_nowait(IncomingMessage("good", "new_request", RequestPayload("good", [1, 2, 3], SamplingParams(max_new_tokens=12, ignore_eos=True))))
        t2, _ = await _read_outbox(solo, {"good": 1})
    assert t2["good"][0].data.output_ids == good_res.data.output_ids
    assert stack2.allocator.is_fully_free()


@pytest.mark.parametrize(
    "payload",
    [
        {"input_ids": [1, 2]},  # no request_id
        {"request_id": "r", "input_ids": [1, 2], "sampling": 5},  # sampling of the wrong type
        {"request_id": "r", "input_ids": [1, 2], "sampling": ["max_new_tokens"]},
        {"request_id": "r", "input_ids": [1, 2], "metadata": 3},
        {"request_id": "r", "input_ids": {"a": 1}},
    ],
    ids=["missing-request-id", "sampling-int", "sampling-list", "metadata-int", "input-ids-dict"],
)
async def test_raw_inbox_malformed_dict_is_never_a_server_failure(payload):
    """A malformed dict payload is the caller's error (InvalidRequestError), never a
    RequestFailedError; a dict without request_id may instead be served under the
    message's id. Other requests are unaffected."""
    stack, scheduler = _fresh_scheduler()
    async with scheduler:
        scheduler.inbox.send_nowait(IncomingMessage("r", "new_request", payload))
        scheduler.inbox.send_nowait(IncomingMessage("ok", "new_request", RequestPayload("ok", [1, 2], SamplingParams(max_new_tokens=3, ignore_eos=True))))
        terminals, _ = await _read_outbox(scheduler, {"r": 1, "ok": 1})
    assert terminals["ok"][0].type == "result" and len(terminals["ok"][0].data.output_ids) == 3
    (msg,) = terminals["r"]
    if msg.type == "result":
        assert "request_id" not in payload
        assert msg.data.request_id == "r" and msg.data.prompt_ids == [1, 2]
    else:
        assert msg.type == "error"
        assert isinstance(msg.data, InvalidRequestError), f"malformed input reported as {msg.data!r}"
    assert stack.allocator.is_fully_free()


async def test_raw_inbox_dict_with_mismatched_request_id():
    stack, scheduler = _fresh_scheduler()
    seen: dict[str, list] = {}
    async with scheduler:
        scheduler.inbox.send_nowait(IncomingMessage("mine", "new_request", {"request_id": "theirs", "input_ids": [1, 2], "sampling": {"max_new_tokens": 3}}))
        scheduler.inbox.send_nowait(IncomingMessage("ok", "new_request", RequestPayload("ok", [1, 2], SamplingParams(max_new_tokens=3, ignore_eos=True))))
        with anyio.fail_after(30):
            while "ok" not in seen or not ({"mine", "theirs"} & set(seen)):
                msg = await scheduler.outbox.receive()
                if msg.type != "stream":
                    seen.setdefault(msg.request_id, []).append(msg)
    assert "theirs" not in seen, f"served under the payload's id: {seen['theirs']}"
    (msg,) = seen["mine"]
    assert msg.type == "error" and isinstance(msg.data, InvalidRequestError)
    assert "differs from message id" in str(msg.data)
    assert stack.allocator.is_fully_free()


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda sp: sp.stop_token_ids.append(-1), "stop_token_ids"),  # in place
        (lambda sp: sp.suppress_tokens.append(True), "suppress_tokens"),  # True == 1, not an id
        (lambda sp: setattr(sp, "ignore_eos", 1), "ignore_eos"),  # 1 == True, not a bool
        (lambda sp: setattr(sp, "max_new_tokens", 4.0), "max_new_tokens"),  # 4.0 == 4
        (lambda sp: sp.stop.append(""), "stop"),
        (lambda sp: sp.logit_bias.update({5: 1000.0}), "logit_bias"),
        (lambda sp: sp.json_schema.update({"x": {1, 2}}), "json_schema"),  # inside a dict: not JSON
    ],
)
def test_check_request_sees_every_change_since_validation(mutate, field):
    """Params validated once are not validated again at the door unless something they
    hold changed (``validate_if_changed``); any change, an equal value of another type
    or an edit in place included, is validated and refused with the same error as ever."""
    from omni_async.stage.request_checks import ModelLimits, check_request

    limits = ModelLimits(vocab_size=TINY_VOCAB, context_length=TINY_CONTEXT, kv_capacity_tokens=1 << 16)
    sp = SamplingParams(max_new_tokens=4, suppress_tokens=[3], stop_token_ids=[4], stop=["x"], logit_bias={2: 1.0},
                        json_schema={"type": "object"} if field == "json_schema" else None)
    check_request([1, 2, 3], sp, limits)  # passes, twice
    check_request([1, 2, 3], sp, limits)
    mutate(sp)
    with pytest.raises(InvalidRequestError, match=field):
        check_request([1, 2, 3], sp, limits)
    with pytest.raises(InvalidRequestError, match=field):  # and at every door after
        check_request([1, 2, 3], sp, limits)


@pytest.mark.parametrize("length", [5, 300])  # both sides of check_input_ids' numpy range check
@pytest.mark.parametrize(
    "bad, message",
    [
        (TINY_VOCAB, r"input_ids\[{at}\] = 320 is outside the vocabulary \[0, 320\)"),
        (-1, r"input_ids\[{at}\] = -1 is outside"),
        (1 << 70, r"input_ids\[{at}\] = 1180591620717411303424 is outside"),  # past int64
        (True, r"input_ids\[{at}\] is True, not an int"),
        (2.0, r"input_ids\[{at}\] is 2.0, not an int"),
    ],
)
def test_check_input_ids_names_the_first_bad_position(length, bad, message):
    from omni_async.stage.request_checks import check_input_ids

    ids = _ids(length, seed=length)
    ids[0], ids[1] = TINY_VOCAB - 1, 0  # the bounds are in
    assert check_input_ids(ids, TINY_VOCAB) == ids
    at = length - 2
    ids[at] = bad
    with pytest.raises(InvalidRequestError, match=message.format(at=at)):
        check_input_ids(ids, TINY_VOCAB)
