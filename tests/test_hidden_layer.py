"""Hidden states from a chosen layer: a stage started with ``hidden_states_layer=N`` hands
out transformers' ``hidden_states[N]`` (the residual stream after N layers; 0 the input
embeddings) for output and prompt positions, in every loop, with one forward per step and
with fused multi-step decodes, on a dense and a mixture-of-experts checkpoint; a
thinker's layer rows reach its talker; a request asking a layer the stage does not
capture is refused alone, with a typed error."""

from __future__ import annotations

import asyncio

import pytest
import torch

from omni_async import Engine, SamplingParams
from omni_async.errors import ConfigError, InvalidRequestError
from omni_async.pipeline import TwoStagePipeline

from .conftest import LOOPS, _hf_model, assert_kv_free, hf_greedy, random_prompts
from .test_moe import save_moe_checkpoint
from .test_talker_pipeline import converse, talker

ATOL = 2e-4


def hf_layer_rows(folder, tokens: list[int], layer: int) -> torch.Tensor:
    model = _hf_model(folder)
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_hidden_states=True)
    return out.hidden_states[layer][0]


def check_layer_rows(folder, prompt: list[int], result, layer: int) -> None:
    ref = hf_layer_rows(folder, prompt + result.output_ids, layer)
    n, lp = len(result.output_ids), len(prompt)
    assert result.hidden_states is not None and tuple(result.hidden_states.shape) == (n, ref.shape[-1])
    # Output token j was produced at position len(prompt) - 1 + j.
    torch.testing.assert_close(result.hidden_states.float(), ref[lp - 1 : lp - 1 + n], atol=ATOL, rtol=1e-3)
    if result.prompt_hidden_states is not None:
        torch.testing.assert_close(result.prompt_hidden_states.float(), ref[:lp], atol=ATOL, rtol=1e-3)


async def layer_results(folder, layer, prompts, lengths, *, loop="normal", decode_steps=None, per_request=True, **limits):
    sampling = dict(return_hidden_states=True, return_prompt_hidden_states=True)
    if per_request:
        sampling["hidden_states_layer"] = layer
    engine = Engine.from_pretrained(str(folder), loop=loop, hidden_states_layer=layer, decode_steps=decode_steps, **limits)
    async with engine:
        results = await asyncio.gather(*[
            engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=n, **sampling)) for p, n in zip(prompts, lengths)
        ])
    assert_kv_free(engine)
    return results


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("decode_steps", [None, 4], ids=["one", "fused4"])
async def test_layer_rows_equal_transformers(hf_checkpoints, loop, decode_steps):
    folder = hf_checkpoints["qwen3"]  # two layers: 1 is the residual stream between them
    prompts = random_prompts(5, 512, 3, 50, seed=8)
    lengths = [6, 13, 1, 9, 4]
    results = await layer_results(folder, 1, prompts, lengths, loop=loop, decode_steps=decode_steps, page_size=8,
                                  chunked_prefill_size=16, max_prefill_tokens=32)
    for prompt, n, res in zip(prompts, lengths, results):
        assert res.output_ids == hf_greedy(folder, prompt, n)  # capturing changes no token
        check_layer_rows(folder, prompt, res, 1)


@pytest.mark.parametrize("layer", [0, 2, 3])
async def test_layer_rows_of_a_moe_decoder_equal_transformers(tmp_path, layer):
    """Layer 0 (the embeddings), 2 (after a dense and a sparse layer), 3 (the last: the
    final norm's rows, as without the option)."""
    folder = save_moe_checkpoint(tmp_path / "moe", seed=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                 mlp_only_layers=[1], decoder_sparse_step=1)
    prompts = random_prompts(3, 512, 4, 30, seed=2)
    results = await layer_results(folder, layer, prompts, [7, 3, 11], decode_steps=4)
    for prompt, res in zip(prompts, results):
        check_layer_rows(folder, prompt, res, layer)


async def test_the_stage_option_alone_picks_the_rows(hf_checkpoints):
    """Requests that leave ``hidden_states_layer`` unset get the stage's layer."""
    folder = hf_checkpoints["qwen3"]
    prompt = random_prompts(1, 512, 10, 10, seed=1)[0]
    (res,) = await layer_results(folder, 1, [prompt], [5], per_request=False)
    check_layer_rows(folder, prompt, res, 1)


async def test_a_request_asking_another_layer_is_refused_alone(hf_checkpoints):
    folder = hf_checkpoints["qwen3"]
    prompts = random_prompts(3, 512, 5, 20, seed=4)
    async with Engine.from_pretrained(str(folder), loop="overlap", hidden_states_layer=1) as engine:
        asked = [SamplingParams(max_new_tokens=8, return_hidden_states=True, hidden_states_layer=layer) for layer in (1, 2, 1)]
        outcomes = await asyncio.gather(
            *[engine.generate(input_ids=p, sampling=s) for p, s in zip(prompts, asked)], return_exceptions=True,
        )
        again = await engine.generate(input_ids=prompts[1], sampling=asked[0])
    assert isinstance(outcomes[1], InvalidRequestError) and "captures layer 1" in str(outcomes[1])
    for i in (0, 2):
        check_layer_rows(folder, prompts[i], outcomes[i], 1)
    check_layer_rows(folder, prompts[1], again, 1)
    assert_kv_free(engine)


async def test_a_default_stage_serves_its_last_layer_and_refuses_others(hf_checkpoints):
    """Without the option a stage captures the final norm's rows: asking for
    ``num_layers`` is the same as not asking; a layer past it, or another layer, is a
    typed error."""
    folder = hf_checkpoints["qwen3"]
    prompt = random_prompts(1, 512, 8, 8, seed=6)[0]
    async with Engine.from_pretrained(str(folder), loop="normal") as engine:
        plain = await engine.generate(input_ids=prompt, sampling=SamplingParams(max_new_tokens=5, return_hidden_states=True))
        named = await engine.generate(
            input_ids=prompt, sampling=SamplingParams(max_new_tokens=5, return_hidden_states=True, hidden_states_layer=2))
        with pytest.raises(InvalidRequestError, match=r"must be in \[0, 2\]"):
            await engine.generate(input_ids=prompt, sampling=SamplingParams(max_new_tokens=5, hidden_states_layer=3))
        with pytest.raises(InvalidRequestError, match="captures layer 2"):
            await engine.generate(input_ids=prompt, sampling=SamplingParams(max_new_tokens=5, hidden_states_layer=0))
    assert torch.equal(plain.hidden_states, named.hidden_states)
    check_layer_rows(folder, prompt, plain, 2)


async def test_impossible_layers_are_typed_errors(hf_checkpoints):
    for layer in (-2, 1.5, True):
        with pytest.raises(ConfigError, match="hidden_states_layer"):
            Engine.from_pretrained("tiny", hidden_states_layer=layer)
    with pytest.raises(ConfigError, match=r"must be in \[0, 2\]"):
        Engine.from_pretrained(str(hf_checkpoints["qwen3"]), hidden_states_layer=3)
    async with Engine.from_pretrained("tiny", loop="normal") as engine:
        for layer in (-1, "2", 2.0):
            with pytest.raises(InvalidRequestError, match="hidden_states_layer must be None or an integer"):
                await engine.generate(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=2, hidden_states_layer=layer))
        ok = await engine.generate(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=2))
    assert len(ok.output_ids) == 2


async def test_a_thinker_hands_its_talker_the_chosen_layer():
    """A thinker stage started with ``hidden_states_layer=2`` streams layer 2's rows to
    its talker: the rows an engine with that option returns for the same prompt, not the
    final norm's."""
    from omni_async.pipeline.colocate import build_stage_scheduler

    record: dict = {}
    first, _ = build_stage_scheduler("tiny", loop="normal", seed=0, capture_hidden=True, hidden_states_layer=2)
    second, _ = talker("normal", record)
    async with TwoStagePipeline(first, second) as pipe:
        events = (await converse(pipe, ["c"], n_think=10, n_talk=6))["c"]
    thinker_result = next(ev.data for ev in events if ev.stage == "thinker" and ev.kind == "result")
    prompt, outputs = thinker_result.prompt_ids, thinker_result.output_ids
    sampling = SamplingParams(max_new_tokens=len(outputs), ignore_eos=True, return_hidden_states=True)
    by_layer = {}
    for layer in (2, None):
        async with Engine.from_pretrained("tiny", loop="normal", seed=0, hidden_states_layer=layer) as engine:
            by_layer[layer] = await engine.generate(input_ids=prompt, sampling=sampling)
    assert by_layer[2].output_ids == outputs
    streamed = torch.cat([ev.data.hidden_states for ev in events if ev.stage == "thinker" and ev.kind == "stream"])
    assert torch.equal(streamed, by_layer[2].hidden_states)
    assert not torch.allclose(streamed, by_layer[None].hidden_states)
    # What the talker took before its own end: those rows, in order.
    taken = torch.cat(record["c"].chunks)
    assert taken.shape[0] >= 3 and torch.equal(taken, streamed[: taken.shape[0]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("decode_steps", [1, 4], ids=["graphs", "fused_graphs"])
async def test_cuda_graphs_hand_out_the_chosen_layer(hf_checkpoints, tmp_path, loop, decode_steps):
    """On CUDA the decode graphs and the fused multi-step graphs are captured returning
    the stage's layer: rows as transformers' (float32), for a dense and a MoE decoder (the
    grouped-expert kernel inside the graphs)."""
    from omni_async.kernels import triton_available

    if not triton_available("cuda"):
        pytest.skip("needs Triton")
    moe = save_moe_checkpoint(tmp_path / "moe", seed=3, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                              mlp_only_layers=[1], decoder_sparse_step=1)
    for folder, layer in ((hf_checkpoints["qwen3"], 1), (moe, 2)):
        prompts = random_prompts(6, 512, 4, 40, seed=10)
        engine = Engine.from_pretrained(str(folder), device="cuda", dtype="float32", loop=loop, hidden_states_layer=layer,
                                        decode_steps=decode_steps)
        async with engine:
            results = await asyncio.gather(*[
                engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=12, return_hidden_states=True))
                for p in prompts
            ])
            stats = engine.stack.runner.stats()
        if decode_steps > 1:
            assert stats["fused_decode_replays"] > 0, "the fused multi-step graphs were meant to run"
        assert engine.stack.runner.graphs is not None and engine.stack.runner.graphs.replays + stats.get("fused_decode_replays", 0) > 0
        for prompt, res in zip(prompts, results):
            assert res.output_ids == hf_greedy(folder, prompt, 12)
            ref = hf_layer_rows(folder, prompt + res.output_ids, layer)
            lp = len(prompt)
            torch.testing.assert_close(res.hidden_states.cpu().float(), ref[lp - 1 : lp - 1 + 12], atol=2e-3, rtol=2e-3)
