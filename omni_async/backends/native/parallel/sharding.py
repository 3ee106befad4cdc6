"""Megatron-style sharding of the decoder over the ranks of a tensor-parallel group.

Each rank builds the decoder with *local* shapes (``num_heads / N``, ``num_kv_heads / N``,
``intermediate_size / N``) and gets, at load time, its slice of every Hugging Face
tensor, by name, before anything else touches the tensors (so a loader that fuses
q/k/v or gate/up afterwards sees local tensors and fuses them as usual):

- column-parallel (output rows split by head or by channel): q/k/v and gate/up
  projections, weights and biases;
- row-parallel (input columns split): o_proj and down_proj; the partial products are
  summed over the ranks (one all-reduce each) and the bias, kept whole, added once;
- vocabulary-parallel: the embedding and the LM head hold ``ceil(V / N)`` rows each
  (the last rank's tail padded with zeros); an embedding lookup outside a rank's rows
  gives zeros and one all-reduce sums the rows, and the head's partial logits are
  all-gathered and trimmed to ``V``. Why not a replicated head: on the reference shape
  (Qwen2-0.5B) the tied embedding is a quarter of the weights, and a decode step reads
  every weight once, so replicating it would leave rank 0 reading half again as much
  as a sharded step; gathering ``[B, V]`` logits costs ``2 B V`` bytes per rank.

The KV cache follows the local KV heads: each rank caches only its own heads, with the
same page tables everywhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ....errors import ConfigError
from ....models.config import ModelConfig

Collective = Callable[[torch.Tensor], torch.Tensor]

# Hugging Face tensor name suffix -> (dimension split, config field giving the full size)
_COLUMN = {
    "self_attn.q_proj": "num_heads",
    "self_attn.k_proj": "num_kv_heads",
    "self_attn.v_proj": "num_kv_heads",
    "mlp.gate_proj": "intermediate_size",
    "mlp.up_proj": "intermediate_size",
}
_ROW = {"self_attn.o_proj": "num_heads", "mlp.down_proj": "intermediate_size"}
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """Refuse a split that would not give every rank whole heads and channels, and a
    mixture-of-experts decoder (its experts are not sharded)."""
    if cfg.moe is not None:
        raise ConfigError("tensor_parallel_size > 1 does not shard mixture-of-experts decoders; use tensor_parallel_size=1")
    parts = {"attention heads": cfg.num_heads, "KV heads": cfg.num_kv_heads, "intermediate size": cfg.intermediate_size}
    bad = [f"{what} ({n})" for what, n in parts.items() if n % size]
    if bad:
        raise ConfigError(
            f"tensor_parallel_size={size} does not divide the model's {' and '.join(bad)}: "
            f"choose a size that divides {cfg.num_heads} heads and {cfg.num_kv_heads} KV heads"
        )


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config a rank builds its decoder from: local head and channel counts, the
    full vocabulary (sampling sees whole logits)."""
    check_divisible(cfg, size)
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // size,
        num_kv_heads=cfg.num_kv_heads // size,
        intermediate_size=cfg.intermediate_size // size,
    )


def vocab_rows(vocab: int, size: int) -> int:
    return -(-vocab // size)


class RowParallelLinear(nn.Linear):
    """``o_proj`` / ``down_proj`` over a slice of the input channels: each rank's partial
    product summed across ranks, then the whole bias added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, reduce: Collective) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; tokens outside them give zeros, summed over
    the ranks (exact: every row has one non-zero contribution)."""

    def __init__(self, vocab: int, hidden: int, rank: int, size: int, reduce: Collective) -> None:
        super().__init__()
        self.rows = vocab_rows(vocab, size)
        self.start = rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden))
        self.reduce = reduce

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.reduce(x.masked_fill(outside.unsqueeze(-1), 0))


class GatheredHead(nn.Module):
    """This rank's rows of the LM head; the partial logits of every rank gathered into
    ``[B, V]`` (padding rows dropped)."""

    def __init__(self, vocab: int, hidden: int, size: int, gather: Collective) -> None:
        super().__init__()
        self.vocab = vocab
        self.weight = nn.Parameter(torch.empty(vocab_rows(vocab, size), hidden))
        self.gather = gather

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.gather(F.linear(hidden, self.weight))[:, : self.vocab]


class TensorParallelShard:
    """One rank's view of the split, handed to the loader: the local config, the layers
    that communicate, and each checkpoint tensor's slice for this rank."""

    def __init__(self, rank: int, size: int, all_reduce: Collective, all_gather: Collective) -> None:
        self.rank = rank
        self.size = size
        self.all_reduce = all_reduce
        self.all_gather = all_gather
        self.full_config: ModelConfig | None = None

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        self.full_config = cfg
        return local_config(cfg, self.size)

    def prepare(self, model: Any) -> None:
        """Swap in the communicating layers (on the meta device, before allocation)."""
        cfg = model.config
        for layer in model.model.layers:
            for owner, name in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
                old = getattr(owner, name)
                setattr(owner, name, RowParallelLinear(old.in_features, old.out_features, old.bias is not None, self.all_reduce))
        model.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, self.rank, self.size, self.all_reduce)
        model.lm_head = GatheredHead(cfg.vocab_size, cfg.hidden_size, self.size, self.all_gather)

    def slice_named(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named:
            yield name, self.slice(name, tensor)

    def slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full Hugging Face tensor (unchanged when the name is
        replicated, or when its shape is not the full one: the loader then reports the
        mismatch)."""
        cfg = self.full_config
        assert cfg is not None, "local_config first"
        if name in _VOCAB:
            return self._vocab_slice(tensor, cfg.vocab_size)
        stem, _, kind = name.rpartition(".")
        for suffix, field in _COLUMN.items():
            if stem.endswith(suffix):
                return self._split(tensor, 0, self._full_rows(cfg, field))
        for suffix, field in _ROW.items():
            if stem.endswith(suffix) and kind == "weight":
                return self._split(tensor, 1, self._full_rows(cfg, field))
        return tensor

    def full_shape(self, name: str, local: tuple[int, ...]) -> tuple[int, ...]:
        """The Hugging Face shape of a tensor this rank holds ``local`` of."""
        cfg = self.full_config
        assert cfg is not None, "local_config first"
        if name in _VOCAB:
            return (cfg.vocab_size, *local[1:])
        stem, _, kind = name.rpartition(".")
        if any(stem.endswith(suffix) for suffix in _COLUMN):
            return (local[0] * self.size, *local[1:])
        if kind == "weight" and any(stem.endswith(suffix) for suffix in _ROW):
            return (local[0], local[1] * self.size)
        return local

    @staticmethod
    def _full_rows(cfg: ModelConfig, field: str) -> int:
        n = getattr(cfg, field)
        return n if field == "intermediate_size" else n * cfg.head_dim

    def _split(self, tensor: torch.Tensor, dim: int, full: int) -> torch.Tensor:
        if tensor.ndim <= dim or tensor.shape[dim] != full:
            return tensor
        part = full // self.size
        return tensor.narrow(dim, self.rank * part, part).contiguous()

    def _vocab_slice(self, tensor: torch.Tensor, vocab: int) -> torch.Tensor:
        if tensor.ndim != 2 or tensor.shape[0] != vocab:
            return tensor
        rows = vocab_rows(vocab, self.size)
        start = min(self.rank * rows, vocab)
        part = tensor[start : start + rows]
        if part.shape[0] < rows:
            part = torch.cat([part, part.new_zeros(rows - part.shape[0], tensor.shape[1])])
        return part.contiguous()
