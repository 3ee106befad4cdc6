"""Hidden-state capture on the SGLang backend (each streamed token carries the final
hidden state it was sampled from, equal to transformers' last hidden state there), and
a failed step's requests retried once, as on the native backend."""

from __future__ import annotations

import asyncio

import pytest
import torch

from omni_async import SamplingParams
from omni_async.backends.sglang.runner import SGLangModelRunner

from ..conftest import _hf_model
from .conftest import LOOPS, assert_sglang_pools_free, hf_greedy, random_prompts, sglang_engine


def hf_last_hidden(folder, ids: list[int]) -> torch.Tensor:
    """transformers' final (normed) hidden state at every position of ``ids``."""
    model = _hf_model(folder)
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0]


async def _stream_hidden(engine, prompt, n):
    tokens, hidden = [], []
    async for delta in engine.stream(input_ids=prompt, sampling=SamplingParams(max_new_tokens=n)):
        tokens.extend(delta.token_ids)
        hidden.append(delta.extra.get("hidden_state"))
    return tokens, hidden


@pytest.mark.parametrize("loop", LOOPS)
async def test_hidden_states_match_transformers(sg_checkpoints, loop):
    folder = sg_checkpoints["llama"]
    prompts = random_prompts(2, 512, 5, 18, seed=81)
    n = 6
    engine = sglang_engine(folder, loop=loop)
    engine.stack.runner.capture_hidden = True
    async with engine:
        streams = await asyncio.gather(*[_stream_hidden(engine, p, n) for p in prompts])
    for prompt, (tokens, hidden) in zip(prompts, streams):
        assert tokens == hf_greedy(folder, prompt, n)
        assert len(hidden) == n and all(h is not None for h in hidden)
        ref = hf_last_hidden(folder, prompt + tokens)
        for k, h in enumerate(hidden):  # token k was sampled from position len(prompt)-1+k
            torch.testing.assert_close(h, ref[len(prompt) - 1 + k], atol=1e-4, rtol=1e-4)
    assert_sglang_pools_free(engine)


class DecodeHiddenRunner(SGLangModelRunner):
    """Asks for hidden states on decode steps only, through the hook."""

    def requested_capture_hidden_mode_decode(self, schedule_batch, requests):
        return "last"


async def test_hidden_capture_hook_is_honoured_per_phase(sg_checkpoints):
    folder = sg_checkpoints["llama"]
    prompt = random_prompts(1, 512, 8, 8, seed=82)[0]
    engine = sglang_engine(folder)
    engine.stack.runner.__class__ = DecodeHiddenRunner
    async with engine:
        tokens, hidden = await _stream_hidden(engine, prompt, 4)
    assert [h is not None for h in hidden] == [False, True, True, True]
    ref = hf_last_hidden(folder, prompt + tokens)
    torch.testing.assert_close(hidden[1], ref[len(prompt)], atol=1e-4, rtol=1e-4)
    assert_sglang_pools_free(engine)


class FlakyRunner(SGLangModelRunner):
    """Raises once, in a step of at least two requests, at a chosen point."""

    fail_at = ""

    def post_decode_launch(self, result, forward_batch, requests):
        if self.fail_at == "launch" and len(requests) >= 2:
            self.fail_at = ""
            raise RuntimeError("boom in launch")
        return super().post_decode_launch(result, forward_batch, requests)

    def post_prefill(self, result, forward_batch, schedule_batch, requests):
        if self.fail_at == "prefill" and len(requests) >= 2:
            self.fail_at = ""
            raise RuntimeError("boom in prefill")
        return super().post_prefill(result, forward_batch, schedule_batch, requests)


@pytest.mark.parametrize(("loop", "where"), [("async_decode", "launch"), ("overlap", "prefill")])
async def test_a_failed_step_is_retried_once(sg_checkpoints, loop, where):
    """The step's requests go back to SGLang's waiting queue (KV released), are
    prefilled again and finish with the tokens they would have had."""
    folder = sg_checkpoints["llama"]
    prompts = random_prompts(4, 512, 4, 20, seed=83)
    lens = [30, 24, 18, 12]
    engine = sglang_engine(folder, loop=loop)
    runner = engine.stack.runner
    runner.__class__ = FlakyRunner
    runner.fail_at = where
    async with engine:
        results = await asyncio.gather(
            *[engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, lens)]
        )
        assert runner.fail_at == "", "the fault was never injected"
        info = (await engine.model_info())["data"]
        after = await engine.generate(input_ids=prompts[0], sampling=SamplingParams(max_new_tokens=5))
    assert info["failed_steps"] == 1
    assert engine.stack.core.num_retractions >= 2
    for res, p, n in zip(results, prompts, lens):
        assert res.output_ids == hf_greedy(folder, p, n)
    assert after.output_ids == hf_greedy(folder, prompts[0], 5)
    assert_sglang_pools_free(engine)


async def test_sglang_thinker_streams_hidden_states_into_a_talker(tmp_path):
    """The reason for capture: an SGLang thinker feeds a (native) talker stage in one
    event loop, every streamed thinker token with its hidden state."""
    from omni_async import RequestPayload
    from omni_async.backends.sglang import build_sglang_stage
    from omni_async.config import SchedulerConfig
    from omni_async.pipeline import TwoStagePipeline, make_talker

    from ..conftest import save_random_checkpoint

    folder = save_random_checkpoint("llama", tmp_path / "thinker", seed=3, vocab_size=256)
    prompt = random_prompts(1, 256, 6, 6, seed=84)[0]
    built = build_sglang_stage(str(folder), config=SchedulerConfig(loop="overlap"))
    built.stack.runner.capture_hidden = True
    async with TwoStagePipeline(built.scheduler, make_talker("overlap")) as pipe:
        handle = await pipe.submit(
            "c1",
            RequestPayload("c1", prompt, SamplingParams(max_new_tokens=12, ignore_eos=True)),
            RequestPayload("c1", [], SamplingParams(max_new_tokens=8, ignore_eos=True)),
        )
        events = [ev async for ev in handle]
    thinking = [ev.data for ev in events if ev.stage == "thinker" and ev.kind == "stream"]
    tokens = [t for d in thinking for t in d.token_ids]
    assert tokens == hf_greedy(folder, prompt, 12)
    ref = hf_last_hidden(folder, prompt + tokens)
    for k, delta in enumerate(thinking):
        torch.testing.assert_close(delta.extra["hidden_state"], ref[len(prompt) - 1 + k], atol=1e-4, rtol=1e-4)
    talk = next(ev.data for ev in events if ev.stage == "talker" and ev.kind == "result")
    assert len(talk.output_ids) == 8
    assert talk.prompt_ids[0] == 256 and talk.prompt_ids[1:] == tokens[: len(talk.prompt_ids) - 1]
    assert built.stack.core.kv_is_fully_free()
