"""An agent's conversation through the server with the official ``openai`` client, on
``tiny``, whose chat template reads neither ``tools`` nor ``tool_calls`` (the path
SmolLM2's template takes, the default model's): the tool prompt joins the caller's own
system message, the call and its result go back as Hermes text (``<tool_call>`` after the
assistant's text, ``<tool_response>`` in a user turn), and an answer sent back as the
client dumped it (``refusal: null`` and the other null fields) is taken. A template that
reads ``tool_calls`` but prints no call id (as Qwen's) takes tool results too."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import anyio
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from omni_async import Engine  # noqa: E402
from omni_async.server import running_server  # noqa: E402
from omni_async.testing import write_random_checkpoint  # noqa: E402

try:  # the engine's grammar library
    import llguidance  # noqa: F401

    HAVE_GRAMMAR = True
except ImportError:
    HAVE_GRAMMAR = False
needs_grammar = pytest.mark.skipif(not HAVE_GRAMMAR, reason="constrained decoding needs llguidance")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
SYSTEM = {"role": "system", "content": "You are a weather bot."}
ASK = {"role": "user", "content": "What is the weather in Paris?"}

# Qwen2.5's way with tool turns: calls from tool_calls, results in order (no call id printed)
QWEN_LIKE = """{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|assistant|>
{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}
{% elif message.role == "tool" %}<|user|>
<tool_response>
{{ message.content }}
</tool_response>
{% else %}<|{{ message.role }}|>
{{ message.content }}
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% endif %}"""


async def _serve(model: str):
    engine = Engine.from_pretrained(model, loop="normal")
    server = running_server(engine, model_name="m")
    url = await server.__aenter__()
    return server, openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), url


@pytest.fixture
async def tiny_server():
    server, client, url = await _serve("tiny")
    try:
        yield client, url
    finally:
        await client.close()
        await server.__aexit__(None, None, None)


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


async def _prompt_text(url: str, messages: list, tools: list | None = None) -> str:
    """The prompt the server renders for ``messages`` (``/tokenize``, then ``/detokenize``)."""
    body = {"model": "m", "messages": messages, **({"tools": tools} if tools else {})}
    status, tokens = await anyio.to_thread.run_sync(_post, f"{url}/tokenize", body)
    assert status == 200, tokens
    status, text = await anyio.to_thread.run_sync(_post, f"{url}/detokenize", {"model": "m", "tokens": tokens["tokens"]})
    assert status == 200, text
    return text["prompt"]


async def test_a_system_message_and_tools_on_a_template_without_tools(tiny_server):
    client, url = tiny_server
    res = await client.chat.completions.create(model="m", messages=[SYSTEM, ASK], tools=[WEATHER], max_tokens=4, temperature=0)
    assert res.choices[0].finish_reason in ("stop", "length", "tool_calls")
    streamed = await client.chat.completions.create(model="m", messages=[SYSTEM, ASK], tools=[WEATHER], max_tokens=4, temperature=0, stream=True)
    reasons = [c.finish_reason async for chunk in streamed for c in chunk.choices if c.finish_reason]
    assert len(reasons) == 1
    prompt = await _prompt_text(url, [SYSTEM, ASK], [WEATHER])
    # one system turn: the caller's instructions, then the tool prompt
    assert prompt.count("<|system|>") == 1
    system_turn = prompt.split("<|user|>")[0]
    assert system_turn.index("You are a weather bot.") < system_turn.index('"name": "get_weather"')
    assert "<tool_call>" in system_turn


@needs_grammar
async def test_a_two_turn_agent_loop_on_a_template_without_tool_turns(tiny_server):
    client, url = tiny_server
    first = await client.chat.completions.create(
        model="m", messages=[SYSTEM, ASK], tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=200, temperature=0
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    # sent back as the client gives it: refusal, annotations, audio, function_call all null
    sent_back = choice.message.model_dump()
    assert sent_back["refusal"] is None and "annotations" in sent_back
    turn = [SYSTEM, ASK, sent_back, {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    second = await client.chat.completions.create(model="m", messages=turn, tools=[WEATHER], max_tokens=8, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.choices[0].message.content is not None
    prompt = await _prompt_text(url, turn, [WEATHER])
    block = f'<tool_call>\n{{"name": "get_weather", "arguments": {call.function.arguments}}}\n</tool_call>'
    assert f"<|assistant|>\n{block}\n<|user|>\n<tool_response>\nsunny, 24 C\n</tool_response>\n<|assistant|>\n" in prompt
    # streamed, the same conversation is served too
    stream = await client.chat.completions.create(model="m", messages=turn, tools=[WEATHER], max_tokens=8, temperature=0, stream=True)
    text = "".join([c.delta.content or "" async for chunk in stream for c in chunk.choices])
    assert text == second.choices[0].message.content


async def test_tool_turns_as_text_keep_the_assistant_text_and_merge_a_run_of_results(tiny_server):
    _, url = tiny_server
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    ]
    turn = [
        ASK,
        {"role": "assistant", "content": "Checking both.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "tool", "tool_call_id": "c2", "name": "get_weather", "content": "sun"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    prompt = await _prompt_text(url, turn)
    assert (
        '<|assistant|>\nChecking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<|user|>\n<tool_response>\nrain\n</tool_response>\n<tool_response>\n{"name": "get_weather", "content": "sun"}\n</tool_response>\n'
        "<|user|>\nAnd tomorrow?\n"
    ) in prompt


async def test_an_answer_sent_back_with_its_null_fields_is_taken(tiny_server):
    client, url = tiny_server
    first = await client.chat.completions.create(model="m", messages=[ASK], max_tokens=3, temperature=0)
    dumped = first.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= set(dumped)
    second = await client.chat.completions.create(model="m", messages=[ASK, dumped, {"role": "user", "content": "Thanks"}], max_tokens=3)
    assert second.choices[0].message.role == "assistant"
    # a refusal is what the assistant said
    refused = {"role": "assistant", "content": None, "refusal": "I cannot help with that."}
    assert "<|assistant|>\nI cannot help with that.\n" in await _prompt_text(url, [ASK, refused, {"role": "user", "content": "Why?"}])
    # what cannot be served is refused by name, on that request only
    for field, value, needle in (
        ("function_call", {"name": "f", "arguments": "{}"}, "function_call"),
        ("audio", {"id": "audio_1"}, "audio"),
    ):
        with pytest.raises(openai.BadRequestError) as bad:
            await client.chat.completions.create(model="m", messages=[ASK, {"role": "assistant", "content": "x", field: value}], max_tokens=2)
        assert f"messages[1].{needle}" in bad.value.message
    with pytest.raises(openai.BadRequestError) as misplaced:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x", "refusal": "no"}], max_tokens=2)
    assert "messages[0].refusal" in misplaced.value.message
    ok = await client.chat.completions.create(model="m", messages=[ASK], max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


async def test_a_template_that_prints_no_call_id_takes_tool_results(tmp_path):
    folder = write_random_checkpoint(tmp_path / "qwen-like", seed=3)
    (folder / "chat_template.jinja").write_text(QWEN_LIKE)
    server, client, url = await _serve(str(folder))
    try:
        call = {"id": "c9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
        turn = [ASK, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c9", "content": "rain"}]
        res = await client.chat.completions.create(model="m", messages=turn, max_tokens=3, temperature=0)
        assert res.choices[0].finish_reason in ("stop", "length")
        prompt = await _prompt_text(url, turn)
        assert '<|assistant|>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|user|>\n<tool_response>\nrain\n' in prompt
    finally:
        await client.close()
        await server.__aexit__(None, None, None)
