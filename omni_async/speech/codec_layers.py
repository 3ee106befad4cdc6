"""The speech-tokenizer decoder's layers, each able to run on a chunk of a stream.

Every layer is causal, so a chunk's output depends only on the chunk and a bounded past: a
causal convolution on its last ``(k-1)*dilation`` input samples, a causal transposed
convolution on its last input sample, the sliding-window attention on the window's last
keys and values. Each layer that needs a past reads it from a ``Carry`` and writes the past
the next chunk needs. A stream's first chunk reads zeros, which is exactly the zero padding
of a one-shot decode (and masked keys for the attention), so a chunked decode gives a
one-shot decode's samples.

Module and parameter names follow the checkpoint's ``decoder.*`` tensor names, so a
released ``speech_tokenizer/model.safetensors`` loads by name.

The same layers make Qwen3-Omni's Code2Wav (:mod:`~omni_async.speech.code2wav`), whose
transposed convolutions also drop ``kernel - stride`` samples at the start of a stream, so
its samples run that far ahead of these layers' outputs. There a stateful layer's ``lead``
is how many samples at the start of a stream its input holds that are not part of its
signal: a stream's first chunk has them zeroed before the layer reads them, which is the
zero padding the one-shot decode sees at the start of the shorter signal.

The sliding-window transformer's layers are in :mod:`~omni_async.speech.codec_transformer`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import triton_available

# SnakeBeta through the one-pass Triton kernel on CUDA, the residual units' convolution
# biases added in the passes after them (read when a call runs or a graph is captured;
# off: the torch ops, for side-by-side timing).
FUSED_SNAKE = True
# On CUDA a convolution of at least this dilation runs as a plain one over its input's
# interleaved phases (:func:`polyphase_conv1d`): cuDNN ran the vocoder's dilation-9
# convolution over 384 channels with a generic implicit GEMM without tensor cores, 5.9 ms
# of a 24 ms codec call at 64 streams x 8 frames on the H100 (cuDNN's algorithm search
# found nothing faster). The phases' own time is not measured yet; 0: every convolution as
# declared (``tools/speech_profile.py --codec-variants`` times both).
POLYPHASE_DILATION = 9
# On CUDA in half precision, every convolution (groups 1) as the one-pass implicit GEMM of
# ``kernels/conv1d.py`` instead of cuDNN's (and before the phases above): off until a GPU
# run of ``tools/codec_convs.py`` shows it faster.
TRITON_CONV = False


def _fused(x: torch.Tensor) -> bool:
    """Whether SnakeBeta on ``x`` runs as the one-pass kernel (the one place that decides)."""
    return FUSED_SNAKE and _triton(x)


def _triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_available(x.device)


class Carry:
    """One forward's view of the streams' state, by slot: the pasts read and the pasts written."""

    def __init__(self, past: list[torch.Tensor], position: torch.Tensor) -> None:
        self.past = past
        self.next: list[torch.Tensor | None] = [None] * len(past)
        self.position = position  # [B] long: each stream's index of the chunk's first frame

    def take(self, slot: int) -> torch.Tensor:
        return self.past[slot]

    def put(self, slot: int, tensor: torch.Tensor) -> None:
        self.next[slot] = tensor

    def clear_lead(self, x: torch.Tensor, lead: int) -> torch.Tensor:
        """``x [B, C, T]`` with its first ``lead`` samples zeroed in the rows of streams at
        their first chunk (position 0); other rows as they are. No host read: graph-safe."""
        first = (self.position == 0)[:, None, None]
        ahead = (torch.arange(x.shape[-1], device=x.device) < lead)[None, None, :]
        return x.masked_fill(first & ahead, 0.0)


class Stateful(nn.Module):
    """A layer with a past: its slot in the carry, the shape of its past for one stream, and
    the samples at a stream's start its input holds that are not signal (``lead``, zeroed)."""

    slot: int = -1
    lead: int = 0
    context: int = 0  # (a convolution's: the past samples it reads before the chunk)

    def past_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def activated(self, act: "SnakeBeta", x: torch.Tensor, carry: "Carry", bias: bool = True) -> torch.Tensor:
        """A causal convolution's ``self(act(x))``; through the fused activation, the
        activation is written after the past in one buffer (no concatenation pass).
        ``bias``: False leaves the convolution's bias out (a later pass adds it)."""
        if self.context == 0 or self.lead or not _fused(x):
            return self(act(x, carry), carry, bias=bias)
        return self._convolve(act.with_past(x, carry.take(self.slot)), carry, x.shape[-1], bias)

    def _convolve(self, full: torch.Tensor, carry: "Carry", samples: int, bias: bool) -> torch.Tensor:
        """The past and a chunk of ``samples`` as one input (a convolution's)."""
        raise NotImplementedError


class SnakeBeta(nn.Module):
    """``x + sin^2(x e^alpha) / (e^beta + 1e-9)`` per channel: pointwise, no past."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor, carry: Carry) -> torch.Tensor:
        if _fused(x):  # one pass, not five (kernels/snake.py)
            from ..kernels.snake import snake_beta

            return snake_beta(x, self.alpha, self.beta)
        alpha = self.alpha.exp()[None, :, None]
        inv_beta = 1.0 / (self.beta.exp()[None, :, None] + 1e-9)
        return x + inv_beta * torch.sin(x * alpha).pow(2)

    def with_past(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        """``cat([past, self(x)], -1)`` in one buffer (the fused kernel's; its callers check
        :func:`_fused` first)."""
        from ..kernels.snake import snake_beta

        return snake_beta(x, self.alpha, self.beta, past=past)

    def biased(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``self(x + bias)`` (``bias [C]``: a convolution's, left out of it) in one pass (the
        fused kernel's; its callers check :func:`_fused` first)."""
        from ..kernels.snake import snake_beta

        return snake_beta(x, self.alpha, self.beta, bias=bias)


class CausalConv(Stateful):
    """Conv1d over ``[B, C, T]`` with zero left padding of ``(k-1)*dilation``; streamed, the
    padding is the previous chunk's last input samples."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups)
        self.context = (kernel - 1) * dilation

    def past_shape(self) -> tuple[int, ...]:
        return (self.conv.in_channels, self.context)

    def forward(self, x: torch.Tensor, carry: Carry, bias: bool = True) -> torch.Tensor:
        if self.context == 0:
            return self.convolution(x, bias)
        if self.lead:
            x = carry.clear_lead(x, self.lead)
        return self._convolve(torch.cat([carry.take(self.slot), x], dim=-1), carry, x.shape[-1], bias)

    def _convolve(self, full: torch.Tensor, carry: Carry, samples: int, bias: bool) -> torch.Tensor:
        """Its last ``context`` samples are the next past."""
        carry.put(self.slot, full[..., full.shape[-1] - self.context:])
        return self.convolution(full, bias)

    def convolution(self, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """The convolution over ``x`` as it is (no past), its bias left out unless ``bias``;
        on CUDA a widely dilated one over its input's phases (:data:`POLYPHASE_DILATION`)."""
        c = self.conv
        b = c.bias if bias else None
        if TRITON_CONV and c.groups == 1 and x.dtype != torch.float32 and _triton(x):
            from ..kernels.conv1d import conv1d

            return conv1d(x, c.weight, b, c.dilation[0])
        if x.is_cuda and 0 < POLYPHASE_DILATION <= c.dilation[0]:
            return polyphase_conv1d(x, c.weight, b, c.dilation[0], c.groups)
        return F.conv1d(x, c.weight, b, dilation=c.dilation, groups=c.groups)


def polyphase_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int,
                     groups: int = 1) -> torch.Tensor:
    """``F.conv1d(x, weight, bias, dilation=dilation, groups=groups)`` (no padding) as a
    convolution without dilation over the ``dilation`` interleaved phases of ``x`` batched
    together: phase r holds ``x[..., r::d]``, and output ``m d + r`` is the plain
    convolution of phase r at m. ``x`` is zero-padded to whole phases; the extra outputs are
    cut. The same sums, reordered only by the kernel cuDNN picks."""
    b, c, t_in = x.shape
    d, k = dilation, weight.shape[-1]
    t = t_in - (k - 1) * d
    s = -(-t_in // d)  # samples a phase
    phases = F.pad(x, (0, s * d - t_in)).view(b, c, s, d).permute(0, 3, 1, 2).reshape(b * d, c, s)
    y = F.conv1d(phases, weight, bias, groups=groups)                                  # [B*d, O, s-k+1]
    return y.view(b, d, y.shape[1], -1).permute(0, 2, 3, 1).reshape(b, y.shape[1], -1)[..., :t]


class CausalTransConv(Stateful):
    """ConvTranspose1d whose last ``kernel - stride`` output samples are dropped, so T inputs
    give ``T*stride`` outputs. Output sample n also sums inputs before the chunk when the
    kernel is longer than the stride: streamed, those inputs come first and their outputs,
    already given by the previous chunk, are cut."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.stride = stride
        self.context = math.ceil(kernel / stride) - 1

    def past_shape(self) -> tuple[int, ...]:
        return (self.conv.in_channels, self.context)

    def forward(self, x: torch.Tensor, carry: Carry, bias: bool = True) -> torch.Tensor:
        length = x.shape[-1] * self.stride
        if self.context == 0:
            return self._transposed(x, bias)[..., :length]
        if self.lead:
            x = carry.clear_lead(x, self.lead)
        return self._convolve(torch.cat([carry.take(self.slot), x], dim=-1), carry, x.shape[-1], bias)

    def _convolve(self, full: torch.Tensor, carry: Carry, samples: int, bias: bool) -> torch.Tensor:
        """The outputs of the past's samples came with the chunk before: cut."""
        carry.put(self.slot, full[..., full.shape[-1] - self.context:])
        start = self.context * self.stride
        return self._transposed(full, bias)[..., start:start + samples * self.stride]

    def _transposed(self, x: torch.Tensor, bias: bool) -> torch.Tensor:
        return F.conv_transpose1d(x, self.conv.weight, self.conv.bias if bias else None, stride=self.stride)


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv k=7, LayerNorm, 4x pointwise MLP with exact GELU, gamma, residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, carry: Carry) -> torch.Tensor:
        h = self.dwconv(x, carry).transpose(1, 2)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


class ResidualUnit(nn.Module):
    """SnakeBeta, dilated causal conv k=7, SnakeBeta, conv k=1, plus the input."""

    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)

    def forward(self, x: torch.Tensor, carry: Carry) -> torch.Tensor:
        if not _fused(x):
            h = self.conv1.activated(self.act1, x, carry)
            return x + self.conv2(self.act2(h, carry), carry)
        # The fused path: each convolution's bias rides in the pass after it (kernels/snake.py).
        from ..kernels.snake import residual_sum

        h = self.conv1.activated(self.act1, x, carry, bias=False)
        h = self.conv2.convolution(self.act2.biased(h, self.conv1.conv.bias), bias=False)
        return residual_sum(x, h, self.conv2.conv.bias)


class VocoderBlock(nn.Module):
    """One vocoder stage: SnakeBeta, causal transposed conv (x rate, half the channels), three
    residual units with dilations 1, 3, 9."""

    def __init__(self, cin: int, cout: int, rate: int) -> None:
        super().__init__()
        self.block = nn.ModuleList([SnakeBeta(cin), CausalTransConv(cin, cout, 2 * rate, rate)]
                                   + [ResidualUnit(cout, d) for d in (1, 3, 9)])

    def forward(self, x: torch.Tensor, carry: Carry) -> torch.Tensor:
        return run_layers(self.block, x, carry)


def run_layers(layers: nn.ModuleList, x: torch.Tensor, carry: Carry) -> torch.Tensor:
    """Each layer in turn; a SnakeBeta just before a causal convolution goes in through
    the convolution's ``activated`` (on the fused path one pass writes it after the past)."""
    items = list(layers)
    i = 0
    while i < len(items):
        layer, after = items[i], items[i + 1] if i + 1 < len(items) else None
        if isinstance(layer, SnakeBeta) and isinstance(after, (CausalConv, CausalTransConv)):
            x = after.activated(layer, x, carry)
            i += 2
        else:
            x = layer(x, carry)
            i += 1
    return x


class Upsample(nn.ModuleList):
    """``upsample.i``: a transposed conv with kernel = stride (no overlap), then a ConvNeXt block."""

    def __init__(self, dim: int, factor: int) -> None:
        super().__init__([CausalTransConv(dim, dim, factor, factor), ConvNeXtBlock(dim)])

    def forward(self, x: torch.Tensor, carry: Carry) -> torch.Tensor:
        for layer in self:
            x = layer(x, carry)
        return x
