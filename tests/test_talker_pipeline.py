"""The pipeline's default talker reads the thinker's hidden states: one row per thinker
token, in order, through its projection; its tokens depend on them, are the same in every
loop, and a thinker that fails or stops ends the talker's request (nothing hangs)."""

from __future__ import annotations

import anyio
import pytest
import torch

from omni_async import Engine, RequestPayload, SamplingParams, errors
from omni_async.errors import ConfigError
from omni_async.pipeline import TwoStagePipeline
from omni_async.pipeline.colocate import HIDDEN_ROWS, build_stage_scheduler, talker_request_builder
from omni_async.stage.emission import default_stream_output_builder

from .conftest import LOOPS

BOS = 256  # the tiny model's


def thinker(loop: str, **callbacks):
    return build_stage_scheduler("tiny", loop=loop, seed=0, capture_hidden=True, callbacks=callbacks)


def talker(loop: str, record: dict | None = None):
    """A hidden-fed talker over tiny (seed 1); ``record`` gets each request's conditioning."""
    callbacks, bind = talker_request_builder(3, "hidden")
    if record is not None:
        inner = callbacks["stream_chunk_handler"]

        def on_chunk(data, chunk):
            inner(data, chunk)
            record[data.req.rid] = data.req.conditioning

        callbacks["stream_chunk_handler"] = on_chunk
    sched, stack = build_stage_scheduler("tiny", loop=loop, seed=1, conditioning_size=128, callbacks=callbacks)
    bind(sched, stack)
    return sched, stack


def payloads(rid: str, n_think: int = 12, n_talk: int = 10, prompt=(256, 72, 105)):
    return (
        RequestPayload(rid, list(prompt), SamplingParams(max_new_tokens=n_think, ignore_eos=True)),
        RequestPayload(rid, [], SamplingParams(max_new_tokens=n_talk, ignore_eos=True)),
    )


async def converse(pipe, rids, **kw):
    out = {}
    for i, rid in enumerate(rids):
        out[rid] = pipe.submit(rid, *payloads(rid, prompt=(256, 72 + i, 105), **kw))
    handles = {rid: await h for rid, h in out.items()}
    return {rid: [ev async for ev in h] for rid, h in handles.items()}


async def ended(stage, rid: str) -> bool:
    """Whether ``rid`` leaves ``stage`` (an abort ends a running request at the stage's
    next step boundary)."""
    for _ in range(1000):
        if rid not in stage.active_request_ids():
            return True
        await anyio.sleep(0.01)
    return False


def results(events):
    return {ev.stage: ev.data for ev in events if ev.kind == "result"}


@pytest.mark.parametrize("loop", LOOPS)
async def test_the_talker_gets_one_thinker_row_per_thinker_token_in_order(loop):
    record: dict = {}
    first, _ = thinker(loop)
    second, talker_stack = talker(loop, record)
    async with TwoStagePipeline(first, second) as pipe:
        events = (await converse(pipe, ["c1"], n_talk=16))["c1"]
    think = [ev.data for ev in events if ev.stage == "thinker" and ev.kind == "stream"]
    rows = torch.cat([d.hidden_states for d in think])
    res = results(events)
    n = len(res["thinker"].output_ids)
    assert rows.shape == (n, 128) and n == 12
    assert res["talker"].extra[HIDDEN_ROWS] == n
    cond = record["c1"]
    assert cond.closed and cond.available == n
    assert torch.equal(torch.cat(cond.chunks), rows)  # every row once, in the thinker's order
    # the prompt: BOS and one placeholder per row of the first three chunks
    assert res["talker"].prompt_ids == [BOS] * 4
    assert len(res["talker"].output_ids) == 16
    assert talker_stack.allocator.is_fully_free()


async def talker_tokens(adjust=None, loop: str = "normal") -> tuple[list[int], list[int]]:
    first, _ = thinker(loop)
    second, stack = talker(loop)
    if adjust is not None:
        with torch.no_grad():
            adjust(stack.loaded.model.thinker_to_talker_proj)
    async with TwoStagePipeline(first, second) as pipe:
        res = results((await converse(pipe, ["c"], n_talk=16))["c"])
    return res["talker"].output_ids, res["talker"].prompt_ids


async def test_the_talker_tokens_follow_the_thinker_hidden_states():
    plain, prompt = await talker_tokens()
    zeroed, _ = await talker_tokens(lambda p: (p.weight.zero_(), p.bias.zero_()))
    flipped, _ = await talker_tokens(lambda p: p.weight.neg_())
    async with Engine.from_pretrained("tiny", seed=1) as engine:
        alone = await engine.generate(input_ids=prompt, sampling=SamplingParams(max_new_tokens=16, ignore_eos=True))
    # a projection of zeros adds nothing: the talker alone on the same prompt
    assert zeroed == alone.output_ids
    assert plain != zeroed and plain != flipped and flipped != zeroed


async def test_three_loops_give_the_same_talker_tokens():
    got = {}
    for loop in LOOPS:
        first, _ = thinker(loop)
        second, _ = talker(loop)
        async with TwoStagePipeline(first, second) as pipe:
            convs = await converse(pipe, ["a", "b", "c"], n_think=14, n_talk=18)
        got[loop] = {rid: {stage: r.output_ids for stage, r in results(evs).items()} for rid, evs in convs.items()}
    assert got["overlap"] == got["normal"] and got["async_decode"] == got["normal"]


@pytest.mark.parametrize("loop", LOOPS)
async def test_a_thinker_failure_mid_stream_ends_the_talker_with_an_error(loop):
    count = {"n": 0}

    def breaks_mid_stream(rid, data, out):
        if rid == "bad" and out.data is not None:
            count["n"] += 1
            if count["n"] == 24:  # late enough that the talker has started (at 6 it sometimes had not)
                raise RuntimeError("thinker broke")
        return default_stream_output_builder(rid, data, out)

    first, thinker_stack = thinker(loop, stream_output_builder=breaks_mid_stream)
    second, talker_stack = talker(loop)
    async with TwoStagePipeline(first, second) as pipe:
        handle = await pipe.submit("bad", *payloads("bad", n_think=200, n_talk=200))
        talker_started = False
        with pytest.raises(errors.RequestFailedError, match="thinker broke"):
            async for ev in handle:
                talker_started |= ev.stage == "talker"
        assert talker_started  # it was waiting for rows that will never come
        good = results((await converse(pipe, ["good"]))["good"])
        assert good["talker"].extra[HIDDEN_ROWS] == 12
        assert await ended(second, "bad")
    assert talker_stack.allocator.is_fully_free() and thinker_stack.allocator.is_fully_free()


async def test_aborting_a_talker_that_waits_for_rows_ends_it():
    first, _ = thinker("overlap")
    second, talker_stack = talker("overlap")
    async with TwoStagePipeline(first, second) as pipe:
        handle = await pipe.submit("c", *payloads("c", n_think=400, n_talk=400))
        with pytest.raises(errors.RequestAbortedError):
            async for ev in handle:
                if ev.stage == "talker":
                    second.abort("c")
        assert await ended(first, "c") and await ended(second, "c")
    assert talker_stack.allocator.is_fully_free()


async def test_a_thinker_without_hidden_states_is_a_typed_error_on_that_request():
    first, _ = build_stage_scheduler("tiny", seed=0, capture_hidden=False)
    second, _ = talker("normal")
    async with TwoStagePipeline(first, second) as pipe:
        handle = await pipe.submit("c", *payloads("c", n_think=40))
        with pytest.raises(errors.InvalidRequestError, match="capture_hidden"):
            async for _ in handle:
                pass
        assert await ended(first, "c")


async def test_from_pretrained_builds_the_hidden_talker_by_default_and_keeps_the_token_talker():
    with pytest.raises(ConfigError, match="capture_hidden"):
        TwoStagePipeline.from_pretrained(capture_hidden=False)
    with pytest.raises(ConfigError, match="'hidden' or 'tokens'"):
        TwoStagePipeline.from_pretrained(talker_inputs="audio")
    pipe = TwoStagePipeline.from_pretrained(devices=("cpu", "cpu"), loop="overlap")
    assert pipe.stacks[1].loaded.model.thinker_to_talker_proj.in_features == 128
    async with pipe:
        hidden = results((await converse(pipe, ["h"]))["h"])
    assert hidden["talker"].extra[HIDDEN_ROWS] == len(hidden["thinker"].output_ids)
    pipe = TwoStagePipeline.from_pretrained(talker_inputs="tokens")
    async with pipe:
        tokens = results((await converse(pipe, ["t"]))["t"])
    assert HIDDEN_ROWS not in tokens["talker"].extra
    prompt = tokens["talker"].prompt_ids
    assert prompt[0] == BOS and prompt[1:] == tokens["thinker"].output_ids[: len(prompt) - 1]


async def test_a_thinker_shorter_than_the_deferral_still_feeds_the_talker():
    """The thinker ends after two tokens: the talker starts on its end with both rows in
    its prompt, and runs on past them (positions without a row add nothing)."""
    record: dict = {}
    first, _ = thinker("async_decode")
    second, _ = talker("async_decode", record)
    async with TwoStagePipeline(first, second) as pipe:
        res = results((await converse(pipe, ["s"], n_think=2, n_talk=12))["s"])
    assert res["talker"].prompt_ids == [BOS] * 3 and len(res["talker"].output_ids) == 12
    assert res["talker"].extra[HIDDEN_ROWS] == 2 and record["s"].closed


JSON_RECORD = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"},
                   "name": {"type": "string", "maxLength": 6}},
    "required": ["id", "ok", "name"],
    "additionalProperties": False,
}


@pytest.mark.usefixtures("llguidance")  # the schema's forced runs are llguidance's (xgrammar finds none at one forward a step)
@pytest.mark.parametrize("loop", LOOPS)
async def test_a_capturing_thinker_under_jump_forward_streams_one_row_per_token(loop):
    """``jump_forward`` appends a grammar's forced run to a row without forwards of its
    own, so no hidden state exists for those tokens when the delta goes out: a stage that
    hands every row's hidden states on (the thinker) keeps such rows token by token, each
    delta one row per token, and the hidden-fed talker reads them all."""
    sp = SamplingParams(max_new_tokens=48, json_schema=JSON_RECORD)
    prompt = [256, 72, 105]
    async with Engine.from_pretrained("tiny", loop=loop, jump_forward=True, optimistic_grammar=False) as engine:
        alone = await engine.generate(input_ids=prompt, sampling=sp)
        assert engine.scheduler.info()["grammar_jumps"] > 0  # the schema forces runs
    first, _ = build_stage_scheduler("tiny", loop=loop, seed=0, capture_hidden=True, jump_forward=True, optimistic_grammar=False)
    second, talker_stack = talker(loop)
    async with TwoStagePipeline(first, second) as pipe:
        handle = await pipe.submit("json", RequestPayload("json", prompt, sp),
                                   RequestPayload("json", [], SamplingParams(max_new_tokens=64, ignore_eos=True)))
        with anyio.fail_after(60):
            events = [ev async for ev in handle]
    think = [ev.data for ev in events if ev.stage == "thinker" and ev.kind == "stream"]
    for delta in think:
        assert delta.hidden_states is not None and delta.hidden_states.shape[0] == len(delta.token_ids)
    res = results(events)
    assert res["thinker"].output_ids == alone.output_ids  # the same tokens, token by token
    assert res["talker"].extra[HIDDEN_ROWS] == len(alone.output_ids) and len(res["talker"].output_ids) == 64
    assert talker_stack.allocator.is_fully_free()
