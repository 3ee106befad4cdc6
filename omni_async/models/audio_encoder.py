"""Qwen3-Omni's audio encoder (the thinker's ``audio_tower``): log-mel features
(:mod:`.audio_features`) to rows of the thinker's width, which take the places of the
prompt's audio placeholders in its input embeddings.

Its shape, as the reference (transformers' ``Qwen3OmniMoeAudioEncoder``) computes it:

- each audio's frames are cut into chunks of ``2 * n_window`` (the last may be shorter);
  all chunks of a request are zero-padded to the longest and go through three stride-2
  3x3 convolutions (GELU after each) over (mel, time) as one batch, then ``conv_out``
  flattens channels x mel bins to ``d_model``; sinusoidal positions restart at 0 in each
  chunk; the rows past each chunk's own length after the convolutions are dropped (the
  padding reaches the last valid rows through the convolutions' windows, so the batch,
  not each chunk alone, is what is computed);
- encoder layers (pre-LayerNorm, biased attention without rotary positions, a GELU MLP)
  attend within windows: each audio's rows in runs of ``longest chunk's rows *
  n_window_infer // (2 * n_window)`` (a shorter run last); never across audios;
- ``ln_post``, ``proj1``, GELU, ``proj2`` (to ``output_dim``, the thinker's width).

The rows of one audio number :meth:`AudioEncoder.output_length` of its frames: 13 per
full 100-frame chunk at the released ``n_window`` (50), which is what the processor
expands its placeholder to.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelLoadError
from .loader import check_tensors, iter_checkpoint
from .random_weights import RandomWeights, fill_random

__all__ = ["AudioEncoderConfig", "AudioEncoder", "PREFIX"]

PREFIX = "thinker.audio_tower."
_GELU = {"gelu": "none", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh"}


@dataclass(frozen=True)
class AudioEncoderConfig:
    num_mel_bins: int
    d_model: int
    layers: int
    heads: int
    ffn_dim: int
    output_dim: int
    n_window: int
    n_window_infer: int
    downsample_hidden_size: int
    max_source_positions: int
    conv_chunksize: int  # chunks through the convolutions at a time (their activations bound memory)
    gelu: str  # torch's ``approximate``: "none" (exact) or "tanh"

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, source: str = "audio_config") -> "AudioEncoderConfig":
        act = str(raw.get("activation_function", "gelu"))
        if act not in _GELU:
            raise ModelLoadError(f"{source}: activation {act!r} is not supported (one of {sorted(_GELU)})")
        try:
            cfg = cls(num_mel_bins=int(raw.get("num_mel_bins", 128)), d_model=int(raw.get("d_model", 1280)),
                      layers=int(raw.get("encoder_layers", 32)), heads=int(raw.get("encoder_attention_heads", 20)),
                      ffn_dim=int(raw.get("encoder_ffn_dim", 5120)), output_dim=int(raw.get("output_dim", 3584)),
                      n_window=int(raw.get("n_window", 50)), n_window_infer=int(raw.get("n_window_infer", 800)),
                      downsample_hidden_size=int(raw.get("downsample_hidden_size", 480)),
                      max_source_positions=int(raw.get("max_source_positions", 1500)),
                      conv_chunksize=max(1, int(raw.get("conv_chunksize", 500))), gelu=_GELU[act])
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{source}: malformed audio encoder config ({exc})") from None
        if cfg.d_model % cfg.heads or cfg.d_model % 2:
            raise ModelLoadError(f"{source}: d_model {cfg.d_model} must be even and divisible by {cfg.heads} heads")
        if cfg.n_window_infer < 2 * cfg.n_window:
            raise ModelLoadError(f"{source}: n_window_infer {cfg.n_window_infer} is shorter than a chunk (2 * n_window)")
        return cfg

    @classmethod
    def from_folder(cls, folder: str | Path) -> "AudioEncoderConfig":
        """``thinker_config.audio_config`` of a Qwen3-Omni folder's config.json."""
        path = Path(folder) / "config.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            audio = raw["thinker_config"]["audio_config"]
        except FileNotFoundError:
            raise ModelLoadError(f"{folder}: no config.json") from None
        except (KeyError, TypeError, json.JSONDecodeError):
            raise ModelLoadError(f"{path}: no thinker_config.audio_config (a Qwen3-Omni folder's audio encoder)") from None
        return cls.from_dict(audio, source=f"{path}: thinker_config.audio_config")

    @property
    def chunk_frames(self) -> int:
        return 2 * self.n_window


def _conv_length(n: int) -> int:
    """Rows after one stride-2, kernel-3, padding-1 convolution."""
    return (n - 1) // 2 + 1


@dataclass
class _Windows:
    """The rows of each attention window: ``index`` ``[W, size]`` (a short window's tail
    repeats a row of its own) and ``valid`` ``[W, size]``, so attention is one batched call
    of W windows whose padded keys are masked, memory ``rows x size`` however long the audio."""

    index: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def of(cls, counts: list[int], size: int, device: torch.device) -> "_Windows":
        spans, start = [], 0
        for n in counts:
            spans.extend((start + w, min(size, n - w)) for w in range(0, n, size))
            start += n
        offsets = torch.arange(size)
        index = torch.stack([s + torch.minimum(offsets, torch.tensor(n - 1)) for s, n in spans])
        valid = torch.stack([offsets < n for _, n in spans])
        return cls(index.to(device), valid.to(device))


class _Attention(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.heads = cfg.heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor, windows: _Windows) -> torch.Tensor:
        n, d = x.shape
        w, size = windows.index.shape
        q, k, v = (p(x)[windows.index].view(w, size, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=windows.valid[:, None, None, :])
        return self.out_proj(out.transpose(1, 2).reshape(w, size, d)[windows.valid])


class _Layer(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig) -> None:
        super().__init__()
        self.gelu = cfg.gelu
        self.self_attn = _Attention(cfg)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.ffn_dim)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x: torch.Tensor, windows: _Windows) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), windows)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x)), approximate=self.gelu))


class AudioEncoder(nn.Module):
    """``encode(features)``: per audio of one request its ``[mel, frames]`` features in,
    its ``[output_length(frames), output_dim]`` rows out (the module's docstring)."""

    def __init__(self, cfg: AudioEncoderConfig) -> None:
        super().__init__()
        self.config = cfg
        c = cfg.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, c, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(c, c, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(c, c, 3, 2, padding=1)
        mels = _conv_length(_conv_length(_conv_length(cfg.num_mel_bins)))
        self.conv_out = nn.Linear(c * mels, cfg.d_model, bias=False)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.layers))
        self.ln_post = nn.LayerNorm(cfg.d_model)
        self.proj1 = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj2 = nn.Linear(cfg.d_model, cfg.output_dim)
        self.register_buffer("positions", _sinusoids(cfg.max_source_positions, cfg.d_model), persistent=False)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_folder(cls, folder: str | Path, *, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> "AudioEncoder":
        """From a Qwen3-Omni folder's ``thinker.audio_tower.*`` tensors (no other is read);
        a tensor missing, unexpected or of another shape is a ModelLoadError naming it."""
        model = cls(AudioEncoderConfig.from_folder(folder))
        state = {name[len(PREFIX):]: t for name, t in iter_checkpoint(Path(folder)) if name.startswith(PREFIX)}
        check_tensors(model.state_dict(), state, folder, "the audio encoder's tensors", PREFIX)
        model.load_state_dict(state, strict=True)
        return model.to(device=device, dtype=dtype).eval()

    @classmethod
    @torch.no_grad()
    def random(cls, cfg: AudioEncoderConfig, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               seed: int = 0, std: float = 0.02) -> "AudioEncoder":
        """Random weights drawn on ``device`` (a random-weight folder's speed runs)."""
        model = cls(cfg).to(device=device, dtype=dtype)
        fill_random(model, RandomWeights(seed=seed, std=std))
        for name, p in model.named_parameters():
            if "layer_norm" in name or name.startswith("ln_post"):
                p.fill_(1.0 if name.endswith("weight") else 0.0)
        return model.eval()

    # ---------------------------------------------------------------- lengths
    def chunk_lengths(self, frames: int) -> list[int]:
        """An audio's chunks, in frames."""
        size = self.config.chunk_frames
        return [size] * (frames // size) + ([frames % size] if frames % size else [])

    def output_length(self, frames: int) -> int:
        """The rows an audio of ``frames`` feature frames becomes (its placeholder count)."""
        return sum(_conv_length(_conv_length(_conv_length(n))) for n in self.chunk_lengths(frames))

    # ---------------------------------------------------------------- the forward
    @torch.inference_mode()
    def encode(self, features: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One request's audios together (chunks padded to the longest of them all, as
        the reference batches a prompt's audios): a ``[rows, output_dim]`` tensor each."""
        if not features:
            return []
        p = self.conv2d1.weight
        chunks = [c for f in features for c in f.to(p.device, p.dtype).split(self.config.chunk_frames, dim=1)]
        lengths = [c.shape[1] for c in chunks]
        longest = max(lengths)
        padded = torch.stack([F.pad(c, (0, longest - c.shape[1])) for c in chunks])[:, None]
        x = torch.cat([self._convolved(group) for group in padded.split(self.config.conv_chunksize)])
        b, c, m, t = x.shape
        x = self.conv_out(x.permute(0, 3, 1, 2).reshape(b, t, c * m)) + self.positions[:t].to(x.dtype)
        kept = [_conv_length(_conv_length(_conv_length(n))) for n in lengths]
        x = torch.cat([rows[:n] for rows, n in zip(x, kept)])
        counts = [self.output_length(f.shape[1]) for f in features]
        size = max(kept) * (self.config.n_window_infer // self.config.chunk_frames)
        windows = _Windows.of(counts, size, x.device)
        for layer in self.layers:
            x = layer(x, windows)
        x = self.proj2(F.gelu(self.proj1(self.ln_post(x)), approximate=self.config.gelu))
        return list(x.split(counts))

    def _convolved(self, chunks: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv2d1(chunks))
        x = F.gelu(self.conv2d2(x))
        return F.gelu(self.conv2d3(x))


def _sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's sinusoidal positions ``[length, channels]``: sines then cosines."""
    step = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-step * torch.arange(channels // 2).float())
    t = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=1)
