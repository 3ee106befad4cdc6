"""The codec's CUDA graphs (omni_async.speech.codec_graphs): replayed calls give the audio
of eager calls, float32 and bfloat16, at the tiny and the released decoder's size (random
weights), for the Qwen3-TTS decoder and Qwen3-Omni's Code2Wav; graphs are captured once
per bucket and replayed after; a grow of the slot store captures them again; the speech
pipeline's codec stage replays them; the codec stage's express lane replays graphs of its
own beside a round in flight."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from omni_async.speech import SpeechParams, SpeechPipeline
from omni_async.speech.code2wav import Code2Wav
from omni_async.speech.code2wav_config import Code2WavConfig
from omni_async.speech.codec import CodecDecoder
from omni_async.speech.codec_config import CodecConfig
from omni_async.speech.codec_graphs import BATCH_BUCKETS, FRAME_BUCKETS, CodecGraphs
from omni_async.speech.codec_slots import CodecSlots
from omni_async.speech.codec_stage import CodecStage

from .codec_gate import WAIT_S, GatedDecoder, eventually

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DECODERS = {"tiny": (CodecDecoder, CodecConfig.tiny), "real": (CodecDecoder, CodecConfig.qwen3_tts_12hz),
            "code2wav-tiny": (Code2Wav, Code2WavConfig.tiny), "code2wav-real": (Code2Wav, Code2WavConfig.qwen3_omni)}
# Mean |difference| over mean |audio|: the same shapes (graphed against the eager padded
# call) differ by rounding only; another batch shape (the plain eager call) may choose
# other kernels (TF32 convolutions, bf16 GEMMs), so a looser bound. A chunk decoded from a
# wrong state is off by far more (the control below).
SAME_SHAPES = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
OTHER_SHAPES = {torch.float32: 1e-2, torch.bfloat16: 5e-2}

# Rounds of (streams, frames): batches that pad (3 -> 4, 5 -> 8) and that fill their
# bucket, every frame bucket, streams skipping rounds.
SCHEDULE = [((0, 1, 2, 3, 4), 1), ((0, 1, 2), 2), ((3,), 4), ((0, 1, 2, 3, 4), 8), ((1, 3), 16), ((0, 2, 4), 4),
            ((0, 1, 2, 3), 1), ((4,), 2)]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().mean() / b.float().abs().mean().clamp(min=1e-6))


def random_codes(frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2048, (frames, 16), generator=g).cuda()


@pytest.fixture(scope="module", params=[("tiny", torch.float32), ("tiny", torch.bfloat16), ("real", torch.float32),
                                        ("real", torch.bfloat16), ("code2wav-tiny", torch.float32),
                                        ("code2wav-real", torch.bfloat16)], ids=lambda p: f"{p[0]}-{str(p[1])[6:]}")
def decoder(request) -> CodecDecoder | Code2Wav:
    name, dtype = request.param
    kind, config = DECODERS[name]
    return kind.random(config(), device="cuda", dtype=dtype, seed=0)


def test_graphed_calls_give_the_eager_calls_audio(decoder):
    graphed_store, padded_store, plain = CodecSlots(decoder, 8), CodecSlots(decoder, 8), CodecSlots(decoder, 8)
    graphs = CodecGraphs(graphed_store)
    padded = CodecGraphs(padded_store, capture=False)
    assert graphs.capture_graphs and not padded.capture_graphs
    codes = [random_codes(48, seed=i) for i in range(5)]
    slots = [[store.open() for _ in codes] for store in (graphed_store, padded_store, plain)]
    at = [0] * len(codes)
    dtype = decoder.dtype
    for rows, frames in SCHEDULE:
        chunk = torch.stack([codes[i][at[i]:at[i] + frames] for i in rows])
        got = graphs.run(chunk, [slots[0][i] for i in rows]).clone()
        same = padded.run(chunk, [slots[1][i] for i in rows])
        other = plain.run(chunk, [slots[2][i] for i in rows])
        assert got.shape == (len(rows), frames * 1920) and got.dtype == torch.float32
        assert relative(got, same) < SAME_SHAPES[dtype], (rows, frames)
        assert relative(got, other) < OTHER_SHAPES[dtype], (rows, frames)
        for i in rows:
            at[i] += frames
    buckets = {(next(b for b in BATCH_BUCKETS if b >= len(rows)), f) for rows, f in SCHEDULE}
    assert graphs.replays == len(SCHEDULE) and graphs.captures == len(buckets) and graphs.eager_calls == 0
    # the control: the next chunk of stream 0 from a fresh slot is other audio
    fresh = plain.open()
    chunk = codes[0][at[0]:at[0] + 4][None]
    want = graphs.run(chunk, [slots[0][0]]).clone()
    assert relative(plain.run(chunk, [fresh]), want) > max(0.1, 3 * OTHER_SHAPES[dtype])
    assert graphs.captures == len(buckets)  # (1, 4) was captured already: replayed


def test_a_grow_captures_the_graphs_again(decoder):
    store, plain = CodecSlots(decoder, 2), CodecSlots(decoder, 2)
    graphs = CodecGraphs(store)
    codes = [random_codes(8, seed=10 + i) for i in range(3)]
    gs, ps = [store.open(), store.open()], [plain.open(), plain.open()]
    chunk = torch.stack([c[:4] for c in codes[:2]])
    graphs.run(chunk, gs)
    plain.run(chunk, ps)
    gs.append(store.open())  # the store doubles: its tensors are new
    ps.append(plain.open())
    assert store.generation == 1
    chunk = torch.stack([c[4:8] for c in codes])
    got = graphs.run(chunk, gs).clone()
    assert graphs.captures == 2 and graphs.replays == 2
    assert relative(got, plain.run(chunk, ps)) < OTHER_SHAPES[decoder.dtype]


def test_capturing_every_bucket_up_front():
    decoder = CodecDecoder.random(CodecConfig.tiny(), device="cuda", dtype=torch.float32, seed=1)
    store = CodecSlots(decoder, 4)
    graphs = CodecGraphs(store, batches=(1, 2, 4))
    graphs.capture()
    assert graphs.captures == 3 * len(FRAME_BUCKETS) and graphs.capture_seconds > 0
    slot = store.open()
    codes = random_codes(16, seed=20)
    pieces = [graphs.run(codes[None, a:b], [slot])[0].clone() for a, b in ((0, 8), (8, 12), (12, 14), (14, 15), (15, 16))]
    assert graphs.captures == 3 * len(FRAME_BUCKETS) and graphs.replays == 5
    whole = decoder.decode(codes[None])[0]
    assert relative(torch.cat(pieces), whole) < OTHER_SHAPES[torch.float32]


async def _stream(graphs: bool) -> tuple[list, np.ndarray, dict]:
    async with SpeechPipeline.from_pretrained("tiny", device="cuda", dtype="float32", cuda_graphs=graphs, codec_graphs=graphs,
                                              first_chunk_frames=1, max_chunk_frames=16) as tts:
        chunks = [c async for c in tts.stream("Graphed codec calls.", voice="vivian",
                                             params=SpeechParams(max_frames=30, ignore_eos=True, seed=5))]
        whole = await tts.decode(torch.cat([c.codes for c in chunks]))
        info = tts.info()["speech"]
    return chunks, whole, info


async def test_the_pipelines_codec_stage_replays_graphs():
    chunks, whole, info = await _stream(True)
    sizes = [len(c.codes) for c in chunks]
    assert sum(sizes) == 30 and chunks[-1].finished
    assert all(n in FRAME_BUCKETS for n in sizes), sizes
    assert info["codec_graph_replays"] == info["codec_calls"] > 0
    audio = np.concatenate([c.audio for c in chunks])
    assert audio.shape == whole.shape == (30 * 1920,)
    assert float(np.abs(audio - whole).mean() / np.abs(whole).mean()) < OTHER_SHAPES[torch.float32]
    _, _, eager = await _stream(False)
    assert eager["codec_graph_replays"] == 0 and eager["codec_calls"] > 0



async def test_the_pipeline_captures_the_codecs_graphs_before_any_request():
    """Every call a round under the frame budget can make is captured when the pipeline is
    built: a request's rounds only replay (a capture in a round ran the decoder eagerly
    and synchronised the device under the talker's steps)."""
    async with SpeechPipeline.from_pretrained("tiny", device="cuda", loop="overlap") as tts:
        graphs = tts.codec.graphs
        built = graphs.captures
        budget = tts.schedule.codec_max_frames
        assert built == sum(1 for b in graphs.batches for f in graphs.frames
                            if f <= tts.codec.max_chunk_frames and (b * f <= budget or b == 1))
        await asyncio.gather(*(tts.synthesize("Graphs before requests.", voice="ryan",
                                              params=SpeechParams(max_frames=40, ignore_eos=True, seed=i)) for i in range(6)))
        info = tts.info()["speech"]
    assert graphs.captures == built and info["codec_graph_replays"] == info["codec_calls"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_widely_dilated_convolution_runs_over_its_phases_with_cudnns_output(dtype):
    """The vocoder's dilation-9 convolutions run over their input's interleaved phases on
    CUDA (cuDNN's kernel for one of them was slow): the samples of the dilated convolution,
    within the dtype's rounding, with and without its bias."""
    from omni_async.speech import codec_layers
    from omni_async.speech.codec_layers import CausalConv

    conv = CausalConv(384, 384, 7, dilation=9).to("cuda", dtype)
    x = torch.randn(4, 384, 1280 + 54, device="cuda", dtype=dtype)
    phased = conv.convolution(x)
    saved, codec_layers.POLYPHASE_DILATION = codec_layers.POLYPHASE_DILATION, 0
    try:
        declared = conv.convolution(x)
    finally:
        codec_layers.POLYPHASE_DILATION = saved
    assert phased.shape == declared.shape == (4, 384, 1280)
    assert relative(phased.float(), declared.float()) < OTHER_SHAPES[dtype]
    unbiased = conv.convolution(x, bias=False).float() + conv.conv.bias.float()[:, None]
    assert relative(unbiased, declared.float()) < OTHER_SHAPES[dtype]


async def test_the_express_lane_replays_its_own_graphs_beside_a_round_with_the_one_shot_audio():
    """On CUDA with graphs: a first chunk that becomes ready while a round is in flight is
    decoded by the express lane's own graphs on its own stream and delivered before that
    round's chunks; every stream's audio is its one-shot decode. The round is held in its
    bulk graph's capture (the bulk lane's graphs are left to capture on first use, so its
    first call runs a real forward that waits on the lane's thread); the express lane's
    graphs are captured up front."""
    decoder = GatedDecoder.random(CodecConfig.tiny(), device="cuda", dtype=torch.float32, seed=3)
    stage = CodecStage(decoder, torch.device("cuda"), first_chunk_frames=2, max_chunk_frames=8, slots=8)
    torch.cuda.synchronize()
    stage.express_graphs.capture()
    torch.cuda.synchronize()
    runner = asyncio.create_task(stage.run())
    try:
        codes = {name: random_codes(n, seed=70 + n) for name, n in (("round", 13), ("express", 19))}
        streams = {name: stage.open(name) for name in codes}
        chunks: dict[str, list] = {name: [] for name in codes}
        order: list[str] = []

        async def read(name: str) -> None:
            async for chunk in streams[name].receive:
                chunks[name].append(chunk)
                order.append(name)

        readers = [asyncio.create_task(read(name)) for name in codes]
        held = decoder.hold()
        stage.push(streams["round"], codes["round"][:2])
        assert await held.wait_entered()
        stage.push(streams["express"], codes["express"][:2])
        try:
            await eventually(lambda: bool(order))
            assert order == ["express"]  # delivered while the round was held
        finally:
            held.release()
        for name, s in streams.items():
            stage.push(s, codes[name][2:])
            stage.end(s, "stop")
        await asyncio.wait_for(asyncio.gather(*readers), WAIT_S)
        for name, c in codes.items():
            audio = torch.from_numpy(np.concatenate([x.audio for x in chunks[name]]))
            assert chunks[name][-1].finished and sum(len(x.codes) for x in chunks[name]) == len(c)
            assert relative(audio, decoder.decode(c[None])[0].cpu()) < OTHER_SHAPES[torch.float32]
        assert stage.express_calls == 1 and stage.express_graphs.replays == 1 and stage.graphs.replays > 0
        assert stage.slots.in_use() == 0
    finally:
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner
