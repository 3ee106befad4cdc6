"""The code predictor: a small Qwen3 decoder that writes a frame's residual codebooks.

Per frame it starts afresh at position 0: its inputs are the talker's final-normed hidden
state at the position that produced codebook 0 (``g0``), then ``g0``'s row of the talker's
codec embedding, then, one position at a time, the embedding of each residual code it has
just written (table ``j`` embeds codebook ``j + 1``), every input through
``small_to_mtp_projection``. ``lm_head[j]`` reads codebook ``j + 1``.

Why a dense cache and not the paged one: a frame is at most 16 positions long and every
row of a batch sits at the same position, so the keys and values of a whole batch fit a
static ``[B, 16, heads, dim]`` buffer per layer; no page tables, no masks, and the same
shapes on every frame (what a CUDA graph wants). The buffers are made per call: they live
for one frame.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..models.decoder import RMSNorm
from .config import PredictorConfig

__all__ = ["CodePredictor", "Sampler"]

# ``sample(logits [B, V] float32, group) -> codes [B]``: how the frame's codebook ``group``
# (1..15) is drawn from its logits.
Sampler = Callable[[torch.Tensor, int], torch.Tensor]


class _Attention(nn.Module):
    def __init__(self, cfg: PredictorConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
                start: int) -> torch.Tensor:
        """``x`` [B, T, H] at positions ``start .. start+T-1``; keys and values written to
        ``cache`` (``[B, kv_heads, 16, d]`` each) and attended causally."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        keys, values = cache
        keys[:, :, start:start + t] = k
        values[:, :, start:start + t] = v
        end = start + t
        out = F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end], is_causal=t > 1 and start == 0,
                                             enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _MLP(nn.Module):
    def __init__(self, cfg: PredictorConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: PredictorConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = _MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache, start):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    """Named as the checkpoint names it (``code_predictor.model.*``)."""

    def __init__(self, cfg: PredictorConfig, talker_hidden: int) -> None:
        super().__init__()
        groups = cfg.num_code_groups - 1
        self.codec_embedding = nn.ModuleList(nn.Embedding(cfg.vocab_size, talker_hidden) for _ in range(groups))
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CodePredictor(nn.Module):
    def __init__(self, cfg: PredictorConfig, talker_hidden: int) -> None:
        super().__init__()
        self.config = cfg
        self.groups = cfg.num_code_groups - 1
        self.small_to_mtp_projection: nn.Module = (
            nn.Linear(talker_hidden, cfg.hidden_size, bias=True) if talker_hidden != cfg.hidden_size else nn.Identity()
        )
        self.model = _Backbone(cfg, talker_hidden)
        self.lm_head = nn.ModuleList(nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(self.groups))
        d = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        freqs = torch.arange(cfg.num_code_groups + 1, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("rope_angles", torch.cat((freqs, freqs), dim=-1), persistent=False)

    def _rope(self, start: int, count: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = self.rope_angles[start:start + count]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _run(self, x: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]], start: int) -> torch.Tensor:
        """The last position's final-normed hidden state after ``x`` [B, T, H_talker]."""
        x = self.small_to_mtp_projection(x)
        cos, sin = self._rope(start, x.shape[1], x.dtype)
        for layer, cache in zip(self.model.layers, caches):
            x = layer(x, cos, sin, cache, start)
        return self.model.norm(x[:, -1])

    def embed(self, group: int, codes: torch.Tensor) -> torch.Tensor:
        """Codebook ``group``'s (1..15) rows of the predictor's tables, in the talker's width."""
        return self.model.codec_embedding[group - 1](codes)

    @torch.inference_mode()
    def frame(self, past_hidden: torch.Tensor, first: torch.Tensor, sample: Sampler) -> torch.Tensor:
        """The residual codes ``[B, 15]`` of one frame, from the talker's hidden state and
        ``first`` (codebook 0's talker embedding), both ``[B, H_talker]``."""
        cfg = self.config
        b = past_hidden.shape[0]
        dtype, device = past_hidden.dtype, past_hidden.device
        shape = (b, cfg.num_kv_heads, cfg.num_code_groups, cfg.head_dim)
        caches = [(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
                  for _ in range(cfg.num_layers)]
        codes = torch.empty((b, self.groups), dtype=torch.long, device=device)
        hidden = self._run(torch.stack((past_hidden, first), dim=1), caches, 0)
        for j in range(self.groups):
            if j:
                hidden = self._run(self.embed(j, codes[:, j - 1])[:, None], caches, j + 1)
            logits = self.lm_head[j](hidden).float()
            codes[:, j] = sample(logits, j + 1)
        return codes
