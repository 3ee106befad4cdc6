"""The vocoder's convolution as one Triton implicit GEMM (``kernels/conv1d.py``) against
``F.conv1d``: on the CPU through Triton's interpreter (a process of its own), on CUDA
compiled, in bfloat16, alone and as the codec's convolutions (``codec_layers.TRITON_CONV``)
in a streamed decode."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from .triton_interpreter import interpreter_only, run_interpreted  # noqa: E402

# (batch, in channels, out channels, kernel, dilation, output samples, tile): the codec's
# kinds (kernel 7 dilated 1 / 3 / 9, pointwise, the 1,536-channel input), sizes that end
# mid-tile, an input that is a slice along time.
SHAPES = [
    (2, 24, 40, 7, 1, 50, (16, 32, 16, 4, 1)),
    (1, 16, 16, 7, 3, 70, (16, 32, 16, 4, 1)),
    (2, 20, 16, 7, 9, 80, (16, 64, 32, 4, 1)),
    (3, 32, 8, 1, 1, 33, (16, 32, 16, 4, 1)),
    (1, 48, 24, 7, 1, 17, (32, 16, 16, 4, 1)),
]

SCRIPT = r"""
import torch, torch.nn.functional as F
from omni_async.kernels import conv1d as cv
torch.manual_seed(0)
for b, c, o, k, d, t, tile in SHAPES:
    cv.TILE = tile
    x = torch.randn(b, c, t + (k - 1) * d + 3)[..., 3:]
    w = torch.randn(o, c, k) / (c * k) ** 0.5
    bias = torch.randn(o)
    for bb in (bias, None):
        got, want = cv.conv1d(x, w, bb, d), F.conv1d(x, w, bb, dilation=d)
        assert got.shape == want.shape, (got.shape, want.shape)
        assert (got - want).abs().max().item() < 1e-4, (b, c, o, k, d, t, (got - want).abs().max().item())
try:
    cv.conv1d(torch.randn(1, 4, 5), torch.randn(2, 4, 7), None, 1)
    raise SystemExit("no error for too few samples")
except ValueError:
    pass
print("ok")
"""


@interpreter_only
def test_the_kernel_equals_conv1d_in_the_interpreter():
    done = run_interpreted(f"SHAPES = {SHAPES!r}\n" + SCRIPT, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_equals_conv1d_in_bfloat16(shape):
    from omni_async.kernels import conv1d as cv

    b, c, o, k, d, t, _ = shape
    x = torch.randn(b, c, t + (k - 1) * d, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(o, c, k, device="cuda") / (c * k) ** 0.5).bfloat16()
    bias = torch.randn(o, device="cuda", dtype=torch.bfloat16)
    want = torch.nn.functional.conv1d(x.float(), w.float(), bias.float(), dilation=d)
    got = cv.conv1d(x, w, bias, d)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max().item() <= 0.02 * want.abs().max().item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_codec_decodes_the_same_audio_with_its_convolutions_in_triton(monkeypatch):
    """Two chunks of four streams, the released decoder's size at random bfloat16 weights:
    the PCM with every convolution in the Triton kernel within bfloat16's reach of cuDNN's."""
    from omni_async.speech import codec_layers
    from omni_async.speech.codec import CodecDecoder
    from omni_async.speech.codec_config import CodecConfig
    from omni_async.speech.codec_slots import CodecSlots

    dec = CodecDecoder.random(CodecConfig.qwen3_tts_12hz(), device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator("cuda").manual_seed(0)
    chunks = [torch.randint(0, 2048, (4, f, 16), device="cuda", generator=gen) for f in (2, 4)]

    def decode() -> torch.Tensor:
        slots = CodecSlots(dec, 4)
        opened = [slots.open() for _ in range(4)]
        with torch.inference_mode():
            return torch.cat([slots.run(c, opened).float() for c in chunks], dim=-1)

    want = decode()
    monkeypatch.setattr(codec_layers, "TRITON_CONV", True)
    got = decode()
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item()
