"""The server's request surface beyond one prompt: prompt lists, /tokenize and
/detokenize, chat message fields, the OpenAI penalties and the model label of the metrics;
a real server on 127.0.0.1 driven by the official ``openai`` client (and plain HTTP)."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import anyio
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from omni_async import Engine, SamplingParams  # noqa: E402
from omni_async.server import running_server  # noqa: E402

EXTRA = {"ignore_eos": True}  # tiny's random weights may emit EOS early: fixed lengths


class Http:
    """Plain HTTP to the server (for the routes the openai client has no method for)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def _call(self, path: str, body: Any = None) -> tuple[int, str]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    async def post(self, path: str, body: Any) -> tuple[int, Any]:
        status, text = await anyio.to_thread.run_sync(self._call, path, body)
        return status, json.loads(text)

    async def get(self, path: str) -> str:
        return (await anyio.to_thread.run_sync(self._call, path))[1]


@pytest.fixture
async def served():
    engine = Engine.from_pretrained("tiny", loop="normal")
    async with running_server(engine) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        try:
            yield engine, Http(url), client
        finally:
            await client.close()


async def test_a_prompt_list_gives_one_choice_per_prompt_and_n(served):
    engine, _, client = served
    prompts = ["Once upon", "abc", "The end"]
    sp = SamplingParams(max_new_tokens=6, temperature=0.9, seed=5, n=2, ignore_eos=True)
    expected = [await engine.generate(prompt=p, sampling=sp) for p in prompts]
    want = {i * 2 + o.index: o.text for i, r in enumerate(expected) for o in r.outputs}
    assert len(set(want.values())) > 2  # the prompts' completions differ: the numbering is checked
    whole = await client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0.9, seed=5, n=2, extra_body=EXTRA)
    assert {c.index: c.text for c in whole.choices} == want
    assert whole.usage.prompt_tokens == sum(len(r.prompt_ids) for r in expected)
    assert whole.usage.completion_tokens == 6 * 6
    stream = await client.completions.create(
        model="tiny", prompt=prompts, max_tokens=6, temperature=0.9, seed=5, n=2, stream=True, extra_body=EXTRA
    )
    texts: dict[int, str] = {}
    finishes = []
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finishes.append(c.index)
    assert texts == want and sorted(finishes) == list(range(6))
    ids = await client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0, extra_body=EXTRA)
    direct = [await engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=3, ignore_eos=True)) for p in ([5, 6, 7], [8, 9])]
    assert [c.text for c in sorted(ids.choices, key=lambda c: c.index)] == [r.text for r in direct]


async def test_a_refused_prompt_in_a_list_refuses_the_request_and_leaks_nothing(served):
    engine, _, client = served
    with pytest.raises(openai.BadRequestError) as bad:
        await client.completions.create(model="tiny", prompt=[[5, 6], [99999]], max_tokens=50, extra_body=EXTRA)
    assert "outside the vocabulary" in bad.value.message
    assert engine.open_requests == []
    info = engine.scheduler.info()
    assert info["kv_free_pages"] == info["kv_total_pages"]


async def test_leaving_a_streamed_prompt_list_aborts_every_prompt(served):
    engine, _, client = served
    stream = await client.completions.create(model="tiny", prompt=["one", "two", "three"], max_tokens=3000, stream=True, extra_body=EXTRA)
    seen = set()
    async for chunk in stream:
        seen.update(c.index for c in chunk.choices)
        if len(seen) == 3:
            break
    assert len(engine.open_requests) == 3  # all three run
    await stream.close()
    with anyio.fail_after(20):
        while engine.open_requests or engine.scheduler.info()["kv_free_pages"] != engine.scheduler.info()["kv_total_pages"]:
            await anyio.sleep(0.02)
    assert engine.scheduler.info()["tokens_out"] < 3 * 3000  # ended early, not by finishing


async def test_tokenize_and_detokenize_round_trip(served):
    engine, http, _ = served
    text = "héllo, world"
    _, res = await http.post("/tokenize", {"model": "tiny", "prompt": text})
    direct = await engine.generate(prompt=text, sampling=SamplingParams(max_new_tokens=1))
    assert res == {"tokens": direct.prompt_ids, "count": len(direct.prompt_ids), "max_model_len": 4096}
    _, bare = await http.post("/tokenize", {"model": "tiny", "prompt": text, "add_special_tokens": False})
    assert bare["count"] == len(text.encode()) == len(direct.prompt_ids) - 1
    assert await http.post("/detokenize", {"model": "tiny", "tokens": bare["tokens"]}) == (200, {"prompt": text})
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    _, rendered = await http.post("/tokenize", {"model": "tiny", "messages": chat})
    assert rendered["tokens"] == (await engine.generate(messages=chat, sampling=SamplingParams(max_new_tokens=1))).prompt_ids
    status, refused = await http.post("/detokenize", {"model": "tiny", "tokens": [1, 99999]})
    assert status == 400 and "99999" in refused["error"]["message"]
    assert (await http.post("/tokenize", {"model": "other", "prompt": "x"}))[0] == 404


async def _rejected(client, messages) -> str:
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    return bad.value.message


async def test_message_fields_the_template_ignores_are_refused_by_name(served):
    """tiny's template reads role and content only: a message's name would change
    nothing, so it is refused; so are unknown keys and nulls. (Tool calls and results go in
    as text there: tests/test_server_agent_turns.py.)"""
    engine, _, client = served
    user = {"role": "user", "content": "hi"}
    assert "messages[1].name" in await _rejected(client, [user, {"role": "user", "content": "yo", "name": "bob"}])
    assert "messages.0.colour" in await _rejected(client, [{**user, "colour": "red"}])
    assert "messages[0].content" in await _rejected(client, [{"role": "user", "content": None}])
    assert "messages[1].content" in await _rejected(client, [user, {"role": "assistant", "content": None}])
    assert "messages[0].tool_call_id" in await _rejected(client, [{"role": "tool", "content": "42"}])
    ok = await client.chat.completions.create(model="tiny", messages=[user], max_tokens=2, extra_body=EXTRA)
    assert ok.usage.completion_tokens == 2 and engine.open_requests == []


async def test_openai_penalties_and_logit_bias_reach_the_sampler(served):
    engine, _, client = served
    plain = await client.completions.create(model="tiny", prompt="abc", max_tokens=8, temperature=0, extra_body=EXTRA)
    steered = await client.completions.create(
        model="tiny", prompt="abc", max_tokens=8, temperature=0, logit_bias={str(ord("Q")): 100}, extra_body=EXTRA
    )
    assert plain.choices[0].text != "Q" * 8 and steered.choices[0].text == "Q" * 8
    sp = SamplingParams(max_new_tokens=12, presence_penalty=1.5, frequency_penalty=1.0, ignore_eos=True)
    expected = await engine.generate(prompt="abc", sampling=sp)
    free = await engine.generate(prompt="abc", sampling=SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert expected.output_ids != free.output_ids  # the penalties change tiny's greedy output
    penalised = await client.completions.create(
        model="tiny", prompt="abc", max_tokens=12, temperature=0, presence_penalty=1.5, frequency_penalty=1.0, extra_body=EXTRA
    )
    assert penalised.choices[0].text == expected.text
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model="tiny", prompt="abc", max_tokens=2, logit_bias={"x": 1})


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value for fam in text_string_to_metric_families(text) for s in fam.samples
    }


async def test_metrics_carry_the_served_model_name_and_prefix_cache_hits():
    engine = Engine.from_pretrained("tiny", loop="normal")
    async with running_server(engine, model_name="my-model") as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        prompt = "a prompt long enough to fill a few KV pages of sixteen tokens each, twice over"
        usages = []
        for _ in range(2):
            res = await client.completions.create(model="my-model", prompt=prompt, max_tokens=3, extra_body=EXTRA)
            usages.append(res.usage)
        await client.close()
        m = _samples(await Http(url).get("/metrics"))
        info = engine.scheduler.info()
    label = (("model", "my-model"),)
    cached = usages[1].prompt_tokens_details.cached_tokens
    assert usages[0].prompt_tokens_details.cached_tokens == 0 and cached >= 64
    assert m[("omni_async_prompt_cached_tokens_total", label)] == cached
    assert m[("omni_async_prefix_cache_hits_total", ())] == info["prefix_cache_hit_tokens"] >= cached
    assert m[("omni_async_prefix_cache_queries_total", ())] == info["prefix_cache_lookup_tokens"] > 0
    assert m[("omni_async_requests_total", (("finish_reason", "length"), *label))] == 2
    assert m[("omni_async_prompt_tokens_total", label)] == 2 * usages[0].prompt_tokens
    models = {dict(labels).get("model") for (name, labels) in m if "request" in name or "token" in name}
    assert models == {"my-model", None}  # request figures carry the served name; stage ones none
