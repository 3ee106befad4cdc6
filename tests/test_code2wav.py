"""Qwen3-Omni's Code2Wav (omni_async.speech.code2wav) against transformers, float32 on the
CPU, on a tiny random ``Qwen3OmniMoeForConditionalGeneration`` saved by transformers (its
attention window shortened to 8 frames so it slides inside a stream): loaded from the
folder's ``code2wav.*`` tensors, its PCM equals ``model.code2wav(codes)``; the talker
stage's codes for a chat prompt, decoded one-shot and streamed through the codec stage,
equal the waveform ``generate(return_audio=True, talker_do_sample=False)`` returns; streams
decoded in chunks through the slot store give the one-shot decode; a bad folder or bad
codes are typed errors; random weights at a config are reproducible."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from omni_async.errors import InvalidRequestError, ModelLoadError
from omni_async.speech.code2wav import Code2Wav
from omni_async.speech.code2wav_config import Code2WavConfig
from omni_async.speech.codec_graphs import CodecGraphs
from omni_async.speech.codec_slots import CodecSlots
from omni_async.speech.codec_stage import CodecStage
from omni_async.speech.omni_stage import build_omni_talker_stage, frames_of, talker_request
from omni_async.speech.omni_talker import load_omni_talker, talker_prompt

from .test_omni_talker import AUDIO, chat_prompt, spread, talker_config

TOL = 1e-4  # against transformers (measured: a few 1e-6)
F32_TOL = 2e-5  # between our own splits and batchings (float32 rounding)
WINDOW = 8  # the tiny decoder's attention window (frames)


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    """(folder, transformers' model): a tiny Qwen3-Omni whose talker and code2wav have
    weights of unit gain (transformers' stock draw gives near-silent audio), saved."""
    from transformers import Qwen3OmniMoeForConditionalGeneration
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    torch.manual_seed(1)  # the talker of tests/test_omni_talker.py (a case ends at the codec EOS)
    reference = Qwen3OmniMoeForConditionalGeneration(talker_config()).eval()
    spread(reference.talker)
    c2w = reference.config.code2wav_config
    c2w.sliding_window, c2w.num_hidden_layers = WINDOW, 2
    reference.code2wav = Qwen3OmniMoeCode2Wav._from_config(c2w).eval()
    drawn = Code2Wav.random(Code2WavConfig.from_dict(c2w.to_dict()), seed=5)
    reference.code2wav.load_state_dict(drawn.state_dict(), strict=True)
    folder = tmp_path_factory.mktemp("code2wav") / "ck"
    reference.save_pretrained(folder)
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    model.thinker.config.vision_start_token_id = 151652  # read by 5.25's text-only position ids
    return folder, model


@pytest.fixture(scope="module")
def code2wav(omni) -> Code2Wav:
    return Code2Wav.from_folder(omni[0])


def random_codes(frames: int, seed: int, codec: Code2Wav, batch: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (frames, codec.num_quantizers) if batch is None else (batch, frames, codec.num_quantizers)
    return torch.randint(0, codec.codebook_size, shape, generator=g)


def transformers_pcm(model, codes: torch.Tensor) -> torch.Tensor:
    """``model.code2wav`` on ``codes [B, F, Q]`` (it takes ``[B, Q, F]``) -> ``[B, samples]``."""
    with torch.no_grad():
        return model.code2wav(codes.transpose(1, 2))[:, 0]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return float((a - b).abs().max())


# ---------------------------------------------------------------- against transformers

@pytest.mark.parametrize("frames", [1, 3, 2 * WINDOW + 5])
def test_decode_equals_transformers_code2wav(omni, code2wav, frames):
    """Two rows at once; one frame (all of its samples depend on the start's padding), a
    few, and more than twice the window."""
    _, model = omni
    codes = random_codes(frames, seed=frames, codec=code2wav, batch=2)
    ref = transformers_pcm(model, codes)
    assert ref.shape == (2, frames * code2wav.samples_per_frame - code2wav.leading_samples)
    assert max_diff(code2wav.decode(codes), ref) < TOL


def test_the_audio_depends_on_the_codes_and_is_not_clipped(omni, code2wav):
    """Guards every equality here: a decoder that ignored its codes, or saturated the clamp,
    would make them trivially true."""
    _, model = omni
    a = transformers_pcm(model, random_codes(12, seed=1, codec=code2wav, batch=1))[0]
    b = transformers_pcm(model, random_codes(12, seed=2, codec=code2wav, batch=1))[0]
    assert 0.05 < float(a.std()) < 0.6 and float((a.abs() >= 1).float().mean()) < 0.01
    assert float((a - b).abs().mean()) > 0.05


def reference_audio(model, prompt: list[int], *, reply: int, frames: int, penalty: float):
    """transformers' whole ``generate(return_audio=True)``, greedy everywhere: the thinker's
    result (for the talker's input rows) and the waveform it returns ``[samples]``."""
    seen = {}
    thinker_generate = model.thinker.generate

    def keep_thinker(*args, **kwargs):
        seen["thinker"] = thinker_generate(*args, **kwargs)
        return seen["thinker"]

    model.thinker.generate = keep_thinker
    try:
        with torch.no_grad():
            _, wav = model.generate(input_ids=torch.tensor([prompt]), speaker="ethan", return_audio=True,
                                    thinker_max_new_tokens=reply, thinker_do_sample=False, thinker_eos_token_id=501,
                                    talker_do_sample=False, talker_max_new_tokens=frames + 1,
                                    talker_repetition_penalty=penalty)
    finally:
        del model.thinker.generate
    return seen["thinker"], wav.reshape(-1)


# (user turn, reply tokens, frames asked, repetition penalty): a talker cut at 12 frames,
# and one ending at the codec EOS after 29 (test_omni_talker.py's cases)
CASES = [([20, AUDIO, AUDIO, 31, 44], 7, 12, 1.05), ([20, AUDIO, AUDIO, 31, 44], 7, 40, 1.0)]


@pytest.fixture(scope="module")
def whole_path(omni):
    """Per case: the talker's prompt and transformers' generated waveform."""
    folder, model = omni
    talker = load_omni_talker(folder)
    out = []
    for user, reply, frames, penalty in CASES:
        prompt = chat_prompt(user)
        thinker, wav = reference_audio(model, prompt, reply=reply, frames=frames, penalty=penalty)
        embeds = torch.cat([h[0] for h in thinker.hidden_states], dim=1)[0]
        hidden = torch.cat([h[talker.config.accept_hidden_layer] for h in thinker.hidden_states], dim=1)[0]
        output = thinker.sequences[0, len(prompt):].tolist()
        out.append((talker_prompt(talker, prompt, output, embeds, hidden, "ethan"), frames, penalty, wav))
    return out


async def test_the_talker_stages_codes_decode_to_generates_waveform(omni, code2wav, whole_path):
    """The talker stage writes both cases' frames at once; each request's frames decoded
    one-shot, and streamed through the codec stage as the talker writes them (its frames
    pushed three at a time), give the waveform transformers' generate returns."""
    folder, _ = omni
    stage = build_omni_talker_stage(folder, loop="overlap", page_size=8)
    async with stage.engine as engine:
        async def frames(prompt, n, penalty):
            handle = await engine.submit(**talker_request(stage.model, prompt, max_frames=n, repetition_penalty=penalty))
            return frames_of((await handle.result()).hidden_states)

        written = await asyncio.gather(*(frames(p, n, pen) for p, n, pen, _ in whole_path))
    assert [len(c) for c in written] == [12, 29]  # cut by length, and ended by the codec EOS
    for codes, (_, _, _, wav) in zip(written, whole_path):
        assert max_diff(code2wav.decode(codes[None])[0], wav) < TOL

    codec = CodecStage(code2wav, torch.device("cpu"), first_chunk_frames=2, max_chunk_frames=8, slots=1)
    runner = asyncio.create_task(codec.run())
    try:
        streams = [codec.open(f"r{i}") for i in range(len(written))]
        readers = [asyncio.create_task(_collect(s)) for s in streams]
        for start in range(0, max(len(c) for c in written), 3):
            for s, c in zip(streams, written):
                if start < len(c):
                    codec.push(s, c[start:start + 3])
            await asyncio.sleep(0.005)
        for s in streams:
            codec.end(s, "stop")
        for reader, (_, _, _, wav) in zip(readers, whole_path):
            chunks = await reader
            assert len(chunks) > 2 and chunks[-1].finished
            audio = torch.from_numpy(np.concatenate([c.audio for c in chunks]))
            assert max_diff(audio, wav) < TOL
        assert codec.active() == 0 and codec.slots.in_use() == 0
    finally:
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner


async def _collect(stream) -> list:
    return [chunk async for chunk in stream.receive]


# ---------------------------------------------------------------- streamed = one-shot

@pytest.mark.parametrize("padded", [False, True], ids=["eager", "padded"])
def test_interleaved_streams_through_the_slot_store_give_the_one_shot_decode(code2wav, padded):
    """Three streams over a store of one slot (it grows), each split its own way
    (single frames; chunks shorter and longer than the window; a stream joining late),
    one call per chunk length a round: each stream's samples, its first
    ``leading_samples`` dropped, are its one-shot decode's; those first samples are zeros."""
    slots = CodecSlots(code2wav, capacity=1)
    caller = CodecGraphs(slots, capture=False) if padded else slots
    splits = {"a": [1] * 6 + [16, 2], "b": [4, 8, 1, 4, 4], "c": [0, 0, 2, 16, 1]}
    codes = {k: random_codes(sum(v), seed=10 + i, codec=code2wav) for i, (k, v) in enumerate(splits.items())}
    opened: dict[str, int] = {}
    done = {k: 0 for k in splits}
    pcm: dict[str, list[torch.Tensor]] = {k: [] for k in splits}
    for rnd in range(max(len(v) for v in splits.values())):
        by_length: dict[int, list[str]] = {}
        for k, split in splits.items():
            if rnd < len(split) and split[rnd]:
                by_length.setdefault(split[rnd], []).append(k)
        for n, keys in by_length.items():
            for k in keys:
                if k not in opened:
                    opened[k] = slots.open()
            chunk = torch.stack([codes[k][done[k]:done[k] + n] for k in keys])
            out = caller.run(chunk, [opened[k] for k in keys])
            for j, k in enumerate(keys):
                pcm[k].append(out[j].clone())
                done[k] += n
    lead = code2wav.leading_samples
    for k in splits:
        audio = torch.cat(pcm[k])
        assert not audio[:lead].any()
        assert max_diff(audio[lead:], code2wav.decode(codes[k][None])[0]) < F32_TOL
    assert slots.capacity >= 3


def test_decode_streams_gives_each_streams_one_shot_decode(code2wav):
    codes = [random_codes(n, seed=30 + n, codec=code2wav) for n in (11, 19)]
    states = [code2wav.new_state(), code2wav.new_state()]
    pieces: list[list[torch.Tensor]] = [[], []]
    for start in range(0, 19, 5):
        parts = [c[start:start + 5] for c in codes]
        for i, pcm in enumerate(code2wav.decode_streams(parts, states)):
            pieces[i].append(pcm)
    for c, p in zip(codes, pieces):
        assert max_diff(torch.cat(p), code2wav.decode(c[None])[0]) < F32_TOL


def test_padding_frames_give_no_samples(omni, code2wav):
    """Rows padded with -1 (as a batch of unequal lengths is): each row is its own decode,
    zeros after its audio, as transformers' batched generate cuts each at its length."""
    a, b = random_codes(9, seed=40, codec=code2wav), random_codes(4, seed=41, codec=code2wav)
    batch = torch.full((2, 9, code2wav.num_quantizers), -1, dtype=torch.long)
    batch[0], batch[1, :4] = a, b
    out = code2wav.decode(batch)
    lone = code2wav.decode(b[None])[0]
    assert max_diff(out[0], code2wav.decode(a[None])[0]) < F32_TOL
    assert max_diff(out[1, :lone.shape[0]], lone) < F32_TOL and not out[1, lone.shape[0]:].any()
    assert max_diff(lone, transformers_pcm(omni[1], b[None])[0]) < TOL


# ---------------------------------------------------------------- loading and errors

def test_the_config_is_transformers_default_and_the_released_rate():
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig

    cfg = Code2WavConfig.qwen3_omni()
    assert Code2WavConfig.from_dict(Qwen3OmniMoeCode2WavConfig().to_dict()) == cfg
    assert (cfg.samples_per_frame, cfg.sample_rate) == (1920, 24000)


def test_a_folder_that_does_not_fit_is_refused(omni, tmp_path):
    folder, _ = omni
    raw = json.loads((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    code2wav = {k: v for k, v in weights.items() if k.startswith("code2wav.")}

    def write(config: dict, tensors: dict) -> None:
        (tmp_path / "config.json").write_text(json.dumps(config))
        save_file(tensors, str(tmp_path / "model.safetensors"))

    write({k: v for k, v in raw.items() if k != "code2wav_config"}, code2wav)
    with pytest.raises(ModelLoadError, match="code2wav_config"):
        Code2Wav.from_folder(tmp_path)
    gone = "code2wav.decoder.1.block.1.conv.weight"
    write(raw, {k: v for k, v in code2wav.items() if k != gone})
    with pytest.raises(ModelLoadError, match=gone):
        Code2Wav.from_folder(tmp_path)
    write(raw, {**code2wav, "code2wav.extra.weight": torch.zeros(2)})
    with pytest.raises(ModelLoadError, match="code2wav.extra.weight"):
        Code2Wav.from_folder(tmp_path)
    wider = json.loads(json.dumps(raw))
    wider["code2wav_config"]["decoder_dim"] = 64
    write(wider, code2wav)
    with pytest.raises(ModelLoadError, match="shape"):
        Code2Wav.from_folder(tmp_path)
    write({**raw, "code2wav_config": {**raw["code2wav_config"], "rope_parameters": {"rope_type": "yarn"}}}, code2wav)
    with pytest.raises(ModelLoadError, match="rope_type"):
        Code2Wav.from_folder(tmp_path)


def test_bad_codes_are_typed_errors(code2wav):
    q = code2wav.num_quantizers
    with pytest.raises(InvalidRequestError, match="codes must be"):
        code2wav.decode(torch.zeros(1, 3, q + 1, dtype=torch.long))
    with pytest.raises(InvalidRequestError, match="integers"):
        code2wav.decode(torch.zeros(1, 3, q))
    with pytest.raises(InvalidRequestError, match="outside the codebook"):
        code2wav.decode(torch.full((1, 3, q), code2wav.codebook_size, dtype=torch.long))
    with pytest.raises(InvalidRequestError, match="codes must be"):
        code2wav.decode_chunk(torch.zeros(3, q - 1, dtype=torch.long), code2wav.new_state())


def test_random_weights_are_reproducible_and_make_audio():
    cfg = Code2WavConfig.tiny()
    a, b, c = (Code2Wav.random(cfg, seed=s) for s in (3, 3, 4))
    codes = torch.randint(0, cfg.codebook_size, (1, 6, cfg.num_quantizers), generator=torch.Generator().manual_seed(0))
    pcm = a.decode(codes)
    assert pcm.shape == (1, 6 * 1920 - cfg.leading_samples) and cfg.leading_samples == 555
    assert torch.equal(pcm, b.decode(codes)) and not torch.equal(pcm, c.decode(codes))
    assert 0.05 < float(pcm.std()) < 0.6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_the_codec_stage_on_cuda_replays_graphs_and_gives_the_cpu_decode(code2wav):
    """float32 on the GPU, the stage's calls as CUDA graph replays: each stream's audio is
    the CPU one-shot decode."""
    gpu = Code2Wav.random(code2wav.config, device="cuda", seed=5)
    cpu = Code2Wav.random(code2wav.config, seed=5)
    codec = CodecStage(gpu, torch.device("cuda"), first_chunk_frames=2, max_chunk_frames=8)
    runner = asyncio.create_task(codec.run())
    try:
        codes = [random_codes(n, seed=50 + n, codec=cpu) for n in (13, 21)]
        streams = [codec.open(f"g{i}") for i in range(2)]
        readers = [asyncio.create_task(_collect(s)) for s in streams]
        for s, c in zip(streams, codes):
            codec.push(s, c.cuda())
            codec.end(s, "stop")
        for reader, c in zip(readers, codes):
            audio = torch.from_numpy(np.concatenate([x.audio for x in await reader]))
            want = cpu.decode(c[None])[0]
            assert audio.shape == want.shape
            # mean |difference| over mean |audio|: TF32 convolutions on the GPU (as tests/test_codec_cuda.py)
            assert float((audio - want).abs().mean() / want.abs().mean()) < 1e-2
        assert codec.graph_replays > 0
    finally:
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner
