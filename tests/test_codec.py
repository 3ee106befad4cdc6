"""The speech-tokenizer decoder (omni_async.speech.codec) at a tiny config with random weights:
a stream decoded chunk by chunk, with its state carried, gives the one-shot decode's samples
for any split; several streams decoded together give each stream's own samples; padding
frames give no samples; a checkpoint folder loads by name. The reference oracle for the
weights' meaning is tests/speech_oracle (an optional CI step)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from omni_async.errors import InvalidRequestError, ModelLoadError
from omni_async.speech.codec import CodecDecoder
from omni_async.speech.codec_config import CodecConfig

# float32 rounding through the tiny decoder, measured: <= 7e-6 between splits and between a
# batched and a single decode (the reference itself differs by up to 4.7e-6 between the two)
F32_TOL = 2e-5
FRAMES = 80  # longer than the 72-frame attention window, so the window slides inside a stream


@pytest.fixture(scope="module")
def codec() -> CodecDecoder:
    return CodecDecoder.random(CodecConfig.tiny(), seed=0)


def random_codes(frames: int, seed: int, batch: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (frames, 16) if batch is None else (batch, frames, 16)
    return torch.randint(0, 2048, shape, generator=g)


def stream(codec: CodecDecoder, codes: torch.Tensor, split: list[int]) -> torch.Tensor:
    assert sum(split) == codes.shape[0]
    state, out, start = codec.new_state(), [], 0
    for n in split:
        pcm = codec.decode_chunk(codes[start:start + n], state)
        assert pcm.shape == (n * codec.samples_per_frame,) and pcm.dtype == torch.float32
        out.append(pcm)
        start += n
    assert state.frames == codes.shape[0]
    return torch.cat(out)


def test_the_real_layout(codec):
    assert (codec.sample_rate, codec.samples_per_frame, codec.num_quantizers) == (24000, 1920, 16)
    assert CodecConfig.qwen3_tts_12hz().samples_per_frame == 1920


def test_the_audio_depends_on_the_codes_and_is_not_clipped(codec):
    """Guards the other tests: a decoder that ignored its codes or saturated the clamp would
    make every split trivially equal."""
    a = codec.decode(random_codes(12, seed=1, batch=1))[0]
    b = codec.decode(random_codes(12, seed=2, batch=1))[0]
    assert a.shape == (12 * 1920,)
    assert 0.05 < float(a.std()) < 0.6
    assert float((a.abs() >= 1).float().mean()) < 0.01
    assert float((a - b).abs().max()) > 0.1


@pytest.mark.parametrize("split", [
    [1] * FRAMES,
    [2] * (FRAMES // 2),
    [3, 7, 25, 1, 44],
    [1, 4, 16, 59],
    [72, 8],
    [FRAMES],
], ids=lambda s: "x".join(map(str, s[:6])))
def test_streamed_chunks_equal_the_one_shot_decode(codec, split):
    codes = random_codes(FRAMES, seed=3)
    whole = codec.decode(codes[None])[0]
    assert float((stream(codec, codes, split) - whole).abs().max()) < F32_TOL


def test_streaming_is_exact_in_float64():
    """In float64 the rounding is ~1e-12, so a state carried wrong by even one sample shows."""
    codec = CodecDecoder.random(CodecConfig.tiny(), seed=1, dtype=torch.float64)
    codes = random_codes(FRAMES, seed=4)
    whole = codec.decode(codes[None])[0]
    for split in ([1] * FRAMES, [5, 70, 5], [71, 1, 8]):
        assert float((stream(codec, codes, split) - whole).abs().max()) < 1e-6


def test_a_chunk_without_its_stream_state_differs(codec):
    """The carried state matters: the second chunk decoded from a fresh state is other audio."""
    codes = random_codes(20, seed=5)
    whole = codec.decode(codes[None])[0]
    alone = codec.decode_chunk(codes[10:], codec.new_state())
    assert float((alone - whole[10 * 1920:]).abs().max()) > 0.05


def test_decode_streams_gives_each_stream_its_own_samples(codec):
    """Three streams advanced round by round, each in its own split; a round's chunks of equal
    length go in one call, and every stream's audio is its one-shot decode's."""
    codes = [random_codes(30, seed=10), random_codes(30, seed=11), random_codes(33, seed=12)]
    splits = [[1, 2, 4, 8, 15], [1, 2, 4, 8, 15], [3, 1, 4, 25]]
    states = [codec.new_state() for _ in codes]
    calls: list[int] = []
    hook = codec.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[0]))
    try:
        pieces: list[list[torch.Tensor]] = [[] for _ in codes]
        starts = [0, 0, 0]
        for round_ in range(max(len(s) for s in splits)):
            live = [i for i in range(3) if round_ < len(splits[i])]
            chunks = [codes[i][starts[i]:starts[i] + splits[i][round_]] for i in live]
            calls.clear()
            out = codec.decode_streams(chunks, [states[i] for i in live])
            assert len(calls) == len({c.shape[0] for c in chunks})  # one call per chunk length
            assert sum(calls) == len(live)
            for i, pcm in zip(live, out):
                pieces[i].append(pcm)
                starts[i] += splits[i][round_]
    finally:
        hook.remove()
    for i in range(3):
        whole = codec.decode(codes[i][None])[0]
        assert float((torch.cat(pieces[i]) - whole).abs().max()) < F32_TOL
        assert states[i].frames == codes[i].shape[0]


def test_an_empty_chunk_gives_no_samples_and_keeps_the_state(codec):
    codes = random_codes(6, seed=13)
    state = codec.new_state()
    first = codec.decode_chunk(codes[:3], state)
    assert codec.decode_chunk(codes[:0], state).numel() == 0
    rest = codec.decode_chunk(codes[3:], state)
    whole = codec.decode(codes[None])[0]
    assert float((torch.cat([first, rest]) - whole).abs().max()) < F32_TOL


def test_padding_frames_give_no_samples(codec):
    """As in the reference: frames whose codebook-0 code is -1 are padding; each row's audio is
    its real frames' samples, then zeros to the longest row."""
    a, b = random_codes(10, seed=14), random_codes(6, seed=15)
    padded = torch.full((2, 10, 16), -1, dtype=torch.long)
    padded[0], padded[1, :6] = a, b
    out = codec.decode(padded)
    assert out.shape == (2, 10 * 1920)
    assert float((out[0] - codec.decode(a[None])[0]).abs().max()) < F32_TOL
    assert float((out[1, :6 * 1920] - codec.decode(b[None])[0]).abs().max()) < F32_TOL
    assert not out[1, 6 * 1920:].any()
    alone = torch.cat([b, torch.full((3, 16), -1)])[None]
    assert codec.decode(alone).shape == (1, 6 * 1920)  # a single row is trimmed to its frames


@pytest.mark.parametrize("codes, call", [
    (torch.zeros(5, 16, dtype=torch.long), "decode"),                 # [F, 16] where [B, F, 16] is due
    (torch.zeros(1, 5, 15, dtype=torch.long), "decode"),              # 15 codebooks
    (torch.zeros(1, 5, 16), "decode"),                                # floats
    (torch.full((1, 5, 16), 2048, dtype=torch.long), "decode"),       # outside the codebook
    (torch.zeros(1, 5, 16, dtype=torch.long), "chunk"),               # [B, F, 16] where [F, 16] is due
    (torch.zeros(5, 8, dtype=torch.long), "chunk"),
])
def test_bad_codes_are_a_typed_error(codec, codes, call):
    with pytest.raises(InvalidRequestError):
        if call == "decode":
            codec.decode(codes)
        else:
            codec.decode_chunk(codes, codec.new_state())


def test_decode_streams_checks_its_arguments(codec):
    state = codec.new_state()
    chunk = random_codes(2, seed=16)
    with pytest.raises(InvalidRequestError):
        codec.decode_streams([chunk, chunk], [state])
    with pytest.raises(InvalidRequestError):
        codec.decode_streams([chunk, chunk], [state, state])
    assert state.frames == 0


def _write_checkpoint(codec: CodecDecoder, folder, decoder_config: dict) -> None:
    """The layout of a release's ``speech_tokenizer/``: the decoder's tensors under ``decoder.``,
    the RVQ's input projections (unused when decoding) and an encoder tensor beside them."""
    st = folder / "speech_tokenizer"
    st.mkdir(parents=True)
    tensors = {f"decoder.{k}": v.contiguous() for k, v in codec.state_dict().items()}
    half = codec.config.codebook_dim // 2
    for group in ("rvq_first", "rvq_rest"):
        tensors[f"decoder.quantizer.{group}.input_proj.weight"] = torch.zeros(half, codec.config.codebook_dim, 1)
    tensors["encoder.unused.weight"] = torch.zeros(3)
    save_file(tensors, str(st / "model.safetensors"))
    (st / "config.json").write_text(json.dumps({
        "model_type": "qwen3_tts_tokenizer_12hz", "decoder_config": decoder_config,
        "output_sample_rate": 24000, "decode_upsample_rate": 1920}))
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_tts"}))


def _decoder_config(config: CodecConfig) -> dict:
    c = config
    return {"codebook_size": c.codebook_size, "codebook_dim": c.codebook_dim, "hidden_size": c.hidden_size,
            "latent_dim": c.latent_dim, "intermediate_size": c.intermediate_size, "head_dim": c.head_dim,
            "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "sliding_window": c.sliding_window,
            "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_norm_eps, "hidden_act": "silu",
            "num_quantizers": 16, "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2],
            "decoder_dim": c.decoder_dim, "model_type": "", "attention_dropout": 0.0}


def test_a_checkpoint_folder_loads_by_name(codec, tmp_path):
    _write_checkpoint(codec, tmp_path, _decoder_config(codec.config))
    codes = random_codes(9, seed=17, batch=1)
    for folder in (tmp_path, tmp_path / "speech_tokenizer"):  # the model folder or its speech_tokenizer/
        loaded = CodecDecoder.from_folder(folder)
        assert torch.equal(loaded.decode(codes), codec.decode(codes))
    other = CodecDecoder.random(CodecConfig.tiny(), seed=5)
    assert float((other.decode(codes) - codec.decode(codes)).abs().max()) > 0.05


def test_a_checkpoint_that_does_not_match_its_config_is_a_load_error(codec, tmp_path):
    _write_checkpoint(codec, tmp_path, dict(_decoder_config(codec.config), num_hidden_layers=3))
    with pytest.raises(ModelLoadError, match="missing"):
        CodecDecoder.from_folder(tmp_path)


def test_an_unsupported_tokenizer_is_a_load_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_tts_tokenizer_25hz"}))
    with pytest.raises(ModelLoadError, match="12 Hz"):
        CodecDecoder.from_folder(tmp_path)


def test_random_weights_follow_the_seed():
    codes = random_codes(4, seed=18, batch=1)
    one = CodecDecoder.random(CodecConfig.tiny(), seed=3).decode(codes)
    assert torch.equal(one, CodecDecoder.random(CodecConfig.tiny(), seed=3).decode(codes))


def test_bfloat16_weights_give_float32_audio_close_to_float32_weights():
    codes = random_codes(30, seed=19, batch=1)
    f32 = CodecDecoder.random(CodecConfig.tiny(), seed=0).decode(codes)
    codec = CodecDecoder.random(CodecConfig.tiny(), seed=0, dtype=torch.bfloat16)
    bf16 = codec.decode(codes)
    assert bf16.dtype == torch.float32 and bf16.shape == f32.shape
    assert float((bf16 - f32).abs().mean()) < 0.1 * float(f32.abs().mean())
    streamed = stream(codec, codes[0], [4, 26])
    assert float((streamed - bf16[0]).abs().mean()) < 0.1 * float(f32.abs().mean())


def test_a_dilated_convolution_over_its_phases_is_the_dilated_convolution():
    """``polyphase_conv1d`` (what CUDA runs for widely dilated convolutions) gives the
    dilated convolution's samples: lengths that do and do not fill whole phases, one group
    and depthwise, with and without a bias; a phase mixed up would move every sample."""
    import torch.nn.functional as F

    from omni_async.speech.codec_layers import polyphase_conv1d

    gen = torch.Generator().manual_seed(11)
    for b, c, o, k, d, t, groups in [(2, 6, 5, 7, 9, 40, 1), (1, 4, 4, 7, 3, 17, 4), (3, 3, 2, 3, 2, 1, 1)]:
        x = torch.randn(b, c, t + (k - 1) * d, generator=gen)
        w, bias = torch.randn(o, c // groups, k, generator=gen), torch.randn(o, generator=gen)
        for bb in (bias, None):
            want = F.conv1d(x, w, bb, dilation=d, groups=groups)
            got = polyphase_conv1d(x, w, bb, d, groups)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
