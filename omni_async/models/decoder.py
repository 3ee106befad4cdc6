"""Llama / Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE decoder over a paged KV cache.

One module covers the families; they differ only in biases (Qwen2 has q/k/v
bias), per-head q/k RMSNorm before RoPE (Qwen3), tied embeddings, and routed experts in
place of the MLP (the MoE families, :mod:`.moe`). Parameter names
follow Hugging Face, except that q/k/v and gate/up are merged into ``qkv_proj`` and
``gate_up_proj`` (see :mod:`.merged`, which keeps checkpoints loading by HF names).

The elementwise work between the GEMMs (residual add + RMSNorm, rotary + KV write,
SiLU-and-multiply) goes through ``model.ops``: the torch reference (:mod:`omni_async.kernels.reference`), or fused
kernels on CUDA (:mod:`omni_async.kernels.fused`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..kernels.reference import ReferenceOps
from ..kv.attention import AttentionContext, paged_attention, pages_from_slots
from ..kv.cache import PagedKVCache
from .config import ModelConfig
from .merged import MergedLinear
from .moe import SparseMoeBlock
from .quantized import Linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """On the CPU whatever the default device is: computed on the meta device (where the
    loaders build the model), this arithmetic imports torch._dynamo, ~2 s of every start."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = cfg.rope_scaling or {}
    if cfg.rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif cfg.rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        h, d = cfg.hidden_size, cfg.head_dim
        parts = {"q_proj": cfg.num_heads * d, "k_proj": cfg.num_kv_heads * d, "v_proj": cfg.num_kv_heads * d}
        self.qkv_proj = MergedLinear(h, parts, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.num_heads * d, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: PagedKVCache,
        ctx: AttentionContext,
        ops: ReferenceOps,
    ) -> torch.Tensor:
        return self.from_qkv(self.qkv_proj(x), cos, sin, kv, ctx, ops)

    def from_qkv(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: PagedKVCache,
        ctx: AttentionContext,
        ops: ReferenceOps,
    ) -> torch.Tensor:
        """The block after its q/k/v projection (which :class:`DecoderLayer` computes
        fused with the norm before it)."""
        t = qkv.shape[0]
        q, k, v = qkv.split(self.qkv_proj.sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        # Qwen3's per-head q/k norms go in with the rotary: one fused kernel for all three.
        q, k = ops.rope_store(q, k, v, cos, sin, kv, self.layer_idx, ctx.slot_mapping, self.q_norm, self.k_norm)
        out = paged_attention(q, kv.k[self.layer_idx], kv.v[self.layer_idx], ctx, self.scale, k_new=k, v_new=v)
        return ops.linear(out.reshape(t, self.num_heads * self.head_dim), self.o_proj)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        parts = {"gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size}
        self.gate_up_proj = MergedLinear(cfg.hidden_size, parts, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, ops: ReferenceOps) -> torch.Tensor:
        return ops.silu_mul_linear(self.gate_up_proj(x), self.down_proj)

    def add_norm_forward(self, x: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm, ops: ReferenceOps
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + delta, mlp(norm(x + delta)))``, the norm fused with the gate/up GEMM
        where the ops can (a sparse block, :class:`~.moe.SparseMoeBlock`, has the same
        method)."""
        x, gate_up = ops.add_norm_linear(x, delta, norm, self.gate_up_proj)
        return x, ops.silu_mul_linear(gate_up, self.down_proj)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp: MLP | SparseMoeBlock = SparseMoeBlock(cfg) if cfg.is_moe_layer(layer_idx) else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, delta, cos, sin, kv, ctx, ops):
        """Residual stream ``x`` and the previous block's output ``delta`` (added here,
        so that the add fuses with the norm, and at few rows with the GEMM after it:
        :mod:`omni_async.kernels.small_m`); returns the new pair."""
        attn, mlp = self.self_attn, self.mlp
        x, qkv = ops.add_norm_linear(x, delta, self.input_layernorm, attn.qkv_proj)
        delta = attn.from_qkv(qkv, cos, sin, kv, ctx, ops)
        return mlp.add_norm_forward(x, delta, self.post_attention_layernorm, ops)


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # Given its (uninitialised) weight, Embedding skips its random init: every loader
        # overwrites it, and on the meta device that init imports torch._dynamo (~2 s a start).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def _prefer_page_gather(ctx: AttentionContext, page_size: int) -> None:
    """CPU decode steps given per-slot KV indices attend through whole pages instead
    (see :func:`~omni_async.kv.attention.decode_over_pages`); done once per forward."""
    if ctx.is_decode and ctx.block_tables is None and ctx.kv_slots is not None and ctx.kv_slots.device.type == "cpu":
        ctx.block_tables = pages_from_slots(ctx.kv_slots, page_size)
        ctx.page_size = page_size


# The module a talker's projection of another stage's hidden states is attached as
# (:mod:`.conditioning`); its checkpoint tensors go by this name.
PROJECTION = "thinker_to_talker_proj"


class DecoderModel(nn.Module):
    """``forward(input_ids, positions, kv, ctx)`` returns float32 logits (the head's
    dtype with ``float_logits=False``) for the rows
    in ``ctx.logits_rows`` (the last token of each sequence; a decode step has one
    token per sequence and takes every row)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = _Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.ops: ReferenceOps = ReferenceOps()  # replaced by fused kernels on CUDA
        # A CPU decode step's layers in one C++ call (kernels/cpu_stack.py), set by the
        # runner where the C++ kernels are on and the weights are blocks; else None.
        self.cpu_stack = None
        # A talker's projection of another stage's hidden states into its input space
        # (``cond`` in :meth:`forward`); None for a plain decoder.
        self.thinker_to_talker_proj: nn.Module | None = None
        # The rows ``return_hidden`` hands out: transformers' ``hidden_states[i]`` (0 the
        # input embeddings, i the residual stream after layer i); None after the final
        # norm (``hidden_states[-1]``). Set by the stage before its graphs are captured.
        self.hidden_layer: int | None = None

    def tie_weights(self) -> None:
        """Share the embedding with the output head when the checkpoint ties them
        (again after ``to_empty``, which unties shared parameters)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's rotary tables, through the ops (one fused kernel on CUDA)."""
        return self.ops.rope_table(positions, self.inv_freq, dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: PagedKVCache,
        ctx: AttentionContext,
        return_hidden: bool | str = False,
        float_logits: bool = True,
        cond: tuple[torch.Tensor, torch.Tensor] | None = None,
        input_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``return_hidden``: also the final hidden states (after the final norm; layer
        ``hidden_layer``'s when set) of the rows the logits are for; ``"all"``: of every
        input row (a prefill's prompt positions). ``input_embeds``: (flat row indices,
        their ``[n, hidden]`` rows) that replace those rows' token embeddings (a prompt
        given as embeddings). ``cond``: ``(rows [T, Hc], mask [T])`` added to the input
        embeddings through ``thinker_to_talker_proj`` where ``mask`` is 1 (a talker fed by
        a thinker's hidden states, :mod:`omni_async.core.conditioning`)."""
        _prefer_page_gather(ctx, kv.page_size)
        x = self.model.embed_tokens(input_ids)
        if input_embeds is not None:
            x.index_copy_(0, input_embeds[0], input_embeds[1].to(x.dtype))
        if cond is not None and self.thinker_to_talker_proj is not None:
            rows, mask = cond
            x = x + self.thinker_to_talker_proj(rows.to(x.dtype)) * mask.to(x.dtype)[:, None]
        cos, sin = self.rope(positions, x.dtype)
        every = return_hidden == "all"
        cut = self.hidden_layer if return_hidden else None
        captured = None  # the rows at layer ``cut``
        if self.cpu_stack is not None and cut is None and ctx.is_decode and ctx.cpu_kernel and ctx.block_tables is not None:
            hidden = self.cpu_stack(x, cos, sin, kv, ctx.block_tables, ctx.kv_lens, ctx.slot_mapping)
        else:
            delta = None
            for i, layer in enumerate(self.model.layers):
                if i == cut:
                    captured = x if delta is None else x + delta
                x, delta = layer(x, delta, cos, sin, kv, ctx, self.ops)
            if not ctx.is_decode and not every:  # decode wants every row: no gather
                x, delta = x[ctx.logits_rows], None if delta is None else delta[ctx.logits_rows]
            hidden = self.ops.add_norm(x, delta, self.model.norm)[1]
        all_hidden = hidden
        if every and not ctx.is_decode:
            hidden = hidden[ctx.logits_rows]
        logits = self.lm_head(hidden)
        if float_logits:  # the decode graphs keep the head's dtype (see DecodeGraphs._captured)
            logits = logits.to(torch.float32)
        if captured is not None:  # the chosen layer's rows in place of the final norm's
            all_hidden = captured
            hidden = captured if ctx.is_decode else captured[ctx.logits_rows]
        if every:
            return logits, all_hidden
        return (logits, hidden) if return_hidden else logits
