"""Hostile requests against the real server on 127.0.0.1 (the official ``openai`` client
and plain HTTP): each gets a clean, typed answer on that request alone."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import anyio
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from omni_async import Engine  # noqa: E402
from omni_async.server import running_server  # noqa: E402


def http(url: str, path: str, body: Any = None, method: str | None = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture
async def served():
    engine = Engine.from_pretrained("tiny", loop="normal")
    async with running_server(engine) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        try:
            yield engine, url, client
        finally:
            await client.close()


@pytest.mark.parametrize("key", ["\u00b2", "1" * 5000, "05", "-1", "999999"], ids=["superscript", "5000-digits", "leading-zero", "negative", "outside-vocab"])
async def test_bad_logit_bias_keys_are_400s_naming_the_key(served, key):
    _, url, client = served
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model="tiny", prompt="hi", max_tokens=2, logit_bias={key: 1})
    assert "logit_bias" in str(info.value) and repr(key)[1:12].strip("'") in str(info.value)
    done = await client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert done.choices[0].finish_reason in ("length", "stop")
