"""What a router reads from ``omni-async serve``: SGLang's worker endpoints
(``/get_model_info``, ``/get_server_info``, ``/get_load``, ``/flush_cache``,
``/health_generate``) and the load gauges named for vLLM's and SGLang's schedulers, on a
real server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import anyio
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from omni_async import Engine  # noqa: E402
from omni_async.server import running_server  # noqa: E402

EXTRA = {"ignore_eos": True}


def _call(url: str, method: str) -> tuple[int, str]:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def _http(url: str, method: str = "GET") -> tuple[int, str]:
    return await anyio.to_thread.run_sync(_call, url, method)


async def _json(url: str, method: str = "GET") -> tuple[int, object]:
    status, text = await _http(url, method)
    return status, json.loads(text)


async def _gauges(url: str) -> dict[str, float]:
    status, text = await _http(f"{url}/metrics")
    assert status == 200
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


@pytest.fixture
async def served():
    engine = Engine.from_pretrained("tiny", loop="normal", max_running_requests=1)
    async with running_server(engine) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        try:
            yield engine, url, client
        finally:
            await client.close()


async def test_model_and_server_info(served):
    engine, url, _ = served
    status, info = await _json(f"{url}/get_model_info")
    assert status == 200
    assert info["model_path"] == "tiny" and info["served_model_name"] == "tiny"
    assert info["is_generation"] is True and info["weight_version"] == engine.scheduler.weight_version
    status, server = await _json(f"{url}/get_server_info")
    assert status == 200
    assert server["dp_size"] == 1 and server["served_model_name"] == "tiny"
    assert server["context_length"] == engine.scheduler.limits.context_length
    assert server["load"]["num_requests_running"] == 0 and server["load"]["kv_cache_usage_perc"] == 0.0
    assert server["plan"] == json.loads(json.dumps(engine.plan.as_dict()))  # the configuration, decided once
    assert await _json(f"{url}/get_load") == (200, [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}])
    assert await _json(f"{url}/health_generate") == (200, {"status": "ok"})


async def test_load_gauges_and_flush_follow_the_requests(served):
    """One request running (held by an in-place pause), one waiting behind the limit of
    one running request: the gauges, /get_load and a refused flush say so; once both
    have finished, the flush empties the prefix cache and the KV gauge reads 0."""
    engine, url, client = served
    first = await client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=48, stream=True, extra_body=EXTRA)
    chunks = first.__aiter__()
    await chunks.__anext__()  # running now
    await engine.pause(mode="in_place")
    second = asyncio.ensure_future(client.completions.create(model="tiny", prompt="Far away", max_tokens=8, extra_body=EXTRA))
    while engine.scheduler.info()["waiting_queue_size"] < 1:
        await asyncio.sleep(0.01)
    g = await _gauges(url)
    assert g["omni_async_num_requests_running"] == 1
    assert g["omni_async_num_requests_waiting"] == 1
    assert 0.0 < g["omni_async_kv_cache_usage_perc"] <= 1.0
    status, load = await _json(f"{url}/get_load")
    assert status == 200 and load[0]["num_reqs"] == 2 and load[0]["num_waiting_reqs"] == 1 and load[0]["num_tokens"] > 0
    status, refused = await _json(f"{url}/flush_cache", "POST")
    assert status == 400 and refused["success"] is False
    await engine.resume()
    assert len("".join([c.choices[0].text async for c in chunks])) > 0
    assert (await second).usage.completion_tokens == 8
    status, flushed = await _json(f"{url}/flush_cache", "POST")
    assert status == 200 and flushed["success"] is True
    g = await _gauges(url)
    assert g["omni_async_num_requests_running"] == 0 and g["omni_async_num_requests_waiting"] == 0
    assert g["omni_async_kv_cache_usage_perc"] == 0.0
