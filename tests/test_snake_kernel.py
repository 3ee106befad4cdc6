"""The vocoder's one-pass SnakeBeta kernel (what CUDA runs) against the torch ops of
:class:`omni_async.speech.codec_layers.SnakeBeta`: on the CPU through Triton's interpreter
in a process of its own, on CUDA directly (and the codec's graphed calls use it)."""

from __future__ import annotations

import pytest
import torch

from .triton_interpreter import interpreted_result, interpreter_only, needs_triton

COMPARE = r'''
import torch
from omni_async.kernels.snake import residual_sum, snake_beta


def reference(x, alpha, beta):
    a = alpha.exp()[None, :, None]
    return x + (1.0 / (beta.exp()[None, :, None] + 1e-9)) * torch.sin(x * a).pow(2)


def compare(device, dtype, shapes):
    gen = torch.Generator().manual_seed(3)
    worst = 0.0
    for b, c, t in shapes:
        x = (torch.randn(b, c, t, generator=gen) * 2).to(device, dtype)
        alpha, beta = (torch.randn(c, generator=gen) * 0.5).to(device), (torch.randn(c, generator=gen) * 0.5).to(device)
        got = snake_beta(x, alpha, beta)
        past = (torch.randn(b, c, 5, generator=gen)).to(device, dtype)  # written before the activation, one buffer
        assert torch.equal(snake_beta(x, alpha, beta, past=past), torch.cat([past, got], dim=-1))
        sliced = torch.cat([x, x], dim=-1)[..., 3:3 + t]  # a strided view, read in place
        assert torch.equal(snake_beta(sliced, alpha, beta), snake_beta(sliced.contiguous(), alpha, beta))
        assert got.shape == x.shape and got.dtype == dtype
        want = reference(x.double(), alpha.double(), beta.double())
        worst = max(worst, ((got.double() - want).abs() / (1 + want.abs())).max().item())
        # A convolution's bias left out of it: the activation of x + bias, the residual sum
        # x + (y + bias), each rounded to the dtype where torch's add rounds.
        bias, y = torch.randn(c, generator=gen).to(device, dtype), torch.randn(b, c, t, generator=gen).to(device, dtype)
        biased = snake_beta(x, alpha, beta, bias=bias)
        assert torch.equal(biased, snake_beta(x + bias[None, :, None], alpha, beta))
        assert not torch.equal(biased, got) or t * c == 0
        summed = residual_sum(x, y, bias)
        assert torch.equal(residual_sum(sliced, y, bias), residual_sum(sliced.contiguous(), y, bias))
        want_sum = (x.double() + (y + bias[None, :, None]).double())
        worst = max(worst, ((summed.double() - want_sum).abs() / (1 + want_sum.abs())).max().item())
    return worst
'''

@needs_triton
@interpreter_only
def test_vocoder_kernels_equal_the_torch_ops_in_the_interpreter():
    script = COMPARE + "\nprint('RESULT', compare('cpu', torch.float32, [(2, 3, 50), (1, 4, 1500), (3, 2, 16)]))\n"
    assert float(interpreted_result(script)) < 1e-5


WHOLE_CODEC = r'''
import torch
from omni_async.speech import codec_layers
from omni_async.speech.code2wav import Code2Wav
from omni_async.speech.code2wav_config import Code2WavConfig
from omni_async.speech.codec import CodecDecoder
from omni_async.speech.codec_config import CodecConfig


def streamed(codec, codes, split):
    state, out, start = codec.new_state(), [], 0
    for n in split:
        out.append(codec.decode_chunk(codes[start:start + n], state))
        start += n
    return torch.cat(out)


worst = 0.0
for codec in (CodecDecoder.random(CodecConfig.tiny(), seed=0), Code2Wav.random(Code2WavConfig.tiny(), seed=0)):
    codes = torch.randint(0, 64, (7, codec.num_quantizers), generator=torch.Generator().manual_seed(1))
    codec_layers._fused = lambda x: False
    want = streamed(codec, codes, [2, 1, 4])
    codec_layers._fused = lambda x: True  # the CUDA path's kernels, interpreted on the CPU
    got = streamed(codec, codes, [2, 1, 4])
    assert got.shape == want.shape
    worst = max(worst, (got - want).abs().max().item())
print("RESULT", worst)
'''


@needs_triton
@interpreter_only
def test_the_codecs_through_the_fused_activations_decode_what_the_torch_ops_decode():
    """Both codecs (Qwen3-TTS's and Code2Wav, whose layers carry a lead) streamed in chunks
    with every SnakeBeta through the kernel, each one before a causal convolution
    written after its past in one buffer, and the residual units' convolution biases added
    in the passes after them: the torch path's samples."""
    assert float(interpreted_result(WHOLE_CODEC, timeout=900)) < 1e-5


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_cuda_vocoder_kernels_equal_the_torch_ops(dtype, tol):
    namespace: dict = {}
    exec(compile(COMPARE, "snake_compare", "exec"), namespace)
    assert namespace["compare"]("cuda", dtype, [(2, 96, 1920 * 8), (64, 768, 32), (1, 1536, 3), (5, 7, 1)]) < tol
