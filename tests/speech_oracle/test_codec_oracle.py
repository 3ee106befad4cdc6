"""Our speech-tokenizer decoder against the reference's audio for the same codes, float32 on
CPU: every case's PCM within 1e-4 of the reference's ``speech_tokenizer.decode`` (measured:
a few 1e-6), and past 300 frames the one-shot decode, which the reference's own decode is
not (it decodes 300-frame pieces with 25 frames of context)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_async.speech.codec import CodecDecoder

from .conftest import MAIN_CASES

TOL = 1e-4
CHUNKED_FRAMES = 300  # the reference's decode piece


@pytest.fixture(scope="module")
def codec(tts_model_dir) -> CodecDecoder:
    return CodecDecoder.from_folder(tts_model_dir / "speech_tokenizer")


def _max_diff(ours: torch.Tensor, ref: np.ndarray) -> float:
    assert ours.shape == ref.shape, (tuple(ours.shape), ref.shape)
    return float(np.abs(ours.numpy() - ref).max()) if ref.size else 0.0


def test_the_checkpoint_layout(codec, reference_summary):
    meta = reference_summary["meta"]
    assert codec.sample_rate == meta["sample_rate"] == 24000
    assert codec.samples_per_frame == meta["decode_upsample_rate"] == 1920


@pytest.mark.parametrize("case", MAIN_CASES)
def test_each_main_case_decodes_to_the_reference_wav(codec, reference_arrays, case):
    codes = torch.from_numpy(reference_arrays[f"{case}/codes"])
    ref = reference_arrays[f"{case}/wav"]
    assert codes.shape[0] * 1920 == ref.shape[0] > 0
    assert _max_diff(codec.decode(codes[None])[0], ref) < TOL


def test_every_other_case_decodes_to_the_reference_wav(codec, reference_arrays):
    """The batched, streamed-text and Auto-language extras: each pair of codes and wav."""
    names = sorted(k[:-len("/codes")] for k in reference_arrays if k.endswith("/codes")
                   and not k.startswith(("main/", "decode330/")) and f"{k[:-len('/codes')]}/wav" in reference_arrays)
    assert len(names) >= 3
    diffs = {n: _max_diff(codec.decode(torch.from_numpy(reference_arrays[f"{n}/codes"])[None])[0],
                          reference_arrays[f"{n}/wav"]) for n in names}
    assert max(diffs.values()) < TOL, diffs


def test_the_main_cases_in_one_padded_batch(codec, reference_arrays):
    """Rows of different lengths padded with -1, as the reference batches them."""
    codes = [torch.from_numpy(reference_arrays[f"{c}/codes"]) for c in MAIN_CASES]
    batch = torch.full((len(codes), max(c.shape[0] for c in codes), 16), -1, dtype=torch.long)
    for i, c in enumerate(codes):
        batch[i, :c.shape[0]] = c
    out = codec.decode(batch)
    for i, case in enumerate(MAIN_CASES):
        ref = reference_arrays[f"{case}/wav"]
        assert _max_diff(out[i, :ref.shape[0]], ref) < TOL, case
        assert not out[i, ref.shape[0]:].any(), case


def test_330_frames_decode_to_the_one_shot_reference(codec, reference_arrays):
    codes = torch.from_numpy(reference_arrays["decode330/codes"])
    assert codes.shape == (330, 16)
    assert _max_diff(codec.decode(codes[None])[0], reference_arrays["decode330/wav_unchunked_decoder"]) < TOL


@pytest.mark.parametrize("split", [[1] * 80 + [250], [3, 7, 25, 295], [72, 1, 257], [330]],
                         ids=["ones-then-250", "3-7-25-295", "72-1-257", "whole"])
def test_330_frames_streamed_decode_to_the_one_shot_reference(codec, reference_arrays, split):
    codes = torch.from_numpy(reference_arrays["decode330/codes"])
    state, pieces, start = codec.new_state(), [], 0
    for n in split:
        pieces.append(codec.decode_chunk(codes[start:start + n], state))
        start += n
    assert start == 330
    assert _max_diff(torch.cat(pieces), reference_arrays["decode330/wav_unchunked_decoder"]) < TOL


def test_the_reference_chunked_decode_differs_past_300_frames(codec, reference_arrays):
    """What docs/speech.md says: the reference's own decode equals ours up to frame 300 and not
    after (its second piece sees 25 frames of context, ours all of them)."""
    ours = codec.decode(torch.from_numpy(reference_arrays["decode330/codes"])[None])[0].numpy()
    chunked = reference_arrays["decode330/wav_chunked_reference"]
    cut = CHUNKED_FRAMES * 1920
    assert np.abs(ours[:cut] - chunked[:cut]).max() < TOL
    assert np.abs(ours[cut:] - chunked[cut:]).max() > 1e-2
