"""Qwen3-Omni end to end in one event loop (:class:`OmniPipeline`: thinker stage -> talker
stage -> codec stage), on the tiny random checkpoints of tests/test_omni_talker.py and
tests/test_code2wav.py saved by transformers (float32, CPU): the reply's tokens are
transformers' thinker's, its frames the codes transformers' ``generate(return_audio=True)``
hands to code2wav, in each loop, several requests at once, the talker fed as the thinker
writes or after it; its audio the codec's decode of those frames (a stand-in codec), and
with the folder's Code2Wav the waveform ``generate`` returns; an abort in either phase
frees all three stages and spares the other requests; bad input gets typed errors; a
random-weight folder draws every stage from its seed."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from omni_async import SamplingParams
from omni_async.errors import InvalidRequestError, RequestAbortedError
from omni_async.speech.codec import CodecDecoder
from omni_async.speech.codec_config import CodecConfig
from omni_async.speech.omni_pipeline import OmniPipeline

from .conftest import LOOPS, assert_kv_free
from .test_code2wav import CASES as AUDIO_CASES, TOL, omni, reference_audio  # noqa: F401 (a fixture)
from .test_omni_talker import CASES, chat_prompt, omni_model, reference_run, talker_config  # noqa: F401 (a fixture)

THINKER_EOS = 501  # <|im_end|>, the reference run's thinker_eos_token_id


def stand_in_codec() -> CodecDecoder:
    """A decoder of the talker's 4 codebooks of 64 (the codec-stage protocol, random
    weights): the chain's audio is checked against its one-shot decode of the frames."""
    cfg = dataclasses.replace(CodecConfig.tiny(), num_quantizers=4, codebook_size=64)
    return CodecDecoder.random(cfg, seed=5)


def pipeline(folder, loop: str, **kw) -> OmniPipeline:
    limits = dict(page_size=8, chunked_prefill_size=16, decode_steps=2)
    return OmniPipeline.from_pretrained(folder, loop=loop, codec=stand_in_codec(), thinker_limits=limits, talker_limits=limits,
                                        **kw)


def thinker_sampling(reply: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=reply, stop_token_ids=[THINKER_EOS])


async def assert_stages_free(pipe: OmniPipeline) -> None:
    """No request holds anything in any stage (the prefix caches' pages given back first)."""
    await _settled(pipe)
    for engine in (pipe.thinker, pipe.talker.engine):
        assert (await engine.flush_cache())["success"]
    assert_kv_free(pipe.thinker)
    assert_kv_free(pipe.talker.engine)
    assert pipe.codec.active() == 0 and pipe.codec.slots.in_use() == 0
    assert pipe.open_requests == []


@pytest.fixture(scope="module")
def expected(omni_model):
    """Each case's (prompt, thinker tokens, transformers' codes)."""
    _, model = omni_model
    out = []
    for user, reply, frames, penalty, _ in CASES:
        prompt = chat_prompt(user)
        thinker, codes = reference_run(model, prompt, reply=reply, frames=frames, penalty=penalty)
        out.append((prompt, thinker.sequences[0, len(prompt):].tolist(), codes))
    return out


@pytest.mark.parametrize("stream_talker", [True, False], ids=["streamed", "in-order"])
@pytest.mark.parametrize("loop", LOOPS)
async def test_text_and_codes_equal_transformers_in_every_loop(omni_model, expected, loop, stream_talker):
    """Every case at once through the three stages, the talker fed as the thinker writes
    or after it: the thinker's tokens as transformers' thinker writes them (and as the
    thinker stage alone writes them), the frames as transformers' talker writes them, the
    audio the codec's one-shot decode of them."""
    folder, _ = omni_model
    async with pipeline(folder, loop, stream_talker=stream_talker) as pipe:
        results = await asyncio.gather(*(
            pipe.chat(input_ids=prompt, voice="Ethan", sampling=thinker_sampling(reply), max_frames=frames, repetition_penalty=penalty)
            for (prompt, _, _), (_, reply, frames, penalty, _) in zip(expected, CASES)))
        alone = [await pipe.thinker.generate(input_ids=prompt, sampling=thinker_sampling(reply))
                 for (prompt, _, _), (_, reply, _, _, _) in zip(expected, CASES)]
        for result, thinker_alone, (_, tokens, codes), case in zip(results, alone, expected, CASES):
            assert result.output_ids == tokens == thinker_alone.output_ids
            assert result.codes.tolist() == codes.tolist()
            assert result.audio_finish_reason == case[4]
            assert len(result.audio) == codes.shape[0] * pipe.codec.decoder.samples_per_frame
            oneshot = (await asyncio.to_thread(_decode, pipe.codec.decoder, codes))
            np.testing.assert_allclose(result.audio, oneshot, atol=2e-5)
        await assert_stages_free(pipe)


@pytest.mark.parametrize("input_thread", [False, True], ids=["inline", "thread"])
async def test_replies_text_rows_are_built_together(omni_model, expected, input_thread):
    """Four 40-token replies speaking at once have the text rows they wait for built in
    shared passes (fewer passes than requests for rows: a pass per request and thinker
    delta gave 64 streams' frames a queue to wait in), on the loop or on the input's
    thread, and each gets the codes it gets alone."""
    folder, _ = omni_model
    sampling = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompts = [prompt for prompt, _, _ in expected[:4]]
    async with pipeline(folder, "overlap", input_thread=input_thread) as pipe:
        together = await asyncio.gather(*(pipe.chat(input_ids=p, sampling=sampling, max_frames=60) for p in prompts))
        passes, served = pipe.input.passes, pipe.input.replies_served
        alone = [await pipe.chat(input_ids=p, sampling=sampling, max_frames=60) for p in prompts]
        for a, b in zip(together, alone):
            assert a.output_ids == b.output_ids and a.codes.tolist() == b.codes.tolist() and a.codes.shape[0] > 30
        assert 0 < passes < served
        await assert_stages_free(pipe)


@pytest.fixture(scope="module")
def generated_audio(omni):
    """Per case of tests/test_code2wav.py: the prompt, transformers' thinker tokens and the
    waveform its ``generate(return_audio=True)`` returns."""
    _, model = omni
    out = []
    for user, reply, frames, penalty in AUDIO_CASES:
        prompt = chat_prompt(user)
        thinker, wav = reference_audio(model, prompt, reply=reply, frames=frames, penalty=penalty)
        out.append((prompt, thinker.sequences[0, len(prompt):].tolist(), wav))
    return out


@pytest.mark.parametrize("loop", LOOPS)
async def test_the_replys_audio_equals_generates_waveform(omni, generated_audio, loop):
    """The folder's own Code2Wav at the end of the chain: both replies at once, each
    one's tokens and its streamed audio those of transformers' ``generate(return_audio=True)``
    (a talker cut at 12 frames, one ended by the codec EOS)."""
    folder, _ = omni
    limits = dict(page_size=8)
    async with OmniPipeline.from_pretrained(folder, loop=loop, thinker_limits=limits, talker_limits=limits) as pipe:
        results = await asyncio.gather(*(
            pipe.chat(input_ids=prompt, sampling=thinker_sampling(reply), max_frames=frames, repetition_penalty=penalty)
            for (prompt, _, _), (_, reply, frames, penalty) in zip(generated_audio, AUDIO_CASES)))
        for result, (_, tokens, wav) in zip(results, generated_audio):
            assert result.output_ids == tokens
            assert result.audio.shape == tuple(wav.shape) and float(np.abs(result.audio - wav.numpy()).max()) < TOL
        assert [r.audio_finish_reason for r in results] == ["length", "stop"]
        await assert_stages_free(pipe)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("loop", LOOPS)
async def test_the_chain_on_cuda_gives_generates_tokens_codes_and_waveform(omni, generated_audio, loop, monkeypatch):
    """On CUDA in float32 (the thinker's and talker's fused kernels, the codec's graphs,
    the talker fed as the thinker writes): both replies' tokens and frames as transformers'
    generate writes them, their audio its waveform. cuDNN's TF32 convolutions (PyTorch's
    default) are turned off: with them the waveform drifts ~2e-3 from the CPU's float32."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    folder, _ = omni
    async with OmniPipeline.from_pretrained(folder, device="cuda", dtype="float32", loop=loop) as pipe:
        results = await asyncio.gather(*(
            pipe.chat(input_ids=prompt, sampling=thinker_sampling(reply), max_frames=frames, repetition_penalty=penalty)
            for (prompt, _, _), (_, reply, frames, penalty) in zip(generated_audio, AUDIO_CASES)))
        for result, (_, tokens, wav) in zip(results, generated_audio):
            assert result.output_ids == tokens
            assert result.audio.shape == tuple(wav.shape) and float(np.abs(result.audio - wav.numpy()).max()) < 1e-3
        assert pipe.codec.graph_replays > 0
        await assert_stages_free(pipe)


def _decode(decoder, codes):
    with torch.inference_mode():
        return decoder.decode(codes[None])[0].numpy()


@pytest.mark.parametrize("stream_talker", [True, False], ids=["streamed", "in-order"])
async def test_the_stream_gives_text_deltas_and_audio_chunks(omni_model, expected, stream_talker):
    """The streamed reply: text deltas whose tokens join into the reply, its last
    ``finished``; audio chunks in frame order whose frames join into the codes, the last
    ``finished`` with the talker's finish reason; in order, every audio chunk after the
    text."""
    folder, _ = omni_model
    (prompt, tokens, codes), (_, reply, frames, penalty, finish) = expected[2], CASES[2]
    async with pipeline(folder, "overlap", stream_talker=stream_talker) as pipe:
        events = [d async for d in pipe.stream(input_ids=prompt, sampling=thinker_sampling(reply), max_frames=frames,
                                               repetition_penalty=penalty)]
        text = [d for d in events if d.kind == "text"]
        audio = [d for d in events if d.kind == "audio"]
        if not stream_talker:
            assert [d.kind for d in events] == ["text"] * len(text) + ["audio"] * len(audio)
        assert [t for d in text for t in d.token_ids] == tokens
        assert [d.finished for d in text] == [False] * (len(text) - 1) + [True]
        assert [d.finished for d in audio] == [False] * (len(audio) - 1) + [True] and audio[-1].finish_reason == finish
        assert len(audio) > 2  # streamed in chunks, not one piece
        assert [c.audio.first_frame for c in audio] == list(np.cumsum([0] + [c.audio.codes.shape[0] for c in audio[:-1]]))
        assert torch.cat([c.audio.codes for c in audio]).tolist() == codes.tolist()
        await assert_stages_free(pipe)


async def test_the_talker_starts_while_the_thinker_writes(omni_model, expected):
    """Streamed, the talker's request goes in while the thinker's (a 40-token reply) is
    still open, its frames reading the reply's rows as they come; in order, it goes in once
    the thinker's has ended; streamed with the talker's input built on a thread (as on
    CUDA). The codes are the same (each frame waited for its row)."""
    folder, _ = omni_model
    prompt, _, _ = expected[2]
    async with pipeline(folder, "overlap") as pipe:
        submit, thinker_open = pipe.talker.engine.submit, []

        async def watched(*args, **kwargs):
            thinker_open.append("r" in pipe.thinker.open_requests)
            return await submit(*args, **kwargs)

        pipe.talker.engine.submit = watched
        replies = []
        for stream_talker, input_thread in ((True, False), (False, False), (True, True)):
            pipe.stream_talker, pipe.input_thread = stream_talker, input_thread
            replies.append(await pipe.chat(input_ids=prompt, sampling=SamplingParams(max_new_tokens=40, ignore_eos=True),
                                           max_frames=60, request_id="r"))
        streamed, in_order, threaded = replies
        assert thinker_open == [True, False, True]
        assert streamed.output_ids == in_order.output_ids == threaded.output_ids and len(streamed.output_ids) == 40
        assert streamed.codes.tolist() == in_order.codes.tolist() == threaded.codes.tolist() and streamed.codes.shape[0] > 30
        await assert_stages_free(pipe)


@pytest.mark.parametrize("loop", LOOPS)
async def test_an_abort_in_either_phase_frees_all_three_stages(omni_model, expected, loop):
    """Three requests at once: one left while the thinker writes (its budget of 300
    tokens cut short), one left after its first audio chunk, one read to the end. The two
    left end in every stage (no KV page held in the thinker or the talker, no codec
    stream or slot, neither stage writing on for them), and the third still gets
    transformers' tokens and codes."""
    folder, _ = omni_model
    (prompt, tokens, codes), (_, reply, frames, penalty, _) = expected[3], CASES[3]
    long_prompt, _, _ = expected[2]
    budget = 300
    async with pipeline(folder, loop) as pipe:
        async def leave_after(kind: str, rid: str, thinker_tokens: int) -> str:
            async for delta in pipe.stream(input_ids=long_prompt, sampling=SamplingParams(max_new_tokens=thinker_tokens, ignore_eos=True),
                                           max_frames=200, request_id=rid):
                if delta.kind == kind and not delta.finished:
                    return kind
            return "end"

        kept = asyncio.ensure_future(pipe.chat(input_ids=prompt, sampling=thinker_sampling(reply), max_frames=frames,
                                               repetition_penalty=penalty))
        left = await asyncio.gather(leave_after("text", "cut-text", budget), leave_after("audio", "cut-audio", 8))
        assert left == ["text", "audio"]
        result = await kept
        assert result.output_ids == tokens and result.codes.tolist() == codes.tolist()
        await assert_stages_free(pipe)
        # Each stage stopped writing for the request left in it: the thinker well within
        # the first's budget, the talker before the second's frames were all written.
        assert pipe.thinker.scheduler.info()["tokens_out"] < budget
        talker_tokens = pipe.talker.engine.scheduler.info()["tokens_out"]
        whole = await pipe.chat(input_ids=long_prompt, sampling=SamplingParams(max_new_tokens=8, ignore_eos=True), max_frames=200)
        assert talker_tokens < (frames + 1) + (whole.codes.shape[0] + 1)


async def test_a_cancelled_chat_frees_all_three_stages(omni_model, expected):
    """A task awaiting ``chat`` cancelled while the talker speaks: RequestAbortedError is
    not what it sees (it is cancelled), and no stage keeps anything of it."""
    folder, _ = omni_model
    prompt, _, _ = expected[2]
    async with pipeline(folder, "async_decode") as pipe:
        task = asyncio.ensure_future(pipe.chat(input_ids=prompt, sampling=SamplingParams(max_new_tokens=30, ignore_eos=True),
                                               max_frames=40, repetition_penalty=1.0, request_id="cancelled"))
        while pipe.codec.frames_decoded == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await assert_stages_free(pipe)


async def _settled(pipe: OmniPipeline) -> None:
    """Wait (bounded: 30 s, for a loaded 2-core machine) until the stages have processed the
    aborts sent to them."""
    for _ in range(3000):
        # (a stream closed while the codec decodes its chunk gives its slot back after the call)
        if not pipe.thinker.open_requests and not pipe.talker.engine.open_requests and pipe.codec.active() == 0 \
                and pipe.codec.slots.in_use() == 0:
            return
        await asyncio.sleep(0.01)


async def test_bad_requests_get_typed_errors_and_the_pipeline_carries_on(omni_model, expected):
    folder, _ = omni_model
    (prompt, tokens, _), (_, reply, _, _, _) = expected[1], CASES[1]
    async with pipeline(folder, "normal") as pipe:
        with pytest.raises(InvalidRequestError, match="unknown speaker"):
            await pipe.chat(input_ids=prompt, voice="nobody")
        with pytest.raises(InvalidRequestError, match="max_frames"):
            await pipe.chat(input_ids=prompt, max_frames=0)
        with pytest.raises(InvalidRequestError, match="n must be 1"):
            await pipe.chat(input_ids=prompt, sampling=SamplingParams(n=2))
        with pytest.raises(InvalidRequestError, match="assistant"):  # no assistant turn for the talker
            await pipe.chat(input_ids=prompt[:-3], sampling=thinker_sampling(reply))
        with pytest.raises(InvalidRequestError, match="no tokenizer"):
            await pipe.chat([{"role": "user", "content": "hi"}])
        with pytest.raises(InvalidRequestError, match="does not fit"):
            await pipe.chat(input_ids=prompt, sampling=thinker_sampling(reply), max_frames=10**6)
        result = await pipe.chat(input_ids=prompt, sampling=thinker_sampling(reply), max_frames=3)
        assert result.output_ids == tokens and result.codes.shape == (3, 4)
        one = await pipe.chat(input_ids=prompt, sampling=SamplingParams(max_new_tokens=1))
        assert len(one.output_ids) == 1 and one.codes.shape == (0, 4) and one.audio_finish_reason == "stop"
        await assert_stages_free(pipe)


async def test_a_random_weight_folder_draws_every_stage_from_its_seed(tmp_path, expected):
    """A folder of config.json and random_weights.json (speed runs at a released shape):
    the three stages' weights drawn from its seed, so the same seed speaks the same reply
    and another seed another one."""
    import json

    from omni_async.models.random_weights import RANDOM_WEIGHTS_FILE

    prompt, _, _ = expected[1]
    replies = []
    for seed in (3, 3, 4):
        folder = tmp_path / f"seed{seed}-{len(replies)}"
        config = talker_config()
        config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
        config.save_pretrained(folder)
        (folder / RANDOM_WEIGHTS_FILE).write_text(json.dumps({"seed": seed}))
        async with OmniPipeline.from_pretrained(folder, loop="normal") as pipe:
            assert pipe.thinker.scheduler.info()["load_format"] == "random"
            replies.append(await pipe.chat(input_ids=prompt, sampling=SamplingParams(max_new_tokens=6, ignore_eos=True),
                                           max_frames=8))
            await assert_stages_free(pipe)
    same, again, other = replies
    assert same.codes.shape == (8, 4) and len(same.audio) > 0
    assert same.output_ids == again.output_ids and same.codes.tolist() == again.codes.tolist()
    assert np.array_equal(same.audio, again.audio)
    assert same.codes.tolist() != other.codes.tolist() and not np.array_equal(same.audio[:100], other.audio[:100])
