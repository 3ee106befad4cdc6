"""Our talker, code predictor and codec against the reference (``qwen-tts``) on the tiny
checkpoint its own classes built: greedy codes equal, PCM within 1e-4 (float32, CPU),
whatever the loop and however the requests are batched."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from omni_async.speech import SpeechParams, SpeechPipeline

from .conftest import MAIN_CASES

TEXTS = ["Hello world.", "The quick brown fox jumps over the lazy dog.", "Don't worry, my iPhone says it's 5 PM."]
# The reference ran generate_custom_voice(..., do_sample=False, subtalker_dosample=False, max_new_tokens=24):
# greedy on both, its checkpoint's repetition penalty (1.05), at most 23 frames.
GREEDY = SpeechParams(max_frames=23, temperature=0.0)


def _case(case: str) -> tuple[str, str]:
    speaker, text = case.split("/")[1].split("_t")
    return speaker, TEXTS[int(text)]


@pytest.mark.parametrize("loop", ["normal", "overlap", "async_decode"])
async def test_greedy_codes_and_pcm_equal_the_reference_batched(tts_model_dir, reference_arrays, loop):
    async with SpeechPipeline.from_pretrained(str(tts_model_dir), loop=loop) as tts:
        results = await asyncio.gather(*(tts.synthesize(_case(c)[1], voice=_case(c)[0], language="English", params=GREEDY)
                                         for c in MAIN_CASES))
    for case, result in zip(MAIN_CASES, results):
        codes, wav = reference_arrays[f"{case}/codes"], reference_arrays[f"{case}/wav"]
        assert result.codes.shape == codes.shape, case
        assert np.array_equal(result.codes.numpy(), codes), case
        assert result.audio.shape == wav.shape
        np.testing.assert_allclose(result.audio, wav, atol=1e-4)
        ended_on_eos = codes.shape[0] < 23
        assert result.finish_reason == ("stop" if ended_on_eos else "length"), case


async def test_each_case_alone_and_the_auto_language(tts_model_dir, reference_arrays):
    async with SpeechPipeline.from_pretrained(str(tts_model_dir), loop="overlap") as tts:
        for case in MAIN_CASES:
            speaker, text = _case(case)
            result = await tts.synthesize(text, voice=speaker, language="English", params=GREEDY)
            assert torch.equal(result.codes, torch.from_numpy(reference_arrays[f"{case}/codes"])), case
        auto = await tts.synthesize(TEXTS[0], voice="vivian", language="Auto", params=GREEDY)
    assert np.array_equal(auto.codes.numpy(), reference_arrays["extra/vivian_t0_auto_language/codes"])
