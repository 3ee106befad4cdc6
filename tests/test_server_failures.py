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


def _samples(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


async def test_head_health_is_200(served):
    _, url, _ = served
    assert (await anyio.to_thread.run_sync(lambda: http(url, "/health", method="HEAD")))[0] == 200


async def test_a_400_from_the_stage_is_not_counted_as_an_error_finish(served):
    """A grammar that does not compile is refused (400) after submission: it is counted
    as refused, not as a request that finished with an error."""
    _, url, client = served
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}}}}
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, response_format=bad)
    m = _samples((await anyio.to_thread.run_sync(lambda: http(url, "/metrics")))[1])
    assert m.get(("omni_async_requests_total", (("finish_reason", "error"), ("model", "tiny"))), 0) == 0
    assert m[("omni_async_requests_refused_total", (("model", "tiny"), ("status", "400")))] == 1


async def test_cached_tokens_never_exceed_prompt_tokens_with_n():
    engine = Engine.from_pretrained("tiny", loop="normal", page_size=16)
    async with running_server(engine) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        prompt = "a prompt long enough to fill a few KV pages of sixteen tokens each, twice over"
        for stream in (False, True):
            kw = {"stream_options": {"include_usage": True}} if stream else {}
            res = await client.completions.create(model="tiny", prompt=[prompt, prompt + "!"], max_tokens=3, n=4, temperature=0.8, seed=1, stream=stream, extra_body={"ignore_eos": True}, **kw)
            if stream:
                chunks = [c async for c in res]
                res = chunks[-1]
            assert 0 < res.usage.prompt_tokens_details.cached_tokens <= res.usage.prompt_tokens
        await client.close()
        m = _samples((await anyio.to_thread.run_sync(lambda: http(url, "/metrics")))[1])
    assert m[("omni_async_prompt_cached_tokens_total", (("model", "tiny"),))] <= m[("omni_async_prompt_tokens_total", (("model", "tiny"),))]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_grammar_failing_at_its_first_token_is_a_400(llguidance, served, stream):
    # llguidance's lazy failure (pinned before the engine is built): xgrammar, the default
    # where installed, compiles this pattern to a counted repetition and serves it.
    _, _, client = served
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "^a{1000000}$"}}}
    for _ in range(2):
        with pytest.raises(openai.BadRequestError, match="too many"):
            res = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, response_format=fmt, stream=stream)
            if stream:
                async for _ in res:
                    pass


# ---------------------------------------------------------------- deeply nested JSON strings

DEEP = "[" * 60_000  # under the schema's 64 KiB cap, past the JSON parser's recursion limit
CALLS_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }} {{ c.function.arguments | tojson }}</call>{% endfor %}\n"
    "{% endfor %}<|assistant|>"
)


def test_a_deeply_nested_schema_string_is_an_invalid_request():
    from omni_async import SamplingParams, errors

    for text in (DEEP, "[" * 1200 + "]" * 1200, '{"a": ' * 5000 + "1" + "}" * 5000):
        with pytest.raises(errors.InvalidRequestError, match="json_schema"):
            SamplingParams(json_schema=text)


async def test_deeply_nested_json_strings_are_400s_or_text_never_500s():
    engine = Engine.from_pretrained("tiny", loop="normal")
    async with running_server(engine, chat_template=CALLS_TEMPLATE) as url:
        def post(path: str, body: dict) -> tuple[int, str]:
            return http(url, path, body)

        for path, body in [
            ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "json_schema": DEEP}),
            ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "guided_json": DEEP}),
            ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}}}),
        ]:
            status, text = await anyio.to_thread.run_sync(post, path, body)
            assert status == 400 and "json_schema" in text, (path, status, text[:300])
        for arguments in (DEEP, "[" * 990 + "]" * 990, '{"a": ' * 20_000 + "1" + "}" * 20_000):
            call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
            messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "user", "content": "and?"}]
            for path, body in [
                ("/tokenize", {"model": "tiny", "messages": messages}),
                ("/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 2}),
            ]:
                status, text = await anyio.to_thread.run_sync(post, path, body)
                assert status in (200, 400), (path, arguments[:20], status, text[:300])
                if status == 400:  # (the 60,000 brackets, kept as text, are past the context)
                    assert json.loads(text)["error"]["type"] == "invalid_request_error", text[:300]
                if path == "/tokenize":  # the arguments went into the prompt, as JSON or kept as text
                    assert status == 200, text[:300]
                    prompt = bytes(json.loads(text)["tokens"]).decode()
                    assert prompt.count("[") == arguments.count("[")
        status, text = await anyio.to_thread.run_sync(post, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert status == 200, text
