"""Hidden states on CUDA's fast paths (decode graphs, the fused multi-step launch, its
sampled graphs) equal those of the CPU engine on the same float32 checkpoint, in every
loop. Skipped without CUDA and Triton; run on the GPU machine."""

from __future__ import annotations

import asyncio

import pytest
import torch

from omni_async import Engine, SamplingParams
from omni_async.kernels import triton_available

from .conftest import LOOPS, random_prompts

pytestmark = pytest.mark.skipif(not triton_available("cuda"), reason="needs CUDA and Triton")


async def _run(folder, device, loop, sampling, prompts, **limits):
    async with Engine.from_pretrained(str(folder), device=device, loop=loop, dtype=torch.float32, **limits) as engine:
        results = await asyncio.gather(*[engine.generate(input_ids=p, sampling=sampling) for p in prompts])
        info = await engine.admin("model_info")
        stats = engine.stack.runner.stats()
    return results, info, stats


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
async def test_cuda_fast_paths_hand_out_the_cpu_rows(hf_checkpoints, loop, sampled):
    folder = hf_checkpoints["qwen2"]
    prompts = random_prompts(12, 512, 4, 50, seed=13)
    sampling = SamplingParams(max_new_tokens=20, return_hidden_states=True,
                              **({"temperature": 0.7, "top_p": 0.9, "seed": 5} if sampled else {}))
    cpu, _, _ = await _run(folder, "cpu", loop, sampling, prompts, decode_steps=4)
    gpu, _, stats = await _run(folder, "cuda", loop, sampling, prompts, decode_steps=4)
    assert stats["fused_decode_replays"] > 0, "the fused multi-step graphs were meant to run"
    for c, g in zip(cpu, gpu):
        assert g.output_ids == c.output_ids
        assert g.hidden_states.device.type == "cuda"
        torch.testing.assert_close(g.hidden_states.cpu(), c.hidden_states, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("loop", LOOPS)
async def test_cuda_one_forward_graphs_hand_out_rows(hf_checkpoints, loop):
    folder = hf_checkpoints["llama"]
    prompts = random_prompts(5, 512, 4, 30, seed=1)
    sampling = SamplingParams(max_new_tokens=9, return_hidden_states=True)
    cpu, _, _ = await _run(folder, "cpu", loop, sampling, prompts, decode_steps=1)
    gpu, _, _ = await _run(folder, "cuda", loop, sampling, prompts, decode_steps=1)
    for c, g in zip(cpu, gpu):
        assert g.output_ids == c.output_ids
        torch.testing.assert_close(g.hidden_states.cpu(), c.hidden_states, atol=2e-3, rtol=2e-3)


async def _talker_tokens(device: str, loop: str) -> tuple[list[int], list[int]]:
    """A hidden-fed talker pipeline (float32, tiny shapes) on ``device``: the thinker's and
    the talker's tokens of three conversations."""
    from omni_async import RequestPayload
    from omni_async.pipeline import TwoStagePipeline

    pipe = TwoStagePipeline.from_pretrained("tiny", "tiny", device=device, loop=loop, dtype=torch.float32,
                                            thinker_limits={"decode_steps": 4}, talker_limits={"decode_steps": 4})
    thinker, talker = [], []
    async with pipe:
        for i in range(3):
            handle = await pipe.submit(
                f"c{i}", RequestPayload(f"c{i}", [256, 72 + i, 105], SamplingParams(max_new_tokens=20, ignore_eos=True)),
                RequestPayload(f"c{i}", [], SamplingParams(max_new_tokens=24, ignore_eos=True)))
            res = await handle.results()
            thinker.extend(res["thinker"].output_ids)
            talker.extend(res["talker"].output_ids)
    return thinker, talker


@pytest.mark.parametrize("loop", LOOPS)
async def test_cuda_talker_reads_thinker_rows_inside_graphs(loop):
    """The talker's conditioning rows reach its decode graphs and fused launches: its
    tokens on CUDA are those of the CPU run (float32), in every loop."""
    assert await _talker_tokens("cuda", loop) == await _talker_tokens("cpu", loop)
