"""A waveform at another sample rate: polyphase windowed-sinc resampling in torch.

Why here: an encoder hears audio at one rate (Qwen3-Omni's: 16 kHz), clients send what
their microphones and files hold (44.1 and 48 kHz mostly), and refusing them moves a
resampler into every client. The output sample ``k`` sits at input position ``k * rate_in
/ rate_out``; it is the input convolved with a low-pass sinc (cut at the lower of the two
Nyquist frequencies, so nothing above the target's Nyquist aliases back in) under a Hann
window ``ZEROS`` zero crossings wide on each side. With ``up / down`` the reduced ratio
``rate_out / rate_in``, outputs fall on ``up`` phases of the input grid, one kernel each,
and all of them are one strided ``conv1d``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["resample", "resampled_length", "MIN_RATE", "MAX_RATE"]

# Zero crossings of the sinc kept on each side (the kernel's reach, in units of the cut-off).
ZEROS = 16
# Sample rates taken at all (telephone 8 kHz is common; below 1 kHz is not speech audio).
MIN_RATE, MAX_RATE = 1_000, 384_000


def _ratio(rate: int, to: int) -> tuple[int, int]:
    g = math.gcd(rate, to)
    return to // g, rate // g


def resampled_length(samples: int, rate: int, to: int) -> int:
    """Samples of ``samples`` at ``rate`` once at ``to``: every output whose time falls
    within the input's span, ``ceil(samples * to / rate)``."""
    up, down = _ratio(rate, to)
    return -(-samples * up // down)


@torch.inference_mode()
def resample(wave: np.ndarray, rate: int, to: int) -> np.ndarray:
    """``wave`` (1-D float32) sampled at ``rate`` Hz, at ``to`` Hz (float32)."""
    up, down = _ratio(rate, to)
    if up == down:
        return wave
    cutoff = 0.5 * min(1.0, up / down)  # cycles per input sample
    reach = math.ceil(ZEROS / (2 * cutoff))  # input samples on each side of an output
    width = 2 * reach + down
    # Phase p's kernel: tap j reads input (start + j), at distance d from its output's position.
    offsets = torch.arange(up, dtype=torch.float64)[:, None] * down / up
    d = torch.arange(width, dtype=torch.float64)[None, :] - reach - offsets
    window = torch.where(d.abs() <= reach, 0.5 + 0.5 * torch.cos(math.pi * d / reach), torch.zeros_like(d))
    kernels = (2 * cutoff * torch.sinc(2 * cutoff * d) * window).to(torch.float32)[:, None, :]
    x = torch.from_numpy(np.ascontiguousarray(wave, dtype=np.float32))
    padded = torch.nn.functional.pad(x[None, None], (reach, reach + down))
    phases = torch.nn.functional.conv1d(padded, kernels, stride=down)[0]  # [up, outputs a phase]
    out = phases.T.reshape(-1)[: resampled_length(x.shape[0], rate, to)]
    return out.numpy().astype(np.float32, copy=False)
