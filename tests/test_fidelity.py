"""Behaviours of the threaded design this stage replaces that users rely on."""

from __future__ import annotations

import anyio
import torch

from omni_async import IncomingMessage, SamplingParams, errors
from omni_async.stage.emission import default_result_adapter

from .test_admission import Stage


async def test_kv_guard_rejects_what_can_never_fit_even_without_enforced_limits():
    """A builder that does not enforce request limits still cannot admit a request
    larger than the whole KV cache (it would hold the KV and starve everyone)."""
    holder = {}

    def builder(payload):
        data = holder["s"].sched.default_request_builder(payload)
        data.enforce_request_limits = False
        return data

    async with Stage(kv_capacity_tokens=256, request_builder=builder) as st:
        holder["s"] = st
        await st.send("huge", ids=(1, 2, 3), n=1000)
        await st.send("small", ids=(4, 5), n=8)
        huge, small = await st.done("huge", "small")
        assert huge.type == "error" and isinstance(huge.data, errors.RequestRejectedError)
        assert "KV cache capacity 256" in str(huge.data)
        assert small.type == "result" and len(small.data.output_ids) == 8


async def test_enforced_limits_clamp_max_new_tokens_to_the_context():
    async with Stage(context_length=64) as st:
        await st.send("long", ids=tuple(range(1, 41)), n=500)
        (msg,) = await st.done("long")
        assert msg.type == "result" and len(msg.data.output_ids) == 24 and msg.data.finish_reason == "length"


async def test_tensor_update_applies_while_requests_run(tiny_engine):
    engine = tiny_engine()
    async with engine:
        handle = await engine.submit(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=200, ignore_eos=True))
        before = (await engine.weights_checker())["data"]["checksum"]
        res = await engine.update_weights_from_tensor([("model.norm.weight", torch.full((128,), 2.0))])
        assert res["success"], res
        assert (await engine.weights_checker())["data"]["checksum"] != before
        assert not handle.done, "a tensor update must not abort or wait for running requests"
        assert len((await handle.result()).output_ids) == 200


async def test_deferred_request_is_rechecked_only_when_the_hook_says_so():
    checks = []

    def ready(payload, done):
        checks.append(len(payload.prefetched_chunks))
        return len(payload.prefetched_chunks) >= 2

    async with Stage(request_build_ready=ready, recheck_on_chunk=lambda rid, chunk: chunk != "ignored") as st:
        await st.send("d", n=3)
        await anyio.sleep(0.05)
        await st.sched.inbox.send(IncomingMessage("d", "stream_chunk", "ignored"))
        await anyio.sleep(0.05)
        assert checks == [0], "a chunk the hook declined triggered a re-check"
        await st.sched.inbox.send(IncomingMessage("d", "stream_chunk", "real"))
        (msg,) = await st.done("d")
        assert msg.type == "result" and checks == [0, 2]


async def test_input_embeddings_are_dropped_with_the_result():
    seen = []
    holder = {}

    def builder(payload):
        data = holder["s"].sched.default_request_builder(payload)
        data.input_embeds = torch.ones(3, 128)  # the tiny model's hidden size: the prefill reads them
        data.decode_input_embeds = torch.ones(1, 8)
        seen.append(data)
        return data

    async with Stage(request_builder=builder, result_adapter=default_result_adapter) as st:
        holder["s"] = st
        await st.send("e", n=3)
        (msg,) = await st.done("e")
        assert msg.type == "result"
    assert seen and seen[0].input_embeds is None and seen[0].decode_input_embeds is None
