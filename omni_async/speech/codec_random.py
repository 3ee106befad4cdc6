"""Random weights for a codec decoder (``CodecDecoder``, ``Code2Wav``) whose audio is neither
silent nor clipped.

Stock initialisations make a useless decoder to test against: zero codebooks make the audio
independent of the codes, near-zero layer scales hide the transformer, and O(1) weights
through twelve residual units saturate the final ``clamp(-1, 1)``. Here every weight is
drawn for unit-variance activations, the vocoder's residual branches are damped, and the
last conv is rescaled so a probe decode has a standard deviation of 0.25.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.decoder import RMSNorm
from .codec_layers import ConvNeXtBlock, ResidualUnit, SnakeBeta
from .codec_quantizer import Codebook
from .codec_transformer import LayerScale

_PROBE_FRAMES = 8
_TARGET_STD = 0.25
_RESIDUAL_GAIN = 0.3


@torch.no_grad()
def randomize(model: nn.Module, seed: int) -> None:
    """Overwrite every parameter of ``model`` (a ``CodecDecoder`` or ``Code2Wav``) from ``seed``."""
    g = torch.Generator().manual_seed(int(seed))

    def normal(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_(mean + std * torch.randn(t.shape, generator=g))

    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Conv1d)):
            fan_in = module.weight[0].numel()
            normal(module.weight, fan_in ** -0.5)
        elif isinstance(module, nn.ConvTranspose1d):
            fan_in = module.in_channels * module.kernel_size[0] / module.stride[0]
            normal(module.weight, fan_in ** -0.5)
        elif isinstance(module, (RMSNorm, nn.LayerNorm)):
            normal(module.weight, 0.1, 1.0)
        elif isinstance(module, LayerScale):
            normal(module.scale, 0.1, 0.4)
        elif isinstance(module, ConvNeXtBlock):
            normal(module.gamma, 0.1, 0.4)
        elif isinstance(module, SnakeBeta):
            normal(module.alpha, 0.2)
            normal(module.beta, 0.2)
        elif isinstance(module, nn.Embedding):  # Code2Wav's codebooks, averaged per frame
            normal(module.weight, 1.0)
        elif isinstance(module, Codebook):
            module.cluster_usage.copy_(0.5 + 1.5 * torch.rand(module.cluster_usage.shape, generator=g))
            normal(module.embedding_sum, 1.0)
            module.embedding_sum.mul_(module.cluster_usage[:, None])
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.ConvTranspose1d, nn.LayerNorm)) and module.bias is not None:
            normal(module.bias, 0.05)
    for module in model.modules():  # after the loop, which reaches a unit before its convs
        if isinstance(module, ResidualUnit):
            module.conv2.conv.weight.mul_(_RESIDUAL_GAIN)
    _calibrate(model, g)


def _calibrate(model: nn.Module, g: torch.Generator) -> None:
    """Scale the last conv so a probe decode of random codes has the target spread."""
    final = model.decoder[-1].conv
    final.weight.mul_(1e-3)  # the probe reads the spread before the clamp: keep it unclamped
    final.bias.mul_(1e-3)
    codes = torch.randint(0, model.codebook_size, (1, _PROBE_FRAMES, model.num_quantizers), generator=g)
    pcm = model.decode(codes)
    scale = _TARGET_STD / max(float(pcm.std()), 1e-12)
    final.weight.mul_(scale)
    final.bias.mul_(scale)
