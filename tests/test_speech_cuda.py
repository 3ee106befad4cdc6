"""The speech pipeline on CUDA: graphed frame steps write the codes of eager ones."""

from __future__ import annotations

import asyncio

import pytest
import torch

from omni_async.speech import SpeechParams, SpeechPipeline

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TEXTS = ["Hello there.", "A somewhat longer sentence for the talker to speak.", "Short one", "Numbers like 42 and 7.",
         "Five texts in one batch.", "And a sixth."]
VOICES = ["ryan", "vivian", "serena", "dylan", "aiden", "eric"]


async def _run(graphs: bool, params: SpeechParams, loop: str = "overlap") -> tuple[list[torch.Tensor], dict]:
    async with SpeechPipeline.from_pretrained("tiny", device="cuda", dtype="float32", loop=loop, cuda_graphs=graphs) as tts:
        results = await asyncio.gather(*(tts.synthesize(t, voice=v, params=params) for t, v in zip(TEXTS, VOICES)))
        info = tts.info()
    return [r.codes for r in results], info


@pytest.mark.parametrize("params", [SpeechParams(max_frames=40, temperature=0.0, ignore_eos=True),
                                    SpeechParams(max_frames=40, temperature=0.9, seed=4, ignore_eos=True)],
                         ids=["greedy", "seeded"])
async def test_graphed_frames_write_the_eager_codes(params):
    graphed, info = await _run(True, params)
    eager, eager_info = await _run(False, params)
    assert info["speech_frame_graph_replays"] > 0 and eager_info["speech_frame_graph_replays"] == 0
    assert info["speech_prefill_graph_replays"] > 0 and eager_info["speech_prefill_graph_replays"] == 0
    for a, b in zip(graphed, eager):
        assert a.shape == (40, 16)
        assert torch.equal(a, b)


async def test_a_prefill_past_the_largest_bucket_replays_pieces_with_the_eager_codes():
    """Buckets of 8 and 16 rows: the six prompts starting together (tens of rows each) run
    as several replays of the 16-row graph, and the codes are the eager prefill's."""
    from omni_async.speech.prefill_graphs import PrefillGraphs

    params = SpeechParams(max_frames=16, temperature=0.0, ignore_eos=True)
    eager, _ = await _run(False, params)
    async with SpeechPipeline.from_pretrained("tiny", device="cuda", dtype="float32", cuda_graphs=True) as tts:
        runner = tts.stage.runner
        old = runner.prefill_graphs
        runner.prefill_graphs = PrefillGraphs(runner, scratch_page=old.scratch_page, max_pages=old.max_pages, buckets=(8, 16),
                                              pool=old.pool)
        runner.prefill_graphs.capture_all()
        results = await asyncio.gather(*(tts.synthesize(t, voice=v, params=params) for t, v in zip(TEXTS, VOICES)))
        replays, runs = runner.prefill_graphs.replays, runner.prefill_graphs.runs
    assert replays > runs >= 1  # more replays than prefills: pieces
    for a, b in zip(eager, [r.codes for r in results]):
        assert torch.equal(a, b)


async def test_the_three_loops_on_cuda():
    params = SpeechParams(max_frames=24, temperature=0.9, seed=9, ignore_eos=True)
    base, _ = await _run(True, params, "normal")
    for loop in ("overlap", "async_decode"):
        other, _ = await _run(True, params, loop)
        assert all(torch.equal(a, b) for a, b in zip(base, other)), loop


async def test_real_shapes_run_in_bf16_and_stream():
    async with SpeechPipeline.from_pretrained("0.6b", device="cuda", dtype="bfloat16") as tts:
        chunks = [c async for c in tts.stream("A real-sized talker on the GPU.", voice="ryan",
                                             params=SpeechParams(max_frames=30, ignore_eos=True, seed=1))]
    assert sum(len(c.codes) for c in chunks) == 30 and chunks[-1].finished
    assert all(c.audio.dtype.name == "float32" for c in chunks)


async def test_the_codec_on_the_talkers_stream_gives_the_same_codes_and_audio():
    """``codec_stream="talker"``: the codec's graphed calls queued between the talker's
    steps on one stream write what they write on a stream of their own."""
    params = SpeechParams(max_frames=20, temperature=0.9, seed=2, ignore_eos=True)
    out = {}
    for where in ("own", "talker"):
        async with SpeechPipeline.from_pretrained("tiny", device="cuda", dtype="float32", codec_stream=where) as tts:
            results = await asyncio.gather(*(tts.synthesize(t, voice=v, params=params) for t, v in zip(TEXTS, VOICES)))
            assert tts.codec.graph_replays > 0
        out[where] = results
    for a, b in zip(out["own"], out["talker"]):
        assert torch.equal(a.codes, b.codes)
        assert a.audio.shape == b.audio.shape and float(abs(a.audio - b.audio).max()) < 1e-5


async def test_the_codec_confined_to_a_quarter_of_the_sms_gives_the_same_codes_and_audio():
    """``codec_sms``: the codec's graphed calls on streams of a green context (a quarter of the
    SMs) write what they write on a plain stream."""
    params = SpeechParams(max_frames=20, temperature=0.9, seed=2, ignore_eos=True)
    quarter = torch.cuda.get_device_properties(0).multi_processor_count // 4
    out = {}
    for sms in (None, quarter):
        async with SpeechPipeline.from_pretrained("tiny", device="cuda", dtype="float32", codec_sms=sms) as tts:
            results = await asyncio.gather(*(tts.synthesize(t, voice=v, params=params) for t, v in zip(TEXTS, VOICES)))
            assert tts.codec.graph_replays > 0
        out[sms] = results
    for a, b in zip(out[None], out[quarter]):
        assert torch.equal(a.codes, b.codes)
        assert a.audio.shape == b.audio.shape and float(abs(a.audio - b.audio).max()) < 1e-5
