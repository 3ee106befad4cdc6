"""Hidden states per request (``SamplingParams.return_hidden_states`` /
``return_prompt_hidden_states``) equal transformers' ``hidden_states[-1]`` on float32
checkpoints, in every loop, with one forward per step and with multi-step decodes (fused
and forward by forward), under chunked prefill and retraction; rows that do not ask get
none and the same tokens."""

from __future__ import annotations

import asyncio

import pytest
import torch

from omni_async import Engine, SamplingParams

from .conftest import LOOPS, _hf_model, assert_kv_free, hf_greedy, random_prompts

ATOL = 2e-4


def hf_hidden(folder, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' final hidden states ([-1], after the final norm) over prompt + output."""
    model = _hf_model(folder)
    with torch.no_grad():
        out = model(torch.tensor([prompt + output]), output_hidden_states=True)
    return out.hidden_states[-1][0]


def check_rows(folder, prompt, result) -> None:
    ref = hf_hidden(folder, prompt, result.output_ids)
    n, lp = len(result.output_ids), len(prompt)
    assert result.hidden_states is not None and tuple(result.hidden_states.shape) == (n, ref.shape[-1])
    # Output token j was produced at position len(prompt) - 1 + j.
    torch.testing.assert_close(result.hidden_states.float(), ref[lp - 1 : lp - 1 + n], atol=ATOL, rtol=1e-3)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("steps", [(None, True), (4, True), (4, False)], ids=["one", "fused4", "unfused4"])
async def test_hidden_rows_equal_transformers(hf_checkpoints, loop, steps):
    folder = hf_checkpoints["qwen2"]
    decode_steps, fused = steps
    prompts = random_prompts(6, 512, 3, 60, seed=3)
    lengths = [5, 17, 1, 9, 12, 3]
    expected = [hf_greedy(folder, p, n) for p, n in zip(prompts, lengths)]
    engine = Engine.from_pretrained(
        str(folder), loop=loop, page_size=8, kv_capacity_tokens=8 * 24, chunked_prefill_size=16,
        max_prefill_tokens=32, decode_steps=decode_steps, fuse_decode_steps=fused,
    )
    async with engine:
        results = await asyncio.gather(*[
            engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=n, return_hidden_states=True))
            for p, n in zip(prompts, lengths)
        ])
    for prompt, res, exp in zip(prompts, results, expected):
        assert res.output_ids == exp
        check_rows(folder, prompt, res)
    assert_kv_free(engine)


@pytest.mark.parametrize("loop", LOOPS)
async def test_only_rows_that_ask_get_them_and_tokens_do_not_change(hf_checkpoints, loop):
    folder = hf_checkpoints["llama"]
    prompts = random_prompts(4, 512, 5, 40, seed=5)
    async with Engine.from_pretrained(str(folder), loop=loop, decode_steps=4) as engine:
        alone = [await engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=12)) for p in prompts]
        mixed = await asyncio.gather(*[
            engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=12, return_hidden_states=i % 2 == 0))
            for i, p in enumerate(prompts)
        ])
    for i, (a, m) in enumerate(zip(alone, mixed)):
        assert a.output_ids == m.output_ids
        assert a.hidden_states is None
        if i % 2 == 0:
            check_rows(folder, prompts[i], m)
        else:
            assert m.hidden_states is None


@pytest.mark.parametrize("loop", LOOPS)
async def test_streamed_rows_arrive_with_their_tokens(hf_checkpoints, loop):
    folder = hf_checkpoints["qwen3"]
    prompt = random_prompts(1, 512, 20, 20, seed=9)[0]
    sampling = SamplingParams(max_new_tokens=14, return_hidden_states=True, temperature=0.8, seed=4)
    async with Engine.from_pretrained(str(folder), loop=loop, decode_steps=4) as engine:
        tokens, rows = [], []
        async for delta in engine.stream(input_ids=prompt, sampling=sampling):
            if delta.token_ids:
                assert delta.hidden_states is not None and delta.hidden_states.shape[0] == len(delta.token_ids)
                rows.append(delta.hidden_states)
            tokens.extend(delta.token_ids)
        plain = await engine.generate(input_ids=prompt, sampling=SamplingParams(max_new_tokens=14, temperature=0.8, seed=4))
    assert tokens == plain.output_ids  # seeded sampling: the same tokens with and without rows
    ref = hf_hidden(folder, prompt, tokens)
    torch.testing.assert_close(torch.cat(rows).float(), ref[len(prompt) - 1 : len(prompt) - 1 + len(tokens)], atol=ATOL, rtol=1e-3)


async def test_prompt_hidden_states_over_chunks(hf_checkpoints):
    folder = hf_checkpoints["llama"]
    prompt = random_prompts(1, 512, 45, 45, seed=2)[0]
    sampling = SamplingParams(max_new_tokens=3, return_prompt_hidden_states=True, return_hidden_states=True)
    async with Engine.from_pretrained(str(folder), chunked_prefill_size=16, max_prefill_tokens=16) as engine:
        res = await engine.generate(input_ids=prompt, sampling=sampling)
        first_delta = None
        async for delta in engine.stream(input_ids=prompt, sampling=sampling):
            if delta.token_ids and first_delta is None:
                first_delta = delta
    ref = hf_hidden(folder, prompt, res.output_ids)
    torch.testing.assert_close(res.prompt_hidden_states.float(), ref[: len(prompt)], atol=ATOL, rtol=1e-3)
    assert first_delta is not None and first_delta.prompt_hidden_states.shape[0] == len(prompt)
    check_rows(folder, prompt, res)


@pytest.mark.parametrize("loop", LOOPS)
async def test_prompt_hidden_states_of_a_scoring_only_request(hf_checkpoints, loop):
    """``max_new_tokens=0`` with ``prompt_logprobs``: no token ever carries the prompt's
    rows, so the result (and the stream's last delta) must."""
    folder = hf_checkpoints["llama"]
    prompt = random_prompts(1, 512, 45, 45, seed=4)[0]
    sampling = SamplingParams(max_new_tokens=0, prompt_logprobs=1, return_prompt_hidden_states=True)
    async with Engine.from_pretrained(str(folder), loop=loop, chunked_prefill_size=16, max_prefill_tokens=16) as engine:
        res = await engine.generate(input_ids=prompt, sampling=sampling)
        deltas = [d async for d in engine.stream(input_ids=prompt, sampling=sampling)]
        plain = await engine.generate(input_ids=prompt, sampling=SamplingParams(max_new_tokens=0, prompt_logprobs=1))
    ref = hf_hidden(folder, prompt, [])
    assert res.output_ids == [] and len(res.prompt_logprobs) == len(prompt)
    assert res.prompt_hidden_states is not None
    torch.testing.assert_close(res.prompt_hidden_states.float(), ref, atol=ATOL, rtol=1e-3)
    streamed = [d.prompt_hidden_states for d in deltas if d.prompt_hidden_states is not None]
    assert len(streamed) == 1 and deltas[-1].finished
    torch.testing.assert_close(streamed[0], res.prompt_hidden_states)
    assert plain.prompt_hidden_states is None and plain.prompt_logprobs == res.prompt_logprobs
    assert_kv_free(engine)


async def test_stage_wide_capture_sends_rows_for_every_request(tmp_path):
    """A stage that captures for every request (a thinker feeding a talker) streams rows
    for requests that did not ask, and keeps none for their results."""
    from omni_async.pipeline.colocate import build_stage_scheduler
    from omni_async.messages import IncomingMessage, RequestPayload

    sched, _stack = build_stage_scheduler("tiny", capture_hidden=True, decode_steps=4)
    async with sched:
        await sched.inbox.send(IncomingMessage("a", "new_request", RequestPayload("a", [1, 2, 3], SamplingParams(max_new_tokens=9))))
        rows, tokens, result = 0, 0, None
        async for msg in sched.outbox:
            if msg.type == "stream":
                tokens += len(msg.data.token_ids)
                rows += msg.data.hidden_states.shape[0]
            else:
                result = msg.data
                break
    assert tokens == rows == 9
    assert result.hidden_states is None
