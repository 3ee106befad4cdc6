"""Log-mel features of speech, as a Whisper-style feature extractor computes them: what an
audio encoder (Qwen3-Omni's thinker, :mod:`.audio_encoder`) reads.

The parameters come from the checkpoint folder's ``preprocessor_config.json`` (the
processor's ``WhisperFeatureExtractor``: ``feature_size`` mel bins, ``sampling_rate``,
``hop_length``, ``n_fft``, ``padding_value``, ``dither``), read once here with numpy and
torch only. The computation is the extractor's torch path: a centred STFT with a Hann
window (reflect padding), the power spectrum without its last frame, Slaney mel filters
from 0 to 8 kHz, ``log10`` floored at ``1e-10``, each audio's values floored at its
maximum minus 8, then ``(x + 4) / 4``.

Several audios of one request are featurised together, as the processor featurises a
prompt's audios: each is padded with ``padding_value`` to the longest, so a shorter one's
last frames and its maximum see that padding, and its length in frames is what the
extractor's rescaled attention mask counts. Resampling is the caller's: an audio at
another rate is refused (:class:`~omni_async.errors.InvalidRequestError`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..errors import InvalidRequestError, ModelLoadError
from .config import read_folder_json
from .resample import MAX_RATE, MIN_RATE, resample, resampled_length

__all__ = ["LogMelConfig", "LogMel", "PREPROCESSOR_FILE"]

PREPROCESSOR_FILE = "preprocessor_config.json"
MAX_FREQUENCY = 8000.0  # the extractor's mel filters stop at 8 kHz whatever the rate


@dataclass(frozen=True)
class LogMelConfig:
    feature_size: int = 128
    sampling_rate: int = 16000
    hop_length: int = 160
    n_fft: int = 400
    padding_value: float = 0.0
    dither: float = 0.0

    @classmethod
    def from_folder(cls, folder: str | Path) -> "LogMelConfig":
        raw, path = read_folder_json(folder, PREPROCESSOR_FILE, "the audio feature extractor's parameters")
        kind = raw.get("feature_extractor_type", "WhisperFeatureExtractor")
        if kind != "WhisperFeatureExtractor":
            raise ModelLoadError(f"{path}: feature extractor {kind!r} is not supported (WhisperFeatureExtractor is)")
        try:
            return cls(**{k: type(getattr(cls, k))(raw[k]) for k in cls.__dataclass_fields__ if k in raw})
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{path}: malformed feature extractor parameters ({exc})") from None


class LogMel:
    """``features(waveforms, sample_rate)``: one ``[feature_size, frames]`` float32 tensor
    per audio (on the CPU)."""

    def __init__(self, config: LogMelConfig) -> None:
        self.config = config
        self.filters = torch.from_numpy(mel_filters(config)).to(torch.float32)  # [n_fft // 2 + 1, mels]
        self.window = torch.hann_window(config.n_fft)

    @property
    def min_samples(self) -> int:
        """The shortest audio the STFT's reflect padding takes (more than half a window)."""
        return self.config.n_fft // 2 + 1

    def frames(self, samples: int, padded: int) -> int:
        """An audio's length in frames when padded to ``padded`` samples: the extractor's
        attention mask taken every ``hop_length`` samples, less its last column when the
        padded length is not a multiple of the hop."""
        hop = self.config.hop_length
        columns = -(-padded // hop) - (1 if padded % hop else 0)
        return min(-(-samples // hop), columns)

    def heard(self, waveform: object, sample_rate: int, where: str = "audio") -> np.ndarray:
        """A client's mono float waveform at any rate from 1 kHz to 384 kHz, checked and
        resampled to the extractor's rate (:mod:`omni_async.models.resample`)."""
        wave = self.check(waveform, sample_rate, where)
        return resample(wave, sample_rate, self.config.sampling_rate)

    def heard_length(self, samples: int, sample_rate: int) -> int:
        """Samples of an audio of ``samples`` at ``sample_rate`` once :meth:`heard` (no
        resampling done: what its placeholder count needs)."""
        return resampled_length(samples, sample_rate, self.config.sampling_rate)

    def check(self, waveform: object, sample_rate: int, where: str = "audio") -> np.ndarray:
        """A mono float waveform as float32 with a sample rate the resampler takes, or
        InvalidRequestError."""
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or not MIN_RATE <= sample_rate <= MAX_RATE:
            raise InvalidRequestError(f"{where}: a sample rate of {sample_rate!r} Hz is not taken (from {MIN_RATE} to {MAX_RATE} Hz)")
        try:
            wave = np.asarray(waveform)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"{where}: not an array of samples ({exc})") from None
        if wave.ndim != 1 or wave.dtype.kind != "f":
            raise InvalidRequestError(f"{where}: must be a 1-D float array of mono samples, got {wave.dtype} of shape {wave.shape}")
        if wave.shape[0] < self.min_samples:
            raise InvalidRequestError(f"{where}: {wave.shape[0]} samples is too short (at least {self.min_samples})")
        wave = wave.astype(np.float32, copy=False)
        if not np.isfinite(wave).all():
            raise InvalidRequestError(f"{where}: holds a non-finite sample (nan or inf)")
        return wave

    @torch.inference_mode()
    def features(self, waveforms: Sequence[np.ndarray], sample_rate: int) -> list[torch.Tensor]:
        """The log-mel features of a request's audios at the extractor's rate (:meth:`heard`
        takes them there), featurised together (the module's docstring), each cut to its own
        frames."""
        if sample_rate != self.config.sampling_rate:
            raise InvalidRequestError(f"features take audio at {self.config.sampling_rate} Hz, got {sample_rate} Hz")
        waves = [self.check(w, sample_rate, f"audio {i}") for i, w in enumerate(waveforms)]
        if not waves:
            return []
        cfg = self.config
        padded = max(w.shape[0] for w in waves)
        batch = torch.full((len(waves), padded), cfg.padding_value, dtype=torch.float32)
        for row, w in zip(batch, waves):
            row[:w.shape[0]] = torch.from_numpy(w)
        if cfg.dither:
            batch += cfg.dither * torch.randn(batch.shape)
        stft = torch.stft(batch, cfg.n_fft, cfg.hop_length, window=self.window, return_complex=True)
        power = (stft[..., :-1].abs() ** 2).contiguous()
        log_spec = torch.clamp(self.filters.T @ power, min=1e-10).log10()
        peak = log_spec.amax(dim=(1, 2), keepdim=True)
        log_spec = (torch.maximum(log_spec, peak - 8.0) + 4.0) / 4.0
        return [log_spec[i, :, :self.frames(w.shape[0], padded)].clone() for i, w in enumerate(waves)]


def mel_filters(cfg: LogMelConfig) -> np.ndarray:
    """Slaney-scale, Slaney-normalised triangular filters ``[n_fft // 2 + 1, mels]`` from
    0 Hz to 8 kHz over the FFT bins (float64)."""
    mel_lo, mel_hi = _hz_to_mel(np.array(0.0)), _hz_to_mel(np.array(MAX_FREQUENCY))
    centres = _mel_to_hz(np.linspace(mel_lo, mel_hi, cfg.feature_size + 2))
    bins = np.linspace(0, cfg.sampling_rate // 2, cfg.n_fft // 2 + 1)
    slopes = centres[None, :] - bins[:, None]
    width = np.diff(centres)
    down, up = -slopes[:, :-2] / width[:-1], slopes[:, 2:] / width[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    return filters * (2.0 / (centres[2:] - centres[:-2]))[None, :]


_LOG_HZ, _LOG_MEL, _LOG_STEP = 1000.0, 15.0, 27.0 / np.log(6.4)


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    hz = np.asarray(hz, dtype=np.float64)
    return np.where(hz >= _LOG_HZ, _LOG_MEL + np.log(np.maximum(hz, 1e-30) / _LOG_HZ) * _LOG_STEP, 3.0 * hz / 200.0)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    return np.where(mel >= _LOG_MEL, _LOG_HZ * np.exp((mel - _LOG_MEL) / _LOG_STEP), 200.0 * mel / 3.0)
