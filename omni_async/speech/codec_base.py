"""What every codec decoder (codes to PCM) shares: one-shot and streamed decoding over one
graph-safe call, and the contract the codec stage, the slot store and the graphs read.

Why a base: the Qwen3-TTS speech-tokenizer decoder (:mod:`~omni_async.speech.codec`) and
Qwen3-Omni's Code2Wav (:mod:`~omni_async.speech.code2wav`) are the same causal network
behind different front ends, so everything around their ``forward`` (stacking the streams'
pasts, carrying them between chunks, the one-shot decode as consecutive calls, the checks)
is written once. A subclass builds its layers, calls ``_index_stateful`` and defines
``forward(codes [B, T, Q], past, position) -> (pcm [B, T * samples_per_frame], pasts)``.

The contract (what :class:`~omni_async.speech.codec_stage.CodecStage`,
:class:`~omni_async.speech.codec_slots.CodecSlots` and
:class:`~omni_async.speech.codec_graphs.CodecGraphs` read): ``sample_rate``,
``samples_per_frame``, ``num_quantizers``, ``leading_samples``, ``device``, ``dtype``,
``empty_past(batch)`` and the call itself. ``leading_samples`` is how many samples at the
start of a stream's audio are not audio: a stream's first call returns them as zeros and
its consumer drops them (0 for Qwen3-TTS; Code2Wav's output is that much shorter than
``frames * samples_per_frame``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Self

import torch
from torch import nn

from ..errors import InvalidRequestError
from .codec_layers import Stateful
from .codec_transformer import rope_frequencies


@dataclass
class CodecState:
    """One stream's carried past: a tensor per layer that has one (batch dimension 1), the
    index of the next frame (on the device, so no step reads it back), and the frames
    decoded so far (on the host)."""

    past: list[torch.Tensor]
    position: torch.Tensor
    frames: int = 0


class StreamDecoder(nn.Module):
    """Codes ``[B, F, Q]`` to float32 PCM, one-shot or streamed; see the module docstring."""

    #: The most frames one call decodes: longer one-shot decodes run as consecutive calls
    #: through the carried state (same samples), bounding the attention's memory.
    max_frames_per_call = 256

    config: Any
    pre_transformer: nn.Module
    decoder: nn.ModuleList
    sample_rate: int
    samples_per_frame: int
    num_quantizers: int
    codebook_size: int
    leading_samples: int = 0

    def __init__(self, config: Any) -> None:
        """The facts the codec stage reads, from ``config`` (each decoder's config has them)."""
        super().__init__()
        self.config = config
        self.sample_rate, self.samples_per_frame = config.sample_rate, config.samples_per_frame
        self.num_quantizers, self.codebook_size = config.num_quantizers, config.codebook_size

    def _index_stateful(self) -> None:
        """Give every layer with a past its slot in the carry (after the layers are built)."""
        self._stateful = [m for m in self.modules() if isinstance(m, Stateful) and math.prod(m.past_shape()) > 0]
        for slot, module in enumerate(self._stateful):
            module.slot = slot

    # ---------------------------------------------------------------- construction
    @classmethod
    def random(cls, config: Any, *, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, seed: int = 0) -> Self:
        """Random weights, scaled so the audio is neither silent nor clipped (for tests and speed
        runs at a real config); the same seed gives the same weights."""
        from .codec_random import randomize

        model = cls(config)
        randomize(model, seed)
        return model._placed(device, dtype)

    def _placed(self, device: str | torch.device, dtype: torch.dtype) -> Self:
        """On its device and dtype for inference: no gradients (streamed states are inference
        tensors), RoPE frequencies kept in float32 whatever the dtype."""
        self.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.pre_transformer.inv_freq = rope_frequencies(self.config).to(self.device)
        return self

    @property
    def device(self) -> torch.device:
        return self.decoder[-1].conv.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder[-1].conv.weight.dtype

    def empty_past(self, batch: int) -> list[torch.Tensor]:
        """The pasts of ``batch`` new streams, stacked as ``forward`` takes them (zeros: a new
        stream's past reads as the one-shot decode's zero padding). A graphed caller keeps
        such tensors as its static inputs."""
        return [torch.zeros((batch, *m.past_shape()), device=self.device, dtype=self.dtype) for m in self._stateful]

    # ---------------------------------------------------------------- one-shot
    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes [B, F, Q]`` -> float32 PCM ``[B, F * samples_per_frame - leading_samples]``
        with full causal context. Frames whose codebook-0 code is negative are padding: a
        row's audio is as long as its real frames' (the rest of the row is zeros) and the
        result is as long as the longest row's audio."""
        self._check_codes(codes, dims=3)
        codes = codes.to(self.device)
        real = ((codes[..., 0] >= 0).sum(dim=1) * self.samples_per_frame - self.leading_samples).clamp(min=0)
        batch, frames = codes.shape[0], codes.shape[1]
        past, position = self.empty_past(batch), torch.zeros(batch, dtype=torch.long, device=self.device)
        pieces = []
        for start in range(0, frames, self.max_frames_per_call):
            piece = codes[:, start:start + self.max_frames_per_call]
            pcm, past = self(piece, past, position)
            position = position + piece.shape[1]
            pieces.append(pcm)
        pcm = torch.cat(pieces, dim=1) if pieces else torch.zeros(batch, 0, device=self.device)
        pcm = pcm[:, self.leading_samples:]
        keep = torch.arange(pcm.shape[1], device=self.device)[None, :] < real[:, None]
        longest = int(real.max()) if batch else 0
        return (pcm * keep)[:, :longest]

    # ---------------------------------------------------------------- streamed
    def new_state(self) -> CodecState:
        """A stream's state before its first frame (its past reads as the zero padding)."""
        return CodecState(past=self.empty_past(1), position=torch.zeros(1, dtype=torch.long, device=self.device))

    @torch.inference_mode()
    def decode_chunk(self, codes: torch.Tensor, state: CodecState) -> torch.Tensor:
        """The next ``codes [F, Q]`` of one stream -> its ``F * samples_per_frame`` samples
        (less ``leading_samples`` on its first chunk); ``state`` advances past them."""
        return self.decode_streams([codes], [state])[0]

    @torch.inference_mode()
    def decode_streams(self, chunks: list[torch.Tensor], states: list[CodecState]) -> list[torch.Tensor]:
        """The next chunk of each of several streams (``chunks[i] [F_i, Q]`` for ``states[i]``),
        decoded in one batched call per distinct ``F_i`` with the streams' pasts stacked; each
        state advances. Returns each stream's samples in order."""
        if len(chunks) != len(states):
            raise InvalidRequestError(f"decode_streams: {len(chunks)} chunks for {len(states)} states")
        if len({id(s) for s in states}) != len(states):
            raise InvalidRequestError("decode_streams: a stream's state appears twice")
        for chunk in chunks:
            self._check_codes(chunk, dims=2)
        out: list[torch.Tensor | None] = [None] * len(chunks)
        groups: dict[int, list[int]] = {}
        for i, chunk in enumerate(chunks):
            groups.setdefault(chunk.shape[0], []).append(i)
        for frames, rows in groups.items():
            if frames == 0:
                for i in rows:
                    out[i] = torch.zeros(0, device=self.device)
                continue
            self._decode_group(rows, chunks, states, out)
        return out  # type: ignore[return-value]

    def _decode_group(self, rows: list[int], chunks: list[torch.Tensor], states: list[CodecState],
                      out: list[torch.Tensor | None]) -> None:
        """One batched call for streams whose chunks have the same length."""
        codes = torch.stack([chunks[i].to(self.device) for i in rows])
        if len(rows) == 1:
            past, position = states[rows[0]].past, states[rows[0]].position
        else:
            past = [torch.cat([states[i].past[s] for i in rows]) for s in range(len(self._stateful))]
            position = torch.cat([states[i].position for i in rows])
        pcm, after = self(codes, past, position)
        frames = codes.shape[1]
        for j, i in enumerate(rows):
            state = states[i]
            state.past = [t[j:j + 1] for t in after]
            state.position = position[j:j + 1] + frames
            out[i] = pcm[j] if state.frames else pcm[j, self.leading_samples:]
            state.frames += frames

    # ---------------------------------------------------------------- checks
    def _check_codes(self, codes: torch.Tensor, *, dims: int) -> None:
        """Shape and type on the host; values only where reading them costs no device sync
        beyond the one-shot decode's own (``decode`` checks them; streamed chunks are clamped)."""
        shape = "[B, F, %d]" % self.num_quantizers if dims == 3 else "[F, %d]" % self.num_quantizers
        if not isinstance(codes, torch.Tensor) or codes.dim() != dims or codes.shape[-1] != self.num_quantizers:
            got = tuple(codes.shape) if isinstance(codes, torch.Tensor) else type(codes).__name__
            raise InvalidRequestError(f"codec: codes must be {shape}, got {got}")
        if codes.dtype.is_floating_point or codes.dtype == torch.bool or codes.dtype.is_complex:
            raise InvalidRequestError(f"codec: codes must be integers, got {codes.dtype}")
        if dims == 3 and codes.numel() and int(codes.max()) >= self.codebook_size:
            raise InvalidRequestError(
                f"codec: code {int(codes.max())} is outside the codebook (size {self.codebook_size})")
