"""The code predictor: a small Qwen3 decoder that writes a frame's residual codebooks.

Per frame it starts afresh at position 0: its inputs are the talker's final-normed hidden
state at the position that produced codebook 0 (``g0``), then ``g0``'s row of the talker's
codec embedding, then, one position at a time, the embedding of each residual code it has
just written (table ``j`` embeds codebook ``j + 1``), every input through
``small_to_mtp_projection``. ``lm_head[j]`` reads codebook ``j + 1``.

Why the text decoder's layers: a frame is 16 forwards of 5 layers, sequential, at the
batch of the talker's step: the predictor is the launch-bound part of a frame (written as
plain torch ops it was ~40 kernels a layer, thousands a frame). Its layers are the native
decoder's (:class:`~omni_async.models.decoder.DecoderLayer`: merged q/k/v and gate/up,
the residual add fused with the norm and at few rows with the GEMM after it, rotary and
the KV write in one kernel, the paged decode attention kernel), so every kernel the text
path gains, the predictor gains.

Why a decode step per position, over one page per row: every row of a batch sits at the
same position, so row ``r``'s keys and values are page ``r`` of a cache of its own
(16 positions = one page), the slots and lengths of position ``p`` are the same for every
frame, and all 16 forwards are decode steps of fixed shapes (what a CUDA graph wants).
Positions 0 and 1 are two decode steps rather than a two-token prefill: one more small
forward a frame, no second attention path.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import nn

from ..kernels.reference import ReferenceOps
from ..kv.attention import AttentionContext
from ..kv.cache import PagedKVCache
from ..models.config import ModelConfig
from ..models.decoder import DecoderLayer, RMSNorm, rope_inv_freq
from ..models.quantized import Linear
from .config import PredictorConfig

__all__ = ["CodePredictor", "Sampler"]

# The decode kernel reads each row's one page in a block of the page's 16 positions (its
# default block, 64 positions at head dim 128, loads 48 masked ones a program). Module-
# level so a probe can compare (``tools/predictor_attention.py``).
SPAN_BLOCK = True

# ``sample(logits [B, V] in the model's dtype, group) -> codes [B]``: how the frame's codebook ``group``
# (1..15) is drawn from its logits.
Sampler = Callable[[torch.Tensor, int], torch.Tensor]


def decoder_config(cfg: PredictorConfig) -> ModelConfig:
    """The predictor as a Qwen3 decoder's config (its layers are the text decoder's)."""
    return ModelConfig(family="qwen3", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                       intermediate_size=cfg.intermediate_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                       num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                       rope_theta=cfg.rope_theta, max_position_embeddings=cfg.num_code_groups, qk_norm=True)


class _Backbone(nn.Module):
    """Named as the checkpoint names it (``code_predictor.model.*``; q/k/v and gate/up
    merged, loaded by their own names through :mod:`omni_async.models.merged`)."""

    def __init__(self, cfg: PredictorConfig, talker_hidden: int) -> None:
        super().__init__()
        groups = cfg.num_code_groups - 1
        self.codec_embedding = nn.ModuleList(nn.Embedding(cfg.vocab_size, talker_hidden) for _ in range(groups))
        model_cfg = decoder_config(cfg)
        self.layers = nn.ModuleList(DecoderLayer(model_cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class _Step(NamedTuple):
    """What a decode step at one position reads besides its input rows (per batch size)."""

    ctx: AttentionContext
    cos: torch.Tensor  # [B, D]
    sin: torch.Tensor


class CodePredictor(nn.Module):
    def __init__(self, cfg: PredictorConfig, talker_hidden: int) -> None:
        super().__init__()
        self.config = cfg
        self.groups = cfg.num_code_groups - 1
        self.small_to_mtp_projection: nn.Module = (
            Linear(talker_hidden, cfg.hidden_size, bias=True) if talker_hidden != cfg.hidden_size else nn.Identity()
        )
        self.model = _Backbone(cfg, talker_hidden)
        self.lm_head = nn.ModuleList(Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(self.groups))
        self.register_buffer("inv_freq", rope_inv_freq(decoder_config(cfg)), persistent=False)
        self._kv: PagedKVCache | None = None
        self._retired: list[PagedKVCache] = []
        self._steps: dict[tuple[int, bool], list[_Step]] = {}

    def embed(self, group: int, codes: torch.Tensor) -> torch.Tensor:
        """Codebook ``group``'s (1..15) rows of the predictor's tables, in the talker's width."""
        return self.model.codec_embedding[group - 1](codes)

    @torch.inference_mode()
    def frame(self, past_hidden: torch.Tensor, first: torch.Tensor, sample: Sampler, *, ops: ReferenceOps,
              use_kernel: bool = False) -> torch.Tensor:
        """The residual codes ``[B, 15]`` of one frame, from the talker's hidden state and
        ``first`` (codebook 0's talker embedding), both ``[B, H_talker]``. ``ops``: the
        elementwise ops the talker runs with; ``use_kernel``: attention through the CUDA
        paged kernel. Fixed shapes, no host reads (a frame graph captures this)."""
        b = past_hidden.shape[0]
        kv = self._cache(b, past_hidden.dtype, past_hidden.device)
        steps = self._steps_for(b, past_hidden.dtype, past_hidden.device, use_kernel)
        codes = torch.empty((b, self.groups), dtype=torch.long, device=past_hidden.device)
        self._forward(past_hidden, steps[0], kv, ops, None)  # position 0: its keys and values only
        for j in range(self.groups):
            x = first if j == 0 else self.embed(j, codes[:, j - 1])
            logits = self._forward(x, steps[j + 1], kv, ops, self.lm_head[j])
            codes[:, j] = sample(logits, j + 1)
        return codes

    def _forward(self, x: torch.Tensor, step: _Step, kv: PagedKVCache, ops: ReferenceOps,
                 head: nn.Module | None) -> torch.Tensor | None:
        """One position for every row: ``x`` [B, H_talker] in, ``head``'s logits of the
        final-normed hidden state out (the final norm fused with the head's GEMM where the
        ops fuse them; nothing when there is no head)."""
        proj = self.small_to_mtp_projection
        x, delta = (x if isinstance(proj, nn.Identity) else ops.linear(x, proj)), None
        for layer in self.model.layers:
            x, delta = layer(x, delta, step.cos, step.sin, kv, step.ctx, ops)
        return None if head is None else ops.add_norm_linear(x, delta, self.model.norm, head)[1]

    def _cache(self, rows: int, dtype: torch.dtype, device: torch.device) -> PagedKVCache:
        """A page of 16 positions per row. Grown, never replaced in place: a captured graph
        keeps reading the cache it was captured with, so an outgrown one stays alive."""
        kv = self._kv
        if kv is None or kv.num_pages < rows or kv.k[0].dtype != dtype or kv.k[0].device != device:
            cfg = self.config
            pages = max(rows, 2 * kv.num_pages if kv is not None and kv.k[0].device == device else rows)
            if kv is not None:
                self._retired.append(kv)
            kv = self._kv = PagedKVCache(num_layers=cfg.num_layers, num_pages=pages, page_size=cfg.num_code_groups,
                                         num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=dtype, device=device)
        return kv

    def _steps_for(self, rows: int, dtype: torch.dtype, device: torch.device, use_kernel: bool) -> list[_Step]:
        """Per position: the slots (row ``r``, position ``p``: ``r * 16 + p``), lengths and
        rotary rows of a decode step; made once per batch size."""
        steps = self._steps.get((rows, use_kernel))
        if steps is None or steps[0].cos.device != device or steps[0].cos.dtype != dtype:
            page = self.config.num_code_groups
            rows_idx = torch.arange(rows, device=device)
            tables = rows_idx[:, None]
            angles = torch.arange(page, device=device, dtype=torch.float32)[:, None] * self.inv_freq.to(device, torch.float32)
            angles = torch.cat((angles, angles), dim=-1)
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            steps = []
            for p in range(page):
                ctx = AttentionContext(is_decode=True, slot_mapping=rows_idx * page + p, logits_rows=rows_idx,
                                       kv_lens=torch.full((rows,), p + 1, dtype=torch.long, device=device),
                                       block_tables=tables, page_size=page, use_kernel=use_kernel,
                                       decode_block=page if SPAN_BLOCK else 0)
                steps.append(_Step(ctx, cos[p].expand(rows, -1), sin[p].expand(rows, -1)))
            self._steps[(rows, use_kernel)] = steps
        return steps
