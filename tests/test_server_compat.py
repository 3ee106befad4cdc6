"""What vLLM and SGLang clients send, on a real server on 127.0.0.1 with the official
``openai`` client (plain HTTP where the client cannot send it): unknown and null fields,
other servers' structured-output fields, reasoning models' ``<think>`` split, tools on a
template that takes none and the Llama 3 / Mistral call formats, ``max_tokens`` past the
context, ``--api-key``, ``--chat-template``, generation_config.json defaults, /version."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from omni_async import Engine  # noqa: E402
from omni_async.server import running_server  # noqa: E402
from omni_async.testing import write_random_checkpoint  # noqa: E402
from omni_async.version import __version__  # noqa: E402

try:  # the engine's grammar library
    import llguidance  # noqa: F401

    HAVE_GRAMMAR = True
except ImportError:
    HAVE_GRAMMAR = False
needs_grammar = pytest.mark.skipif(not HAVE_GRAMMAR, reason="constrained decoding needs llguidance")

CHAT = [{"role": "user", "content": "Hello there!"}]
FIXED = {"ignore_eos": True}
# A template that thinks as Qwen3's does: the generation prompt opens <think>, or with
# enable_thinking=false writes an empty block.
THINK_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is not defined or enable_thinking %}<think>\n"
    "{% else %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
MISTRAL_TEMPLATE = "{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}{# [TOOL_CALLS] #}"
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


def _call(url: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


async def http(url: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    return await anyio.to_thread.run_sync(lambda: _call(url, method, path, body, headers))


@pytest.fixture
async def served(request):
    """(client, url) of a tiny server; parametrized indirectly with app options."""
    options = dict(getattr(request, "param", {}))
    engine = Engine.from_pretrained("tiny", loop="normal")
    async with running_server(engine, **options) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=options.get("api_key") or "unused", max_retries=0)
        try:
            yield client, url
        finally:
            await client.close()


# ---------------------------------------------------------------- 1. unknown and null fields


async def test_unknown_fields_are_ignored_with_one_warning_per_name(served, caplog):
    client, _ = served
    extra = {"store": True, "metadata": {"k": "v"}, "service_tier": "auto", "reasoning_effort": "low", "brand_new_field": 1}
    with caplog.at_level(logging.WARNING, logger="omni_async"):
        for _ in range(2):
            out = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, extra_body={**extra, **FIXED})
            assert out.usage.completion_tokens == 2
            done = await client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"brand_new_field": 1, **FIXED})
            assert done.usage.completion_tokens == 2
    warned = [r.field for r in caplog.records if r.getMessage() == "server_unknown_field_ignored"]
    assert sorted(warned) == sorted(set(warned)) and {"brand_new_field", "store", "service_tier"} <= set(warned)


async def test_null_means_not_given_for_every_optional_field(served):
    _, url = served
    nulls = {
        "n": None, "stream": None, "stream_options": None, "logprobs": None, "echo": None, "temperature": None, "top_p": None,
        "stop": None, "seed": None, "user": None, "presence_penalty": None, "frequency_penalty": None, "logit_bias": None,
        "suffix": None, "best_of": None, "top_k": None, "min_p": None, "min_tokens": None, "stop_token_ids": None,
    }
    status, body = await http(url, "POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 3, **nulls, **FIXED})
    assert status == 200 and len(body["choices"]) == 1 and body["usage"]["completion_tokens"] == 3, body
    chat_nulls = {k: v for k, v in nulls.items() if k not in ("echo", "suffix", "best_of")}
    chat_nulls.update(max_completion_tokens=None, top_logprobs=None, response_format=None, tools=None, tool_choice=None)
    status, body = await http(url, "POST", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 3, **chat_nulls, "logprobs": None, **FIXED})
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant", body


# ---------------------------------------------------------------- 2. structured output


@needs_grammar
@pytest.mark.parametrize(
    "fields",
    [
        {"regex": "(yes|no)"},  # SGLang
        {"guided_regex": "(yes|no)"},  # vLLM, older
        {"guided_choice": ["yes", "no"]},
        {"structured_outputs": {"choice": ["yes", "no"]}},  # vLLM, newer
        {"structured_outputs": {"regex": "(yes|no)"}},
        {"ebnf": 'start: "yes" | "no"'},
        {"guided_grammar": 'start: "yes" | "no"'},
        {"structured_outputs": {"grammar": 'start: "yes" | "no"'}},
        {"json_schema": json.dumps({"enum": ["yes", "no"]})},  # SGLang: a JSON string
        {"guided_json": {"enum": ["yes", "no"]}},
        {"structured_outputs": {"json": {"enum": ["yes", "no"]}}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"enum": ["yes", "no"]}}}},
    ],
)
async def test_structured_output_fields_of_other_servers_on_both_routes(served, fields):
    client, _ = served
    done = await client.completions.create(model="tiny", prompt="Answer:", max_tokens=12, extra_body=fields)
    chat = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, extra_body=fields)
    for text in (done.choices[0].text, chat.choices[0].message.content):
        assert text.strip('"') in ("yes", "no"), text


async def test_two_structured_output_fields_are_refused(served):
    client, _ = served
    with pytest.raises(openai.BadRequestError) as both:
        await client.completions.create(model="tiny", prompt="hi", max_tokens=4, extra_body={"regex": "a", "guided_choice": ["b"]})
    assert "regex" in both.value.message and "guided_choice" in both.value.message


@needs_grammar
async def test_openai_size_schemas_are_accepted_and_past_the_limit_refused_with_the_reason(served):
    """A strict 1,000-property object (OpenAI accepts 5,000) constrains the answer; 5,001
    properties are a 400 that names OpenAI's limit."""
    client, _ = served

    def flat(n: int) -> dict:
        props = {f"field_{i}": {"type": "string"} for i in range(n)}
        return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}

    fmt = {"type": "json_schema", "json_schema": {"name": "wide", "schema": flat(1_000), "strict": True}}
    out = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, response_format=fmt)
    assert out.choices[0].message.content.startswith('{"field_0": "')
    with pytest.raises(openai.BadRequestError) as over:
        await client.completions.create(model="tiny", prompt="hi", max_tokens=4, extra_body={"json_schema": flat(5_001)})
    assert "5,000 object properties" in over.value.message and "OpenAI" in over.value.message


async def test_a_bad_prompt_logprobs_is_refused_by_name(served):
    client, _ = served
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model="tiny", prompt="hi", max_tokens=1, extra_body={"prompt_logprobs": -1})
    assert refused.value.body["param"] == "prompt_logprobs"


# ---------------------------------------------------------------- 4. reasoning


@needs_grammar
@pytest.mark.parametrize("served", [dict(chat_template=THINK_TEMPLATE)], indirect=True)
async def test_reasoning_is_split_whole_and_streamed(served):
    client, _ = served
    force = {"regex": "Let me think</think>\n\nParis"}
    whole = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=40, extra_body=force)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == ("Let me think", "Paris")
    stream = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=40, stream=True, extra_body=force)
    reasoning, content = [], []
    async for chunk in stream:
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
            assert "<" not in reasoning[-1] and "/think" not in content[-1]
    assert "".join(reasoning) == "Let me think" and "".join(content).lstrip("\n") == "Paris"


@needs_grammar
@pytest.mark.parametrize("served", [dict(chat_template=THINK_TEMPLATE)], indirect=True)
async def test_chat_template_kwargs_reach_the_template(served):
    client, url = served
    force = {"regex": "Paris"}
    off = await client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=10, extra_body={**force, "chat_template_kwargs": {"enable_thinking": False}}
    )
    on = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, extra_body=force)
    # the empty block costs prompt tokens; without it the output is read as thinking
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    assert (off.choices[0].message.content, getattr(off.choices[0].message, "reasoning_content", None)) == ("Paris", None)
    assert (on.choices[0].message.content, on.choices[0].message.reasoning_content) == ("", "Paris")


# ---------------------------------------------------------------- 5. tools on any template


async def test_tools_on_a_template_without_tools_go_in_a_hermes_system_message(served):
    client, _ = served
    plain = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1)
    tooled = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1, tools=[WEATHER])
    assert tooled.usage.prompt_tokens > plain.usage.prompt_tokens + len(json.dumps(WEATHER))


@needs_grammar
@pytest.mark.parametrize("served", [dict(tool_call_parser="llama3_json")], indirect=True)
async def test_llama3_json_calls_are_parsed_whole_and_streamed(served):
    client, _ = served
    force = {"regex": '<\\|python_tag\\|>\\{"name": "get_weather", "parameters": \\{"city": "Paris"\\}\\}'}
    whole = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=80, tools=[WEATHER], extra_body=force)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    call = choice.message.tool_calls[0].function
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    stream = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=80, tools=[WEATHER], stream=True, extra_body=force)
    calls, content, reasons = [], [], []
    async for chunk in stream:
        for c in chunk.choices:
            calls.extend(c.delta.tool_calls or [])
            content.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert [c.function.name for c in calls] == ["get_weather"] and json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert "".join(content) == "" and reasons[-1] == "tool_calls"


@needs_grammar
@pytest.mark.parametrize("served", [dict(chat_template=MISTRAL_TEMPLATE)], indirect=True)
async def test_mistral_calls_are_parsed_with_the_parser_chosen_from_the_template(served):
    client, _ = served
    force = {"regex": '\\[TOOL_CALLS\\]\\[\\{"name": "get_weather", "arguments": \\{"city": "Rome"\\}\\}\\]'}
    whole = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=80, tools=[WEATHER], extra_body=force)
    call = whole.choices[0].message.tool_calls[0].function
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Rome"})


@needs_grammar
@pytest.mark.parametrize("served", [dict(chat_template=MISTRAL_TEMPLATE)], indirect=True)
async def test_mistral_text_before_the_calls_is_content_whole_and_streamed(served):
    """As vLLM answers: the words before ``[TOOL_CALLS]`` are the content, the list is the
    calls, the finish is "tool_calls"; the streamed answer says the same."""
    client, _ = served
    force = {"regex": 'Sure, let me check\\.\\[TOOL_CALLS\\]\\[\\{"name": "get_weather", "arguments": \\{"city": "Rome"\\}\\}\\]'}
    whole = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=90, tools=[WEATHER], extra_body=force)
    choice = whole.choices[0]
    assert choice.message.content == "Sure, let me check." and choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [("get_weather", {"city": "Rome"})]
    stream = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=90, tools=[WEATHER], stream=True, extra_body=force)
    calls, content, reasons = [], [], []
    async for chunk in stream:
        for c in chunk.choices:
            calls.extend(c.delta.tool_calls or [])
            content.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert "".join(content) == "Sure, let me check." and reasons[-1] == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Rome"})]


def test_mistral_split_is_the_same_whole_and_streamed_at_every_cut():
    from omni_async.server.tool_parsers import ToolStream, parse_output
    from omni_async.server.tools import ToolPlan

    plan = ToolPlan(tools=[WEATHER], parse=True, names=["get_weather"])
    call = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "C"}}]'
    for text in ("Sure, let me check." + call, " " + call, call, "no call [TOOL_CALLS] not json", "words [TOOL_", "[TOOL_CALLS][TOOL_CALLS]"):
        content, calls = parse_output(text, plan, "mistral")
        for cut in range(len(text) + 1):
            parser = ToolStream(plan, "mistral")
            parts = [parser.feed(text[:cut]), parser.feed(text[cut:]), parser.finish()]
            assert "".join(p[0] for p in parts) == content, (text, cut)
            assert [c.arguments for p in parts for c in p[1]] == [c.arguments for c in calls], (text, cut)
    assert parse_output("Sure, let me check." + call, plan, "mistral")[0] == "Sure, let me check."


# ---------------------------------------------------------------- 6. limits


async def test_max_tokens_beyond_the_context_is_context_length_exceeded(served):
    client, _ = served
    for create in (
        lambda: client.completions.create(model="tiny", prompt="hi", max_tokens=100_000),
        lambda: client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=100_000),
        lambda: client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=100_000),
        lambda: client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=100_000),
    ):
        with pytest.raises(openai.BadRequestError) as over:
            await create()
        assert over.value.code == "context_length_exceeded" and "context length" in over.value.message


# ---------------------------------------------------------------- 7. server options


@pytest.mark.parametrize("served", [dict(api_key="sk-test")], indirect=True)
async def test_api_key_is_required_except_on_health(served):
    client, url = served
    assert (await client.completions.create(model="tiny", prompt="hi", max_tokens=1)).choices
    wrong = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0)
    try:
        with pytest.raises(openai.AuthenticationError):
            await wrong.completions.create(model="tiny", prompt="hi", max_tokens=1)
        with pytest.raises(openai.AuthenticationError):
            await wrong.models.list()
    finally:
        await wrong.close()
    assert (await http(url, "POST", "/tokenize", {"model": "tiny", "prompt": "hi"}))[0] == 401
    assert (await http(url, "GET", "/health"))[0] == 200
    assert await http(url, "GET", "/version") == (200, {"version": __version__})


async def test_chat_template_from_a_file(tmp_path: Path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}Q: {{ m.content }}\n{% endfor %}A:")
    engine = Engine.from_pretrained("tiny", loop="normal")
    async with running_server(engine, chat_template=str(path)) as url:
        status, body = await http(url, "POST", "/tokenize", {"model": "tiny", "messages": CHAT})
    assert status == 200 and bytes(body["tokens"]).decode() == "Q: Hello there!\nA:"


async def test_generation_config_gives_the_defaults_a_request_leaves_unset(tmp_path: Path):
    folder = write_random_checkpoint(tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_p": 0.9}))
    engine = Engine.from_pretrained(str(folder), loop="normal")
    async with running_server(engine) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        try:
            def run(**kw: Any) -> Any:
                return client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=12, extra_body=FIXED, **kw)

            defaulted = [(await run(seed=s)).choices[0].text for s in (1, 2, 3)]
            greedy = (await run(temperature=0)).choices[0].text
            sampled = {(await run(seed=s, temperature=1.0)).choices[0].text for s in (1, 2, 3)}
        finally:
            await client.close()
    assert defaulted == [greedy] * 3  # temperature 0 from the file
    assert len(sampled) > 1  # a request's own temperature wins


# ---------------------------------------------------------------- the parsers, piece by piece


def test_reasoning_split_holds_a_tag_cut_across_deltas():
    from omni_async.server.reasoning import ReasoningSplitter, split_whole

    text = "<think>plan it</think>\n\nthe answer"
    assert split_whole(text, inside=False) == ("plan it", "the answer")
    assert split_whole("no thinking here", inside=False) == (None, "no thinking here")
    assert split_whole("still thinking", inside=True) == ("still thinking", "")
    for cut in range(1, len(text)):
        splitter = ReasoningSplitter(inside=False)
        parts = [splitter.feed(text[:cut]), splitter.feed(text[cut:]), splitter.flush()]
        assert "".join(p[0] for p in parts) == "plan it" and "".join(p[1] for p in parts).lstrip("\n") == "the answer"


def test_llama3_and_mistral_outputs_parse_to_calls():
    from omni_async.server.tool_parsers import ToolStream, parse_output
    from omni_async.server.tools import ToolPlan

    plan = ToolPlan(tools=[WEATHER], parse=True, names=["get_weather"])
    two = '{"name": "get_weather", "parameters": {"city": "A"}}; {"name": "get_weather", "parameters": {"city": "B"}}'
    content, calls = parse_output(two, plan, "llama3_json")
    assert content == "" and [json.loads(c.arguments)["city"] for c in calls] == ["A", "B"]
    assert parse_output('{"name": "unknown", "parameters": {}}', plan, "llama3_json") == ('{"name": "unknown", "parameters": {}}', [])
    mistral = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "C"}}]'
    assert [c.name for c in parse_output(mistral, plan, "mistral")[1]] == ["get_weather"]
    assert parse_output("plain words", plan, "mistral") == ("plain words", [])
    stream = ToolStream(plan, "llama3_json")
    assert stream.feed("Hello") == ("Hello", []) and stream.feed(" there") == (" there", [])
    held = ToolStream(plan, "mistral")
    assert held.feed("[TOOL_") == ("", []) and held.feed(mistral[6:]) == ("", [])
    rest, calls = held.finish()
    assert rest == "" and json.loads(calls[0].arguments) == {"city": "C"}
