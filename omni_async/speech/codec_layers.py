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
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import triton_available

# SnakeBeta through the one-pass Triton kernel on CUDA (read when a call runs or a graph
# is captured; off: the torch ops, for side-by-side timing).
FUSED_SNAKE = True


def _fused(x: torch.Tensor) -> bool:
    """Whether SnakeBeta on ``x`` runs as the one-pass kernel (the one place that decides)."""
    return x.is_cuda and FUSED_SNAKE and triton_available(x.device)


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


class WindowConfig(Protocol):
    """The shape of the sliding-window transformer, read-only (both codecs' frozen configs,
    ``CodecConfig`` and ``Code2WavConfig``, have these fields)."""

    @property
    def hidden_size(self) -> int: ...

    @property
    def intermediate_size(self) -> int: ...

    @property
    def num_hidden_layers(self) -> int: ...

    @property
    def num_attention_heads(self) -> int: ...

    @property
    def num_key_value_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def sliding_window(self) -> int: ...

    @property
    def rope_theta(self) -> float: ...

    @property
    def rms_norm_eps(self) -> float: ...

    @property
    def attention_bias(self) -> bool: ...


class Stateful(nn.Module):
    """A layer with a past: its slot in the carry, the shape of its past for one stream, and
    the samples at a stream's start its input holds that are not signal (``lead``, zeroed)."""

    slot: int = -1
    lead: int = 0
    context: int = 0  # (a convolution's: the past samples it reads before the chunk)

    def past_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def activated(self, act: "SnakeBeta", x: torch.Tensor, carry: "Carry") -> torch.Tensor:
        """A causal convolution's ``self(act(x))``; through the fused activation, the
        activation is written after the past in one buffer (no concatenation pass)."""
        if self.context == 0 or self.lead or not _fused(x):
            return self(act(x, carry), carry)
        return self._convolve(act.with_past(x, carry.take(self.slot)), carry, x.shape[-1])

    def _convolve(self, full: torch.Tensor, carry: "Carry", samples: int) -> torch.Tensor:
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


class CausalConv(Stateful):
    """Conv1d over ``[B, C, T]`` with zero left padding of ``(k-1)*dilation``; streamed, the
    padding is the previous chunk's last input samples."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups)
        self.context = (kernel - 1) * dilation

    def past_shape(self) -> tuple[int, ...]:
        return (self.conv.in_channels, self.context)

    def forward(self, x: torch.Tensor, carry: Carry) -> torch.Tensor:
        if self.context == 0:
            return self.conv(x)
        if self.lead:
            x = carry.clear_lead(x, self.lead)
        return self._convolve(torch.cat([carry.take(self.slot), x], dim=-1), carry, x.shape[-1])

    def _convolve(self, full: torch.Tensor, carry: Carry, samples: int) -> torch.Tensor:
        """Its last ``context`` samples are the next past."""
        carry.put(self.slot, full[..., full.shape[-1] - self.context:])
        return self.conv(full)


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

    def forward(self, x: torch.Tensor, carry: Carry) -> torch.Tensor:
        length = x.shape[-1] * self.stride
        if self.context == 0:
            return self.conv(x)[..., :length]
        if self.lead:
            x = carry.clear_lead(x, self.lead)
        return self._convolve(torch.cat([carry.take(self.slot), x], dim=-1), carry, x.shape[-1])

    def _convolve(self, full: torch.Tensor, carry: Carry, samples: int) -> torch.Tensor:
        """The outputs of the past's samples came with the chunk before: cut."""
        carry.put(self.slot, full[..., full.shape[-1] - self.context:])
        start = self.context * self.stride
        return self.conv(full)[..., start:start + samples * self.stride]


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
        h = self.conv1.activated(self.act1, x, carry)
        return x + self.conv2(self.act2(h, carry), carry)


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


class RMSNorm(nn.Module):
    """Computed in float32, as the checkpoint was trained."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class SlidingAttention(Stateful):
    """Attention with RoPE where query i sees keys j with ``i - window < j <= i``. The past is
    the last ``window - 1`` positions' rotated keys and values; positions before a stream's
    first frame are masked (the zeros a new stream's past holds are never seen)."""

    def __init__(self, config: WindowConfig) -> None:
        super().__init__()
        c = config
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.window = c.sliding_window
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)

    def past_shape(self) -> tuple[int, ...]:
        return (2, self.kv_heads, self.window - 1, self.head_dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
                carry: Carry) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        past = carry.take(self.slot)
        keys = torch.cat([past[:, 0], k], dim=2)
        values = torch.cat([past[:, 1], v], dim=2)
        keep = self.window - 1
        carry.put(self.slot, torch.stack([keys[:, :, keys.shape[2] - keep:], values[:, :, values.shape[2] - keep:]], 1))
        if self.kv_heads != self.heads:
            keys = keys.repeat_interleave(self.heads // self.kv_heads, dim=1)
            values = values.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE; ``cos``/``sin`` are ``[B, T, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class Mlp(nn.Module):
    """SwiGLU."""

    def __init__(self, config: WindowConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    def __init__(self, config: WindowConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SlidingAttention(config)
        self.self_attn_layer_scale = LayerScale(config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Mlp(config)
        self.mlp_layer_scale = LayerScale(config.hidden_size)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
                carry: Carry) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), rope, mask, carry))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


def rope_frequencies(config: WindowConfig) -> torch.Tensor:
    """RoPE's inverse frequencies, float32 (a module cast to bf16 casts its buffers: the
    decoder sets these back after any cast)."""
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
    return 1.0 / config.rope_theta ** exponents


class Transformer(nn.Module):
    """``pre_transformer``: sliding-window layers and a final norm over ``[B, T, width]``, with
    ``input_proj`` / ``output_proj`` from and back to ``latent_dim`` when one is given (the
    Qwen3-TTS codec; Code2Wav has none). Positions are absolute (the stream's frame index), as
    in a one-shot decode, so the rotations match it exactly."""

    def __init__(self, config: WindowConfig, latent_dim: int | None = None) -> None:
        super().__init__()
        projected = latent_dim is not None
        self.input_proj = nn.Linear(latent_dim, config.hidden_size) if projected else None
        self.layers = nn.ModuleList([TransformerLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output_proj = nn.Linear(config.hidden_size, latent_dim) if projected else None
        self.window = config.sliding_window
        self.register_buffer("inv_freq", rope_frequencies(config), persistent=False)

    def forward(self, x: torch.Tensor, carry: Carry) -> torch.Tensor:
        t = x.shape[1]
        steps = torch.arange(t, device=x.device)
        positions = carry.position[:, None] + steps                                   # [B, T]
        freqs = positions.float()[..., None] * self.inv_freq.float()                  # [B, T, hd/2]
        angles = torch.cat([freqs, freqs], dim=-1)
        rope = (angles.cos().to(x.dtype), angles.sin().to(x.dtype))
        keep = self.window - 1
        key_positions = carry.position[:, None] - keep + torch.arange(keep + t, device=x.device)  # [B, keep+T]
        offset = positions[:, :, None] - key_positions[:, None, :]                  # query - key
        mask = (offset >= 0) & (offset < self.window) & (key_positions[:, None, :] >= 0)
        mask = mask[:, None]                                                          # [B, 1, T, keep+T]
        h = x if self.input_proj is None else self.input_proj(x)
        for layer in self.layers:
            h = layer(h, rope, mask, carry)
        h = self.norm(h)
        return h if self.output_proj is None else self.output_proj(h)
