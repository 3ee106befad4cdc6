"""``POST /v1/responses`` with the official ``openai`` client's ``responses.create``
(plain, streamed, a function tool and its result, structured output) against a real
server, and the tokenizer routes as vLLM serves them (``/tokenizer_info``; ``/tokenize``
and ``/detokenize`` without ``model``)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import anyio
import pydantic
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from omni_async import Engine, SamplingParams  # noqa: E402
from omni_async.server import running_server  # noqa: E402

try:  # the engine's grammar library
    import llguidance  # noqa: F401

    HAVE_GRAMMAR = True
except ImportError:
    HAVE_GRAMMAR = False
needs_grammar = pytest.mark.skipif(not HAVE_GRAMMAR, reason="constrained decoding needs llguidance")

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture
async def served():
    engine = Engine.from_pretrained("tiny", loop="normal")
    server = running_server(engine, model_name="tiny")
    url = await server.__aenter__()
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    try:
        yield engine, client, url
    finally:
        await client.close()
        await server.__aexit__(None, None, None)


def _call(url: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


async def test_a_plain_response_is_the_chat_answer(served):
    engine, client, _ = served
    res = await client.responses.create(model="tiny", input="Say hi", instructions="Be brief.", max_output_tokens=12, temperature=0)
    chat = await client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}], max_tokens=12, temperature=0
    )
    assert res.object == "response" and res.id.startswith("resp_") and res.model == "tiny"
    assert res.output_text == chat.choices[0].message.content != ""
    [item] = res.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert res.usage.input_tokens == chat.usage.prompt_tokens and res.usage.output_tokens == chat.usage.completion_tokens
    assert res.usage.total_tokens == res.usage.input_tokens + res.usage.output_tokens
    # cut by max_output_tokens: incomplete, as OpenAI says it
    if chat.choices[0].finish_reason == "length":
        assert res.status == "incomplete" and res.incomplete_details.reason == "max_output_tokens"
    else:
        assert res.status == "completed"
    # input as message items, with text parts and an earlier answer sent back as output items
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Say hi"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed", "content": [{"type": "output_text", "text": "hi", "annotations": []}]},
        {"role": "user", "content": "again"},
    ]
    again = await client.responses.create(model="tiny", input=items, max_output_tokens=4, temperature=0)
    expected = await engine.generate(
        messages=[{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}],
        sampling=SamplingParams(max_new_tokens=4, temperature=0),
    )
    assert again.output_text == expected.text
    assert engine.open_requests == []


async def test_a_streamed_response_sends_the_typed_events_in_order(served):
    _, client, _ = served
    whole = await client.responses.create(model="tiny", input="Tell me more", max_output_tokens=16, temperature=0)
    stream = await client.responses.create(model="tiny", input="Tell me more", max_output_tokens=16, temperature=0, stream=True)
    events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", f"response.{whole.status}"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas and "".join(deltas) == whole.output_text
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert done.output_text == whole.output_text and done.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.id == done.id


@needs_grammar
async def test_a_function_tool_round_trip(served):
    _, client, url = served
    first = await client.responses.create(
        model="tiny", input="Weather in Paris?", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
        max_output_tokens=200, temperature=0,
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    # streamed: the same call, in its events
    stream = await client.responses.create(
        model="tiny", input="Weather in Paris?", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
        max_output_tokens=200, temperature=0, stream=True,
    )
    events = [e async for e in stream]
    args_done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, e.arguments) for e in args_done] == [("get_weather", call.arguments)]
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [(i.type, i.arguments) for i in added] == [("function_call", "")]
    assert events[-1].type == "response.completed"
    # the agent's second turn: the call and its output sent back as items
    turn = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    second = await client.responses.create(model="tiny", input=turn, tools=[WEATHER], max_output_tokens=6, temperature=0)
    assert second.status in ("completed", "incomplete") and second.usage.input_tokens > first.usage.input_tokens
    status, rendered = await anyio.to_thread.run_sync(_call, url, "/tokenize", {
        "messages": [turn[0], {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}],
        "tools": [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters", "strict")}}],
    })
    assert status == 200 and rendered["count"] == second.usage.input_tokens


@needs_grammar
async def test_structured_output_through_text_format(served):
    _, client, _ = served
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    res = await client.responses.create(
        model="tiny", input="Answer in JSON", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
    )
    assert isinstance(json.loads(res.output_text)["ok"], bool)
    assert res.text.format.type == "json_schema"

    class Answer(pydantic.BaseModel):
        ok: bool

    parsed = await client.responses.parse(model="tiny", input="Answer in JSON", max_output_tokens=40, temperature=0, text_format=Answer)
    assert isinstance(parsed.output_parsed, Answer)


async def test_what_cannot_be_served_is_refused_by_name(served):
    engine, client, _ = served
    for kw, needle in (
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input_image"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ):
        args = {"model": "tiny", "input": "hi", "max_output_tokens": 2, **kw}
        with pytest.raises(openai.BadRequestError) as bad:
            await client.responses.create(**args)
        assert needle in bad.value.message, bad.value.message
    with pytest.raises(openai.BadRequestError) as long:
        await client.responses.create(model="tiny", input="hi", max_output_tokens=10**6)
    assert "max_output_tokens" in long.value.message
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model="other", input="hi")
    ok = await client.responses.create(model="tiny", input="hi", max_output_tokens=2, store=True, include=[], truncation="auto")
    assert ok.store is False and engine.open_requests == []


async def test_tokenizer_routes_as_vllm_serves_them(served):
    engine, _, url = served
    status, info = await anyio.to_thread.run_sync(_call, url, "/tokenizer_info")
    assert status == 200
    assert info["tokenizer_class"] == type(engine.tokenizer).__name__ and info["chat_template"] == engine.tokenizer.chat_template
    assert info["model_max_length"] == engine.scheduler.limits.context_length and info["vocab_size"] == engine.tokenizer.vocab_size
    status, tokens = await anyio.to_thread.run_sync(_call, url, "/tokenize", {"prompt": "héllo", "add_special_tokens": False, "return_token_strs": True})
    assert status == 200 and tokens["tokens"] == engine.tokenizer.encode("héllo", add_special_tokens=False)
    assert tokens["count"] == len(tokens["tokens"]) and len(tokens["token_strs"]) == tokens["count"]
    status, text = await anyio.to_thread.run_sync(_call, url, "/detokenize", {"tokens": tokens["tokens"]})
    assert status == 200 and text["prompt"] == "héllo"
    status, wrong = await anyio.to_thread.run_sync(_call, url, "/detokenize", {"model": "other", "tokens": [1]})
    assert status == 404 and wrong["error"]["code"] == "model_not_found"
