"""The speech-tokenizer decoder's sliding-window transformer (``pre_transformer``), able
to run on a chunk of a stream: its attention keeps the window's last keys and values as a
past in the :class:`~omni_async.speech.codec_layers.Carry` (positions before a stream's first
frame masked), so a chunked decode gives a one-shot decode's rows.

Module and parameter names follow the checkpoint's ``decoder.pre_transformer.*`` tensor names.
Qwen3-Omni's Code2Wav runs the same layers without the input and output projections.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..models.decoder import RMSNorm  # (computed in float32, as the checkpoints were trained)
from .codec_layers import Carry, Stateful


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
