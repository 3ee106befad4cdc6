"""The resampler that takes a client's audio to the rate an encoder hears
(``omni_async.models.resample``): tones come out as the same tones sampled at the new rate,
content above the new Nyquist frequency does not alias back, lengths follow the rates."""

from __future__ import annotations

import numpy as np
import pytest

from omni_async.models.resample import resample, resampled_length


def tones(rate: int, seconds: float, freqs: list[tuple[float, float]]) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return sum(a * np.sin(2 * np.pi * f * t) for f, a in freqs).astype(np.float32)


@pytest.mark.parametrize("rate", [8_000, 22_050, 32_000, 44_100, 48_000, 96_000])
def test_tones_come_out_as_the_same_tones_at_16k(rate):
    freqs = [(440.0, 0.5), (3100.0, 0.3)]
    out = resample(tones(rate, 1.5, freqs), rate, 16_000)
    want = tones(16_000, 1.5, freqs)
    assert out.dtype == np.float32 and out.shape[0] == resampled_length(int(rate * 1.5), rate, 16_000) == want.shape[0]
    inner = slice(100, -100)  # (the ends see the zeros past the signal)
    assert np.abs(out[inner] - want[inner]).max() < 2e-4


@pytest.mark.parametrize("rate", [32_000, 44_100, 48_000])
def test_what_lies_above_the_new_nyquist_does_not_alias(rate):
    out = resample(tones(rate, 1.0, [(11_000.0, 0.5)]), rate, 16_000)  # folds to 5 kHz if unfiltered
    assert np.abs(out[100:-100]).max() < 1e-3


def test_equal_rates_return_the_samples_and_lengths_round_up():
    x = tones(16_000, 0.1, [(300.0, 0.5)])
    assert resample(x, 16_000, 16_000) is x
    assert resampled_length(441, 44_100, 16_000) == 160
    assert resampled_length(442, 44_100, 16_000) == 161
    assert resampled_length(1, 8_000, 16_000) == 2
