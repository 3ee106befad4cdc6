"""Structured output and tool calls through the server, with the official ``openai``
client: ``response_format`` (json_object, json_schema), ``tools`` with every
``tool_choice``, calls parsed into ``message.tool_calls`` (whole and streamed), and the
call and its answer going back into the template on the next turn. The tool tests run on
a random-weight checkpoint whose chat template (Qwen's layout) takes tools: the grammar of
``required`` and named choices is what makes its calls well formed."""

from __future__ import annotations

import json
import urllib.request

import anyio
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from omni_async import Engine  # noqa: E402
from omni_async.server import running_server  # noqa: E402
from omni_async.server.tools import StreamParser, ToolPlan, parse_calls  # noqa: E402
from omni_async.testing import write_random_checkpoint  # noqa: E402

try:  # the engine's grammar library
    import llguidance  # noqa: F401

    HAVE_GRAMMAR = True
except ImportError:
    HAVE_GRAMMAR = False
needs_grammar = pytest.mark.skipif(not HAVE_GRAMMAR, reason="constrained decoding needs llguidance")

TOOLS_TEMPLATE = """{%- if tools %}<|system|>
You may call these tools:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|assistant|>
{{ message.content }}{% for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}

{% elif message.role == "tool" %}<|tool|> {{ message.tool_call_id }}
<tool_response>
{{ message.content }}
</tool_response>
{% else %}<|{{ message.role }}|>{% if message.name %} {{ message.name }}{% endif %}

{{ message.content }}
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "celsius": {"type": "boolean"}},
            "required": ["city", "celsius"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tools_checkpoint(tmp_path_factory):
    folder = write_random_checkpoint(tmp_path_factory.mktemp("tools") / "ckpt", seed=11)
    (folder / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return folder


async def _serve(model: str):
    engine = Engine.from_pretrained(model, loop="normal")
    server = running_server(engine, model_name="m")
    url = await server.__aenter__()
    return server, openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), url


@pytest.fixture
async def tool_server(tools_checkpoint):
    server, client, url = await _serve(str(tools_checkpoint))
    try:
        yield client, url
    finally:
        await client.close()
        await server.__aexit__(None, None, None)


@pytest.fixture
async def tiny_server():
    server, client, _ = await _serve("tiny")
    try:
        yield client
    finally:
        await client.close()
        await server.__aexit__(None, None, None)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


async def _prompt_ids(url: str, messages: list, tools: list) -> list[int]:
    body = {"model": "m", "messages": messages, "tools": tools}
    return (await anyio.to_thread.run_sync(_post, f"{url}/tokenize", body))["tokens"]


def _weather_args_ok(arguments: str) -> bool:
    args = json.loads(arguments)
    return set(args) == {"city", "celsius"} and args["city"] in ("Paris", "Rome") and isinstance(args["celsius"], bool)


async def test_tools_and_tool_messages_reach_the_template_as_transformers_renders_them(tool_server, tools_checkpoint):
    transformers = pytest.importorskip("transformers")
    _, url = tool_server
    call = {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome", "celsius": true}'}}
    messages = [
        {"role": "user", "content": "Weather?", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "21 degrees", "tool_call_id": "call_7"},
    ]
    ours = await _prompt_ids(url, messages, [WEATHER])
    hf = transformers.AutoTokenizer.from_pretrained(str(tools_checkpoint))
    # transformers takes a call's arguments as a dict (the server turns OpenAI's JSON string into one)
    hf_messages = [*messages[:1], {**messages[1], "content": "", "tool_calls": [{**call, "function": {**call["function"], "arguments": {"city": "Rome", "celsius": True}}}]}, messages[2]]
    text = hf.apply_chat_template(hf_messages, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert ours == hf.encode(text, add_special_tokens=False)
    for needed in ('"name": "get_weather"', '"arguments": {"city": "Rome", "celsius": true}', "call_7", "<|user|> ann", '"description": "The weather in a city"'):
        assert needed in text


@needs_grammar
async def test_a_named_tool_choice_round_trip(tool_server):
    client, url = tool_server
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, CLOCK], tool_choice=named, max_tokens=200, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert _weather_args_ok(call.function.arguments)
    stream = await client.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER, CLOCK], tool_choice=named, max_tokens=200, temperature=0, stream=True
    )
    streamed, reasons, content = [], [], ""
    async for chunk in stream:
        for c in chunk.choices:
            streamed += c.delta.tool_calls or []
            content += c.delta.content or ""
            reasons += [c.finish_reason] if c.finish_reason else []
    assert reasons == ["tool_calls"] and content == ""
    assert [(d.index, d.function.name, d.function.arguments) for d in streamed] == [(0, "get_weather", call.function.arguments)]
    # the next turn: the call and its answer go back into the template
    turn = [*ASK, choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = await client.chat.completions.create(model="m", messages=turn, tools=[WEATHER, CLOCK], tool_choice="none", max_tokens=5, temperature=0)
    ids = await _prompt_ids(url, turn, [WEATHER, CLOCK])
    assert second.usage.prompt_tokens == len(ids) > len(await _prompt_ids(url, ASK, [WEATHER, CLOCK]))
    rendered = bytes(i for i in ids if i < 256).decode()
    assert f"<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {call.function.arguments}}}\n</tool_call>" in rendered
    assert f"<|tool|> {call.id}\n<tool_response>\nsunny" in rendered
    assert second.choices[0].message.tool_calls is None


@needs_grammar
async def test_tool_choice_required_calls_a_listed_tool(tool_server):
    client, _ = tool_server
    res = await client.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False, max_tokens=200, temperature=0
    )
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0].function
    if call.name == "get_weather":
        assert _weather_args_ok(call.arguments)
    else:
        assert call.name == "get_time" and json.loads(call.arguments)["zone"] in ("UTC", "CET")
    free = await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=30, temperature=0)
    assert not free.choices[0].message.tool_calls  # random weights call nothing unforced
    assert "<tool_call>" not in (free.choices[0].message.content or "")


async def test_tool_requests_that_cannot_be_served_are_refused(tool_server):
    client, _ = tool_server
    with pytest.raises(openai.BadRequestError) as unknown:
        await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "nope" in unknown.value.message
    with pytest.raises(openai.BadRequestError) as both:
        await client.chat.completions.create(
            model="m", messages=ASK, tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}
        )
    assert "response_format" in both.value.message
    # the template reads a user's name but not an assistant's (though "name" is in its text)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    with pytest.raises(openai.BadRequestError) as unread:
        await client.chat.completions.create(
            model="m", messages=[*ASK, {"role": "assistant", "name": "bot", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "x"}]
        )
    assert "messages[1].name" in unread.value.message
    with pytest.raises(openai.BadRequestError) as choice_alone:
        await client.chat.completions.create(model="m", messages=ASK, tool_choice="required")
    assert "tool_choice" in choice_alone.value.message


@needs_grammar
async def test_response_format_json_object_and_json_schema(tiny_server):
    client = tiny_server
    # random weights left free inside a JSON string never close it: a bias towards '"' and
    # '}' lets them finish; the grammar alone makes what they write a JSON object
    closing = {str(ord('"')): 100, str(ord("}")): 100}
    obj = await client.chat.completions.create(
        model="m", messages=ASK, response_format={"type": "json_object"}, logit_bias=closing, max_tokens=100, temperature=0
    )
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}, "votes": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["answer", "sure", "votes"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": True}}
    for seed in range(4):
        res = await client.chat.completions.create(model="m", messages=ASK, response_format=fmt, max_tokens=100, temperature=1.0, seed=seed)
        out = json.loads(res.choices[0].message.content)
        assert set(out) == {"answer", "sure", "votes"} and out["answer"] in ("yes", "no")
        assert isinstance(out["sure"], bool) and out["votes"] in range(10)


def test_tool_calls_parse_the_same_whole_and_streamed():
    """Hermes blocks among text: the stream parser, fed in pieces of every size, finds what
    the whole-text parser finds; a block that does not parse, or names no tool, stays text."""
    plan = ToolPlan(parse=True, names=["f", "g"])
    text = (
        'Let me look. <tool_call>\n{"name": "f", "arguments": {"x": [1, 2]}}\n</tool_call>'
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call> then '
        '<tool_call>\n{"name": "g", "arguments": "{\\"y\\": \\"<tool_call>\\"}"}\n</tool_call> <tool_ca'
    )
    content, calls = parse_calls(text, plan)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": [1, 2]}), ("g", {"y": "<tool_call>"})]
    assert content == 'Let me look. <tool_call>{"name": "nope", "arguments": {}}</tool_call> then  <tool_ca'
    for size in range(1, len(text) + 1):
        parser, got, said = StreamParser(plan), [], ""
        for at in range(0, len(text), size):
            piece, new = parser.feed(text[at : at + size])
            said, got = said + piece, got + new
        said += parser.flush()
        assert [(c.name, c.arguments) for c in got] == [(c.name, c.arguments) for c in calls]
        assert said.strip() == content
    single = ToolPlan(parse=True, names=["f", "g"], parallel=False)
    assert [c.name for c in parse_calls(text, single)[1]] == ["f"]
