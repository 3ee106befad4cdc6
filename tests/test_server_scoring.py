"""Scoring prompts over HTTP, on a real server on 127.0.0.1 with the official ``openai``
client: ``/v1/completions`` with ``echo`` (+ ``logprobs``, ``max_tokens=0``) as
lm-evaluation-harness's loglikelihood tasks send it, equal to the engine's and to
transformers' log-probabilities on a float32 checkpoint; vLLM's ``prompt_logprobs`` on
completions and chat; streamed echo; bad values a 400 while other requests carry on."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from typing import Any

import anyio
import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from omni_async import Engine, SamplingParams  # noqa: E402
from omni_async.server import running_server  # noqa: E402
from omni_async.testing import write_random_checkpoint  # noqa: E402

ATOL = 1e-4
PROMPT = "The quick brown fox jumps"


def _call(url: str, body: Any, path: str = "/v1/completions") -> tuple[int, Any]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def http(url: str, body: Any, path: str = "/v1/completions") -> tuple[int, Any]:
    return await anyio.to_thread.run_sync(lambda: _call(url, body, path))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("scoring") / "model", seed=3)


@pytest.fixture
async def served(checkpoint):
    engine = Engine.from_pretrained(str(checkpoint), loop="overlap", chunked_prefill_size=8, page_size=8)
    async with running_server(engine, model_name="m") as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        try:
            yield engine, client, url
        finally:
            await client.close()


def hf_logprobs(checkpoint, ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax(logits) at each position, gathered at the next token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


async def test_echo_scores_the_prompt(served, checkpoint):
    engine, client, _ = served
    res = await client.completions.create(model="m", prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    choice = res.choices[0]
    ids = engine.tokenizer.encode(PROMPT)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    whole = await engine.generate(input_ids=ids, sampling=SamplingParams(max_new_tokens=0, prompt_logprobs=1))
    assert lp.token_logprobs[1:] == pytest.approx([e[t] for t, e in zip(ids[1:], whole.prompt_logprobs[1:])], abs=1e-6)
    assert lp.token_logprobs[1:] == pytest.approx(hf_logprobs(checkpoint, ids).tolist(), abs=ATOL)
    for tok, entry, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[tok] == pytest.approx(entry) and 1 <= len(top) <= 2  # the top 1 and the prompt's token
    assert res.usage.completion_tokens == 0 and res.usage.prompt_tokens == len(ids)


async def test_loglikelihood_as_lm_eval_asks(served, checkpoint):
    """Context + continuation as token ids, echo, logprobs, max_tokens=0: the sum over the
    continuation's tokens, and whether each is the greedy choice."""
    engine, client, _ = served
    tok = engine.tokenizer
    pairs = [("Question: what is two plus two? Answer:", " four"), ("Paris is the capital of", " France"), ("a", "bc")]
    ctxs = [tok.encode(c) for c, _ in pairs]
    conts = [tok.encode(c + x)[len(ids):] for ids, (c, x) in zip(ctxs, pairs)]
    res = await client.completions.create(model="m", prompt=[c + x for c, x in zip(ctxs, conts)], echo=True, logprobs=1,
                                          max_tokens=0, temperature=0.0)
    assert len(res.choices) == len(pairs)
    for choice, ctx_ids, cont in zip(sorted(res.choices, key=lambda c: c.index), ctxs, conts):
        full = ctx_ids + cont
        got = choice.logprobs.token_logprobs[-len(cont):]
        ref = hf_logprobs(checkpoint, full)[-len(cont):]
        assert sum(got) == pytest.approx(float(ref.sum()), abs=ATOL * len(cont))
        greedy = all(max(top.values()) == lp for top, lp in zip(choice.logprobs.top_logprobs[-len(cont):], got))
        whole = await engine.generate(input_ids=full, sampling=SamplingParams(max_new_tokens=0, prompt_logprobs=0))
        ranks = whole.prompt_logprob_ranks[-len(cont):]
        assert greedy == all(r == 1 for r in ranks)


async def test_echo_with_generation_and_vllm_prompt_logprobs(served, checkpoint):
    engine, client, url = served
    ids = engine.tokenizer.encode(PROMPT)
    status, body = await http(url, {"model": "m", "prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 3,
                                     "temperature": 0, "ignore_eos": True, "prompt_logprobs": 3})
    assert status == 200, body
    choice = body["choices"][0]
    plain = await client.completions.create(model="m", prompt=ids, max_tokens=3, temperature=0, logprobs=2,
                                            extra_body={"ignore_eos": True})
    prompt_text = engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert choice["text"] == prompt_text + plain.choices[0].text
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][len(ids):] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    scores = choice["prompt_logprobs"]
    assert len(scores) == len(ids) and scores[0] is None
    ref = hf_logprobs(checkpoint, ids)
    for i, (token, entry) in enumerate(zip(ids[1:], scores[1:])):
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(float(ref[i]), abs=ATOL)
        assert own["logprob"] == pytest.approx(lp["token_logprobs"][i + 1], abs=1e-6)
        assert own["decoded_token"] == engine.tokenizer.decode([token], skip_special_tokens=False)
        tops = sorted((v for k, v in entry.items() if k != str(token) or v["rank"] <= 3), key=lambda v: v["rank"])
        assert [v["rank"] for v in tops][:3] == [1, 2, 3] and len(entry) in (3, 4)


async def test_chat_prompt_logprobs(served):
    _, client, url = served
    msgs = [{"role": "user", "content": "Hello there!"}]
    status, body = await http(url, {"model": "m", "messages": msgs, "max_tokens": 2, "prompt_logprobs": 0}, "/v1/chat/completions")
    assert status == 200, body
    scores = body["prompt_logprobs"]
    assert scores[0] is None and all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in scores[1:])
    assert body["usage"]["prompt_tokens"] == len(scores)


async def test_streamed_echo(served):
    engine, client, _ = served
    whole = await client.completions.create(model="m", prompt=PROMPT, echo=True, logprobs=1, max_tokens=4, temperature=0,
                                            extra_body={"ignore_eos": True})
    chunks = [c async for c in await client.completions.create(model="m", prompt=PROMPT, echo=True, logprobs=1, max_tokens=4,
                                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})]
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    streamed = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(whole.choices[0].logprobs.token_logprobs[1:], abs=1e-6)
    only = [c async for c in await client.completions.create(model="m", prompt=PROMPT, echo=True, max_tokens=0, stream=True)]
    assert "".join(c.choices[0].text for c in only if c.choices) == PROMPT
    plain = [c async for c in await client.completions.create(model="m", prompt=PROMPT, echo=True, max_tokens=2, stream=True)]
    assert plain[0].choices[0].text.startswith(PROMPT)


@pytest.mark.parametrize("prompt", ["Hi", PROMPT * 3], ids=["within a page", "pages"])
async def test_echo_with_n_choices(served, prompt):
    """``n`` choices of one scored prompt (the prompt is scored once, by the first
    completion): every choice echoes the same scores, whole and streamed."""
    engine, client, url = served
    body = {"model": "m", "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 3, "n": 3,
            "temperature": 0.9, "seed": 7, "ignore_eos": True, "prompt_logprobs": 1}
    status, whole = await http(url, body)
    assert status == 200, whole
    ids = engine.tokenizer.encode(prompt)
    single = await engine.generate(input_ids=ids, sampling=SamplingParams(max_new_tokens=0, prompt_logprobs=1))
    expected = [None] + [e[t] for t, e in zip(ids[1:], single.prompt_logprobs[1:])]
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    first = whole["choices"][0]
    assert first["logprobs"]["token_logprobs"][0] is None
    assert first["logprobs"]["token_logprobs"][1 : len(ids)] == pytest.approx(expected[1:], abs=1e-5)
    for choice in whole["choices"][1:]:
        assert choice["logprobs"]["token_logprobs"][: len(ids)] == first["logprobs"]["token_logprobs"][: len(ids)]
        assert choice["prompt_logprobs"] == first["prompt_logprobs"]
    del body["prompt_logprobs"]
    chunks = [c async for c in await client.completions.create(stream=True, **{k: v for k, v in body.items() if k not in ("ignore_eos", "seed")},
                                                                 seed=7, extra_body={"ignore_eos": True})]
    for index in range(3):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].text.startswith(prompt)
        assert mine[0].logprobs.token_logprobs[: len(ids)] == first["logprobs"]["token_logprobs"][: len(ids)]
    # Nothing generated: n alike choices, each echoing the prompt and its scores.
    only = {"model": "m", "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0, "n": 2}
    status, whole = await http(url, only)
    assert status == 200, whole
    assert [(c["index"], c["text"], c["finish_reason"]) for c in whole["choices"]] == [(0, prompt, "length"), (1, prompt, "length")]
    zero, one = (c["logprobs"]["token_logprobs"] for c in whole["choices"])
    assert zero == one and zero[0] is None and zero[1:] == pytest.approx(expected[1:], abs=1e-5)
    chunks = [c async for c in await client.completions.create(stream=True, **only)]
    for index in range(2):
        assert "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index) == prompt


@pytest.mark.parametrize("body", [
    {"prompt_logprobs": -1}, {"prompt_logprobs": 21}, {"prompt_logprobs": "x"}, {"max_tokens": 0},
    {"max_tokens": -1, "echo": True}, {"echo": True, "logprobs": 21, "max_tokens": 0},
    {"prompt_logprobs": 1, "stream": True},
])
async def test_bad_values_are_400_and_others_carry_on(served, body):
    _, client, url = served
    status, err = await http(url, {"model": "m", "prompt": PROMPT, **body})
    assert status == 400, err
    field = next(k for k in ("prompt_logprobs", "logprobs", "max_tokens") if k in body)
    assert field in err["error"]["message"]
    res = await client.completions.create(model="m", prompt=PROMPT, echo=True, logprobs=0, max_tokens=0)
    assert res.choices[0].logprobs.token_logprobs[0] is None and all(
        isinstance(x, float) and math.isfinite(x) for x in res.choices[0].logprobs.token_logprobs[1:])
