"""The OpenAI-compatible server on 127.0.0.1, driven by the official ``openai`` client.

Each test starts uvicorn in its own event loop with the built-in ``tiny`` model and shuts
it down at its end; expected outputs come from the same engine called in-process.
"""

from __future__ import annotations

import asyncio
import json

import anyio
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from omni_async import Engine, SamplingParams  # noqa: E402
from omni_async.server import running_server  # noqa: E402

from .http_client import http_get  # noqa: E402

CHAT = [{"role": "user", "content": "Hello there!"}]
EXTRA = {"ignore_eos": True}  # tiny's random weights may emit EOS early: fixed lengths
TINY = (("model", "tiny"),)  # the model label of the request metrics


@pytest.fixture
async def served():
    engine = Engine.from_pretrained("tiny", loop="normal")
    async with running_server(engine) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        try:
            yield engine, url, client
        finally:
            await client.close()


async def test_models_and_health(served):
    engine, url, client = served
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert await http_get(f"{url}/health") == (200, json.dumps({"status": "ok"}, separators=(",", ":")))


async def test_completion_whole_and_streamed_equal_the_engine(served):
    engine, _, client = served
    expected = await engine.generate(prompt="Once upon", sampling=SamplingParams(max_new_tokens=12, ignore_eos=True))
    whole = await client.completions.create(model="tiny", prompt="Once upon", max_tokens=12, temperature=0, extra_body=EXTRA)
    assert whole.choices[0].text == expected.text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(expected.prompt_ids) and whole.usage.completion_tokens == 12
    stream = await client.completions.create(model="tiny", prompt="Once upon", max_tokens=12, temperature=0, stream=True, extra_body=EXTRA)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


async def test_completion_from_token_ids_with_logprobs(served):
    engine, _, client = served
    expected = await engine.generate(input_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=4, ignore_eos=True, return_logprob=True))
    res = await client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0, logprobs=2, extra_body=EXTRA)
    lp = res.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(expected.output_logprobs, abs=1e-5)
    assert "".join(lp.tokens) == res.choices[0].text == expected.text


async def test_chat_whole_and_streamed_equal_the_engine(served):
    engine, _, client = served
    expected = await engine.generate(messages=CHAT, sampling=SamplingParams(max_new_tokens=10, ignore_eos=True))
    whole = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0, extra_body=EXTRA)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected.text
    assert whole.usage.prompt_tokens == len(expected.prompt_ids)
    stream = await client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True}, extra_body=EXTRA
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


async def test_n2_seeded(served):
    engine, _, client = served
    sp = SamplingParams(max_new_tokens=8, temperature=0.9, seed=7, n=2, ignore_eos=True)
    expected = await engine.generate(messages=CHAT, sampling=sp)
    whole = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0.9, seed=7, n=2, extra_body=EXTRA)
    assert sorted((c.index, c.message.content) for c in whole.choices) == [(o.index, o.text) for o in expected.outputs]
    stream = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0.9, seed=7, n=2, stream=True, extra_body=EXTRA)
    texts = {0: "", 1: ""}
    finishes = []
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes.append((choice.index, choice.finish_reason))
    assert texts == {o.index: o.text for o in expected.outputs}
    assert sorted(finishes) == [(0, "length"), (1, "length")]


async def test_stop_string(served):
    engine, _, client = served
    full = await engine.generate(prompt="abc", sampling=SamplingParams(max_new_tokens=20, ignore_eos=True))
    stop = full.text[4:6]
    assert len(stop) == 2
    cut = full.text[: full.text.index(stop)]
    res = await client.completions.create(model="tiny", prompt="abc", max_tokens=20, temperature=0, stop=stop, extra_body=EXTRA)
    assert (res.choices[0].text, res.choices[0].finish_reason) == (cut, "stop")
    stream = await client.completions.create(model="tiny", prompt="abc", max_tokens=20, temperature=0, stop=[stop], stream=True, extra_body=EXTRA)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_errors_answered_before_the_stream(served):
    engine, _, client = served
    with pytest.raises(openai.BadRequestError) as bad_token:
        await client.completions.create(model="tiny", prompt=[99999], max_tokens=4, stream=True)
    assert bad_token.value.status_code == 400 and "outside the vocabulary" in bad_token.value.message
    with pytest.raises(openai.BadRequestError) as over:
        await client.completions.create(model="tiny", prompt=[1] * 5000, max_tokens=4, stream=True)
    assert "context length is 4096" in over.value.message
    with pytest.raises(openai.BadRequestError) as unsupported:
        await client.completions.create(model="tiny", prompt="hi", extra_body={"prompt_logprobs": 99})
    assert "prompt_logprobs" in unsupported.value.message
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="tiny", messages=CHAT, temperature=-1, stream=True)
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="other-model", prompt="hi")
    # the server carries on
    ok = await client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body=EXTRA)
    assert ok.usage.completion_tokens == 2
    assert engine.open_requests == []


async def test_queue_full_is_429():
    engine = Engine.from_pretrained("tiny", loop="normal", max_running_requests=1, max_queued_requests=1)
    async with running_server(engine) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

        async def one() -> object:
            try:
                stream = await client.completions.create(model="tiny", prompt="x", max_tokens=400, stream=True, extra_body=EXTRA)
                return len([c async for c in stream])
            except openai.RateLimitError as exc:
                return exc

        outcomes = await asyncio.gather(*(one() for _ in range(4)))
        await client.close()
    limited = [o for o in outcomes if isinstance(o, openai.RateLimitError)]
    assert limited and len(limited) < 4
    assert all(e.status_code == 429 and "queue full" in e.message for e in limited)


async def test_closed_engine_is_503(served):
    engine, url, client = served
    await engine.aclose()
    with pytest.raises(openai.InternalServerError) as closed:
        await client.completions.create(model="tiny", prompt="hi", max_tokens=2, stream=True)
    assert closed.value.status_code == 503
    assert (await http_get(f"{url}/health"))[0] == 503


async def _wait_kv_free(engine: Engine) -> dict:
    with anyio.fail_after(20):
        while True:
            info = engine.scheduler.info()
            if not engine.open_requests and info["kv_free_pages"] == info["kv_total_pages"]:
                return info
            await asyncio.sleep(0.02)


async def test_client_disconnect_aborts_and_frees_kv(served):
    engine, url, client = served
    total = engine.scheduler.info()["kv_total_pages"]
    stream = await client.completions.create(model="tiny", prompt="a long story", max_tokens=3000, temperature=0, stream=True, extra_body=EXTRA)
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 3:
            break
    assert engine.scheduler.info()["kv_free_pages"] < total  # the request holds KV now
    await stream.close()
    await _wait_kv_free(engine)
    assert engine.scheduler.info()["tokens_out"] < 3000  # ended early, not by finishing
    _, text = await http_get(f"{url}/metrics")
    assert _samples(text)[("omni_async_requests_total", (("finish_reason", "abort"), ("model", "tiny")))] == 1


async def test_disconnect_of_a_whole_response_aborts(served):
    engine, url, client = served
    task = asyncio.create_task(
        client.completions.create(model="tiny", prompt="wait", max_tokens=3000, temperature=0, extra_body=EXTRA)
    )
    with anyio.fail_after(20):
        while not engine.open_requests:
            await asyncio.sleep(0.01)
    task.cancel()  # the client hangs up
    with pytest.raises(asyncio.CancelledError):
        await task
    await _wait_kv_free(engine)
    _, text = await http_get(f"{url}/metrics")
    assert _samples(text)[("omni_async_requests_total", (("finish_reason", "abort"), ("model", "tiny")))] == 1
    assert engine.scheduler.info()["tokens_out"] < 3000  # ended early, not by finishing


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_metrics_count_the_requests_sent(served):
    engine, url, client = served
    usages = []
    for prompt in ("one", "two words"):
        res = await client.completions.create(model="tiny", prompt=prompt, max_tokens=5, extra_body=EXTRA)
        usages.append(res.usage)
    stream = await client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=6, stream=True, stream_options={"include_usage": True}, extra_body=EXTRA
    )
    usages.append([c async for c in stream][-1].usage)
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model="tiny", prompt=[99999])
    status, text = await http_get(f"{url}/metrics")
    assert status == 200
    m = _samples(text)
    info = engine.scheduler.info()
    assert m[("omni_async_requests_total", (("finish_reason", "length"), ("model", "tiny")))] == 3
    assert m[("omni_async_prompt_tokens_total", TINY)] == sum(u.prompt_tokens for u in usages)
    assert m[("omni_async_generation_tokens_total", TINY)] == sum(u.completion_tokens for u in usages) == 16
    assert m[("omni_async_time_to_first_token_seconds_count", TINY)] == 3
    assert m[("omni_async_e2e_request_latency_seconds_count", TINY)] == 3
    assert m[("omni_async_inter_token_latency_seconds_count", TINY)] == 16 - 3
    assert m[("omni_async_kv_pages_used", ())] == 0
    assert m[("omni_async_kv_pages_total", ())] == info["kv_total_pages"]
    assert m[("omni_async_steps_total", ())] == info["steps"] > 0
    assert m[("omni_async_requests_running", ())] == 0 and m[("omni_async_requests_waiting", ())] == 0
