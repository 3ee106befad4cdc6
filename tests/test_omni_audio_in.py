"""Qwen3-Omni hears: a prompt's audio through the thinker's log-mel features and audio
encoder into its input embeddings, against transformers (float32, CPU, the tiny random
checkpoint of tests/test_omni_talker.py with its audio tower's weights spread and its
attention windows shortened to two chunks, saved with a Whisper feature extractor's
preprocessor_config.json): our features equal the feature extractor's ``input_features``
as the processor calls it, our encoder's rows its audio tower's, the placeholders expand
to the processor's counts, and with an audio prompt the reply's tokens and the talker's
codes equal ``generate(input_features=..., return_audio=True, talker_do_sample=False)``'s
in every loop; the audio decides them; bad audio gets typed errors and the pipeline
carries on."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from omni_async.errors import InvalidRequestError, ModelLoadError
from omni_async.models.audio_encoder import AudioEncoder
from omni_async.models.audio_features import LogMel, LogMelConfig
from omni_async.speech.omni_hearing import AudioPart
from omni_async.speech.omni_pipeline import OmniPipeline

from .conftest import LOOPS
from .test_omni_chain import assert_stages_free, pipeline
from .test_omni_talker import AUDIO, chat_prompt, reference_run, spread, talker_config

RATE = 16000
MELS = 16  # the tiny audio encoder's num_mel_bins
AUDIO_START, AUDIO_END = 509, 510
THINKER_EOS = 501


def hearing_config():
    cfg = talker_config()
    cfg.thinker_config.audio_config.n_window_infer = 200  # attention windows of two chunks (26 rows)
    return cfg


def processor_features(waves: list[np.ndarray]):
    """What Qwen3OmniMoeProcessor hands the model for these audios: the feature
    extractor called with the processor's audio arguments, the mask renamed."""
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=MELS, return_attention_mask=True)
    out = fe(waves, sampling_rate=RATE, padding=True, truncation=False, return_attention_mask=True, return_tensors="pt")
    return out["input_features"], out["attention_mask"]


def placeholder_counts(mask: torch.Tensor) -> list[int]:
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    return _get_feat_extract_output_lengths(mask.sum(-1), 50).tolist()


def waveform(seconds: float, seed: int) -> np.ndarray:
    """Speech-like test audio: a few tones under noise, float32 in [-1, 1]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    tones = sum(np.sin(2 * np.pi * f * t + rng.uniform(0, 6)) for f in rng.uniform(120, 3000, 3))
    return (0.2 * tones / 3 + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


@pytest.fixture(scope="module")
def hearing_model(tmp_path_factory):
    """(folder, transformers' model): the talker tests' tiny Qwen3-Omni, its audio tower
    drawn wide (rows the size of the thinker's embeddings), saved with its extractor."""
    from transformers import Qwen3OmniMoeForConditionalGeneration, WhisperFeatureExtractor

    folder = tmp_path_factory.mktemp("omni_hearing") / "ck"
    torch.manual_seed(1)
    reference = Qwen3OmniMoeForConditionalGeneration(hearing_config()).eval()
    spread(reference.talker)
    with torch.no_grad():
        # transformers 5 holds the tower in the thinker's model, 4.57 (the GPU machine's) on the thinker
        tower = getattr(reference.thinker, "audio_tower", None) or reference.thinker.model.audio_tower
        for name, p in tower.named_parameters():
            p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.3)
    reference.save_pretrained(folder)
    WhisperFeatureExtractor(feature_size=MELS).save_pretrained(folder)
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    model.thinker.config.vision_start_token_id = 151652  # read by 5.25's text-only position ids
    return folder, model


# Audios of one request: 3.3 s (three full chunks and a tail, two attention windows) and
# 0.703 s (one short chunk, padded to the request's longest in the convolutions).
LENGTHS = (3.31, 0.703)


def test_features_equal_the_processors():
    waves = [waveform(s, i) for i, s in enumerate(LENGTHS)] + [waveform(1.0, 9)]
    ref, mask = processor_features(waves)
    ours = LogMel(LogMelConfig(feature_size=MELS)).features(waves, RATE)
    for i, got in enumerate(ours):
        n = int(mask[i].sum())
        assert got.shape == (MELS, n)
        torch.testing.assert_close(got, ref[i, :, :n], atol=1e-5, rtol=0)
    alone = LogMel(LogMelConfig(feature_size=MELS)).features(waves[1:2], RATE)[0]
    # padded with the others it has one frame more (the extractor's mask rounds its length up)
    assert alone.shape[1] + 1 == ours[1].shape[1]


def test_the_extractors_parameters_come_from_the_folder(hearing_model, tmp_path):
    folder, _ = hearing_model
    cfg = LogMelConfig.from_folder(folder)
    assert (cfg.feature_size, cfg.sampling_rate, cfg.hop_length, cfg.n_fft) == (MELS, RATE, 160, 400)
    with pytest.raises(ModelLoadError, match="preprocessor_config.json"):
        LogMelConfig.from_folder(tmp_path)


def test_encoder_rows_equal_the_audio_towers(hearing_model):
    folder, model = hearing_model
    encoder = AudioEncoder.from_folder(folder)
    waves = [waveform(s, i) for i, s in enumerate(LENGTHS)]
    ref_features, mask = processor_features(waves)
    with torch.no_grad():
        ref = model.thinker.model.get_audio_features(ref_features, mask).last_hidden_state
    feats = LogMel(LogMelConfig.from_folder(folder)).features(waves, RATE)
    rows = encoder.encode(feats)
    assert [r.shape[0] for r in rows] == placeholder_counts(mask) == [encoder.output_length(f.shape[1]) for f in feats]
    assert rows[0].shape[0] > 26  # more than one attention window
    torch.testing.assert_close(torch.cat(rows), ref, atol=1e-5, rtol=1e-5)
    # the convolutions a chunk at a time (what bounds their memory on long audio): the same rows
    encoder.config = dataclasses.replace(encoder.config, conv_chunksize=1)
    torch.testing.assert_close(torch.cat(encoder.encode(feats)), ref, atol=1e-5, rtol=1e-5)
    # one audio alone is its own batch: its chunks are not padded to another's
    with torch.no_grad():
        f, m = processor_features(waves[:1])
        alone = model.thinker.model.get_audio_features(f, m).last_hidden_state
    torch.testing.assert_close(encoder.encode(LogMel(LogMelConfig(feature_size=MELS)).features(waves[:1], RATE))[0], alone,
                               atol=1e-5, rtol=1e-5)


def audio_prompt(placeholders: int = 1) -> list[int]:
    """The chat prompt with audio in its user turn, as the template writes it: start,
    one placeholder per audio, end."""
    user = [20]
    for _ in range(placeholders):
        user += [AUDIO_START, AUDIO, AUDIO_END]
    return chat_prompt(user + [31, 44])


def reference_generate(model, prompt: list[int], waves: list[np.ndarray], *, reply: int, frames: int, penalty: float = 1.05):
    """transformers' ``generate`` on the processor's inputs for ``prompt`` (each audio's
    placeholder expanded to its count) and ``waves``, greedy everywhere: the expanded
    ids, the thinker's result and the codes it handed to code2wav ``[frames, groups]``."""
    features, mask = processor_features(waves)
    counts = iter(placeholder_counts(mask))
    ids = [t for tok in prompt for t in ([tok] * next(counts) if tok == AUDIO else [tok])]
    thinker, codes = reference_run(model, ids, reply=reply, frames=frames, penalty=penalty, input_features=features,
                                   feature_attention_mask=mask)
    return ids, thinker, codes


# (audio lengths in seconds, thinker reply tokens, frames asked)
CASES = [((3.31,), 6, 14), ((3.31, 0.703), 5, 10)]


@pytest.fixture(scope="module")
def expected(hearing_model):
    _, model = hearing_model
    out = []
    for lengths, reply, frames in CASES:
        waves = [waveform(s, i) for i, s in enumerate(lengths)]
        ids, thinker, codes = reference_generate(model, audio_prompt(len(waves)), waves, reply=reply, frames=frames)
        out.append((waves, ids, thinker, codes))
    return out


async def test_the_thinkers_prompt_is_the_references_input_embeddings(hearing_model, expected):
    folder, _ = hearing_model
    async with pipeline(folder, "normal") as pipe:
        for (lengths, _, _), (waves, ids, thinker, _) in zip(CASES, expected):
            prompt = await pipe.thinker_prompt(input_ids=audio_prompt(len(waves)), audio=[AudioPart(w, RATE) for w in waves])
            assert prompt.ids == ids
            torch.testing.assert_close(prompt.embeds, thinker.hidden_states[0][0][0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("loop", LOOPS)
async def test_reply_and_codes_with_audio_equal_generate(hearing_model, expected, loop):
    """Both cases at once through the three stages, the audio heard by our encoder: the
    thinker's tokens and the talker's frames as transformers' ``generate`` writes them
    from the processor's features."""
    folder, _ = hearing_model
    async with pipeline(folder, loop) as pipe:
        results = await asyncio.gather(*(
            pipe.chat(input_ids=audio_prompt(len(waves)), audio=[AudioPart(w, RATE) for w in waves], voice="ethan",
                      sampling=dict(max_new_tokens=reply, stop_token_ids=[THINKER_EOS]), max_frames=frames)
            for (_, reply, frames), (waves, _, _, _) in zip(CASES, expected)))
        for result, (waves, ids, thinker, codes), case in zip(results, expected, CASES):
            assert codes.shape[0] == case[2]  # the talker spoke for its whole budget
            assert result.output_ids == thinker.sequences[0, len(ids):].tolist()
            assert result.codes.tolist() == codes.tolist()
        await assert_stages_free(pipe)


async def test_the_audio_decides_the_reply(hearing_model, expected):
    """Another audio of the same length (the same prompt ids) gives another reply or
    other codes: what the equality above would miss if the audio rows were dropped."""
    folder, _ = hearing_model
    (_, reply, frames), (waves, _, _, codes) = CASES[0], expected[0]
    async with pipeline(folder, "overlap") as pipe:
        heard = [await pipe.chat(input_ids=audio_prompt(), audio=[AudioPart(w, RATE)], sampling=dict(max_new_tokens=reply),
                                 max_frames=frames) for w in (waves[0], waveform(3.31, 7))]
        assert heard[0].codes.tolist() == codes.tolist()
        assert heard[0].output_ids != heard[1].output_ids or heard[0].codes.tolist() != heard[1].codes.tolist()


async def test_bad_audio_gets_typed_errors_and_the_pipeline_carries_on(hearing_model, expected):
    folder, _ = hearing_model
    (_, reply, frames), (waves, ids, thinker, codes) = CASES[0], expected[0]
    good = AudioPart(waves[0], RATE)
    async with pipeline(folder, "normal") as pipe:
        bad = [(dict(audio=[AudioPart(waves[0], 500)]), "500 Hz is not taken"),
               (dict(audio=[AudioPart(waves[0][:100], RATE)]), "too short"),
               (dict(audio=[AudioPart(np.zeros((2, 8000), np.float32), RATE)]), "1-D float"),
               (dict(audio=[AudioPart((waves[0] * 100).astype(np.int16), RATE)]), "1-D float"),
               (dict(audio=[AudioPart(np.full(8000, np.nan, np.float32), RATE)]), "non-finite"),
               (dict(audio=[good, good]), "1 audio placeholder"),
               (dict(input_ids=chat_prompt([20, 31]), audio=[good]), "0 audio placeholder"),
               (dict(audio=[AudioPart(np.zeros(90 * RATE, np.float32), RATE)]), "context holds 1024")]  # 1,170 rows
        for kwargs, match in bad:
            kwargs.setdefault("input_ids", audio_prompt())
            with pytest.raises(InvalidRequestError, match=match):
                await pipe.chat(sampling=dict(max_new_tokens=reply), max_frames=frames, **kwargs)
        with pytest.raises(InvalidRequestError, match="audio part is"):
            await pipe.chat([{"role": "user", "content": [{"type": "audio", "audio": waves[0]}]}])
        with pytest.raises(InvalidRequestError, match="input_audio parts"):
            await pipe.chat([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}])
        result = await pipe.chat(input_ids=audio_prompt(), audio=[good], sampling=dict(max_new_tokens=reply, stop_token_ids=[THINKER_EOS]),
                                 max_frames=frames)
        assert result.output_ids == thinker.sequences[0, len(ids):].tolist() and result.codes.tolist() == codes.tolist()
        await assert_stages_free(pipe)


async def test_a_folder_without_an_audio_encoder_refuses_audio(hearing_model, tmp_path):
    import json
    import shutil

    folder, _ = hearing_model
    deaf = tmp_path / "deaf"
    shutil.copytree(folder, deaf)
    raw = json.loads((deaf / "config.json").read_text())
    del raw["thinker_config"]["audio_config"]
    (deaf / "config.json").write_text(json.dumps(raw))
    async with OmniPipeline.from_pretrained(deaf, loop="normal", codec=pipeline_codec()) as pipe:
        assert pipe.hearing is None
        with pytest.raises(InvalidRequestError, match="cannot hear"):
            await pipe.chat(input_ids=audio_prompt(), audio=[AudioPart(waveform(1.0, 0), RATE)])


def pipeline_codec():
    from .test_omni_chain import stand_in_codec

    return stand_in_codec()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("loop", LOOPS)
async def test_on_cuda_the_reply_and_codes_with_audio_equal_generate(hearing_model, expected, loop):
    """On CUDA in float32 (the encoder on the pipeline's input thread, the thinker's and
    talker's fused kernels): both cases' tokens and codes as ``generate`` writes them.
    cuDNN's TF32 convolutions are turned off for the comparison (float32 throughout)."""
    folder, _ = hearing_model
    tf32, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, False
    try:
        async with OmniPipeline.from_pretrained(folder, device="cuda", dtype="float32", loop=loop) as pipe:
            assert pipe.hearing is not None and pipe.hearing.encoder.proj2.weight.device.type == "cuda"
            results = await asyncio.gather(*(
                pipe.chat(input_ids=audio_prompt(len(waves)), audio=[AudioPart(w, RATE) for w in waves],
                          sampling=dict(max_new_tokens=reply, stop_token_ids=[THINKER_EOS]), max_frames=frames)
                for (_, reply, frames), (waves, _, _, _) in zip(CASES, expected)))
            for result, (_, ids, thinker, codes) in zip(results, expected):
                assert result.output_ids == thinker.sequences[0, len(ids):].tolist()
                assert result.codes.tolist() == codes.tolist()
            await assert_stages_free(pipe)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


async def test_a_random_weight_folder_hears_with_an_encoder_drawn_from_its_seed(tmp_path):
    """A folder of config.json and random_weights.json (speed runs) hears: its encoder is
    drawn from the seed (features at the config's mel bins), so one seed hears one audio
    the same way twice and another seed another way."""
    import json

    from omni_async.models.random_weights import RANDOM_WEIGHTS_FILE

    replies = []
    for i, seed in enumerate((3, 3, 4)):
        folder = tmp_path / f"seed{seed}-{i}"
        config = hearing_config()
        config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
        config.save_pretrained(folder)
        (folder / RANDOM_WEIGHTS_FILE).write_text(json.dumps({"seed": seed}))
        async with OmniPipeline.from_pretrained(folder, loop="normal", codec=pipeline_codec()) as pipe:
            assert pipe.hearing is not None and pipe.hearing.features.config.feature_size == MELS
            prompt = await pipe.thinker_prompt(input_ids=audio_prompt(), audio=[AudioPart(waveform(1.5, 2), RATE)])
            replies.append(prompt.embeds[prompt.ids.index(AUDIO)])
    same, again, other = replies
    assert torch.equal(same, again) and not torch.equal(same, other)
