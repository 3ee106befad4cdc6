"""The Qwen3-TTS 12 Hz speech-tokenizer decoder: 16 codebooks a frame at 12.5 frames a second
in, 24 kHz PCM out (1920 samples a frame), written in plain torch.

The path, frame by frame: the split RVQ's dequantisation (codebook 0 and codebooks 1..15 each
summed and projected on their own), a causal conv, a transformer whose attention sees the
last 72 frames, two x2 upsampling stages (transposed conv + ConvNeXt block), and the vocoder
(causal conv, four SnakeBeta / causal transposed conv / residual-unit stages at x8 x5 x4 x3,
a last causal conv) clamped to [-1, 1].

Every part is causal, so a stream can be decoded as its frames arrive: ``decode_chunk``
carries each layer's past in a ``CodecState`` (the window's keys and values, each causal
conv's left context, each transposed conv's overlapping input) and any split of a stream into
chunks gives the samples of ``decode`` on all of its frames, within float rounding.
``decode_streams`` decodes a chunk of several streams in one batched call per chunk length.

``decode`` is the one-shot decode with full causal context. It differs from the reference
package's own ``speech_tokenizer.decode`` beyond 300 frames: that one decodes in 300-frame
pieces, each seeing only 25 frames before it, and so drops the context a one-shot decode
has (the samples of frames 300 and on differ). Matching the one-shot decode is what lets a
streamed decode, chunk by chunk, give the same audio as a whole one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import InvalidRequestError, ModelLoadError
from .codec_config import CodecConfig
from .codec_layers import (Carry, CausalConv, Quantizer, SnakeBeta, Stateful, Transformer, Upsample, VocoderBlock,
                           rope_frequencies)

# Tensors of the checkpoint's decoder this decoder does not use: the RVQ's input projections
# serve the encoder side.
_UNUSED = ("quantizer.rvq_first.input_proj.weight", "quantizer.rvq_rest.input_proj.weight")


@dataclass
class CodecState:
    """One stream's carried past: a tensor per layer that has one (batch dimension 1), the
    index of the next frame (on the device, so no step reads it back), and the frames
    decoded so far (on the host)."""

    past: list[torch.Tensor]
    position: torch.Tensor
    frames: int = 0


class CodecDecoder(nn.Module):
    """Codes ``[B, F, 16]`` to float32 PCM ``[B, F * samples_per_frame]``, one-shot or streamed."""

    #: The most frames one call decodes: longer one-shot decodes run as consecutive calls
    #: through the carried state (same samples), bounding the attention's memory.
    max_frames_per_call = 256

    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.sample_rate = c.sample_rate
        self.samples_per_frame = c.samples_per_frame
        self.num_quantizers = c.num_quantizers
        self.quantizer = Quantizer(c)
        self.pre_conv = CausalConv(c.codebook_dim, c.latent_dim, 3)
        self.pre_transformer = Transformer(c)
        self.upsample = nn.ModuleList([Upsample(c.latent_dim, f) for f in c.upsampling_ratios])
        widths = [c.decoder_dim // 2 ** i for i in range(len(c.upsample_rates) + 1)]
        self.decoder = nn.ModuleList(
            [CausalConv(c.latent_dim, c.decoder_dim, 7)]
            + [VocoderBlock(widths[i], widths[i + 1], rate) for i, rate in enumerate(c.upsample_rates)]
            + [SnakeBeta(widths[-1]), CausalConv(widths[-1], 1, 7)])
        self._stateful = [m for m in self.modules() if isinstance(m, Stateful) and math.prod(m.past_shape()) > 0]
        for slot, module in enumerate(self._stateful):
            module.slot = slot

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_folder(cls, folder: str | Path, *, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> "CodecDecoder":
        """From a ``speech_tokenizer`` folder (``config.json`` + ``model.safetensors``); the model
        folder holding one is accepted too."""
        from safetensors import safe_open

        folder = Path(folder)
        if (folder / "speech_tokenizer" / "config.json").is_file():
            folder = folder / "speech_tokenizer"
        config = CodecConfig.from_folder(folder)
        weights = folder / "model.safetensors"
        if not weights.is_file():
            raise ModelLoadError(f"speech tokenizer: {weights} is missing")
        with safe_open(str(weights), framework="pt") as f:
            state = {k[len("decoder."):]: f.get_tensor(k) for k in f.keys() if k.startswith("decoder.")}
        for key in _UNUSED:
            state.pop(key, None)
        model = cls(config)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ModelLoadError(f"speech tokenizer: {weights} does not match its config: missing "
                                 f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
        return model._placed(device, dtype)

    @classmethod
    def random(cls, config: CodecConfig, *, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, seed: int = 0) -> "CodecDecoder":
        """Random weights, scaled so the audio is neither silent nor clipped (for tests and speed
        runs at a real config); the same seed gives the same weights."""
        from .codec_random import randomize

        model = cls(config)
        randomize(model, seed)
        return model._placed(device, dtype)

    def _placed(self, device: str | torch.device, dtype: torch.dtype) -> "CodecDecoder":
        """On its device and dtype for inference: no gradients (streamed states are inference
        tensors), RoPE frequencies kept in float32 whatever the dtype."""
        self.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.pre_transformer.inv_freq = rope_frequencies(self.config).to(self.device)
        return self

    @property
    def device(self) -> torch.device:
        return self.pre_conv.conv.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.pre_conv.conv.weight.dtype

    # ---------------------------------------------------------------- the step
    def forward(self, codes: torch.Tensor, past: list[torch.Tensor],
                position: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One call over ``codes [B, T, 16]`` of B streams whose pasts are stacked in ``past`` and
        whose next frame indices are ``position [B]``: float32 PCM ``[B, T * samples_per_frame]``
        and the pasts after the chunk. Static shapes per (B, T), no host sync: graph-safe.
        Codes are clamped into the codebook (an index outside would fault the device)."""
        carry = Carry(past, position)
        h = self.quantizer(codes.clamp(0, self.config.codebook_size - 1))
        h = self.pre_conv(h, carry).transpose(1, 2)
        h = self.pre_transformer(h, carry).transpose(1, 2)
        for stage in self.upsample:
            h = stage(h, carry)
        for layer in self.decoder:
            h = layer(h, carry)
        return h[:, 0].clamp(-1.0, 1.0).float(), carry.next  # type: ignore[return-value]

    def empty_past(self, batch: int) -> list[torch.Tensor]:
        """The pasts of ``batch`` new streams, stacked as ``forward`` takes them (zeros: a new
        stream's past reads as the one-shot decode's zero padding). A graphed caller keeps
        such tensors as its static inputs."""
        return [torch.zeros((batch, *m.past_shape()), device=self.device, dtype=self.dtype) for m in self._stateful]

    # ---------------------------------------------------------------- one-shot
    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes [B, F, 16]`` -> float32 PCM ``[B, F * samples_per_frame]`` with full causal
        context. As in the reference, frames whose codebook-0 code is negative are padding: a
        row's audio is ``samples_per_frame`` times its count of real frames (the rest of the row
        is zeros) and the result is as long as the longest row's audio."""
        self._check_codes(codes, dims=3)
        codes = codes.to(self.device)
        real = (codes[..., 0] >= 0).sum(dim=1) * self.samples_per_frame
        batch, frames = codes.shape[0], codes.shape[1]
        past, position = self.empty_past(batch), torch.zeros(batch, dtype=torch.long, device=self.device)
        pieces = []
        for start in range(0, frames, self.max_frames_per_call):
            piece = codes[:, start:start + self.max_frames_per_call]
            pcm, past = self(piece, past, position)
            position = position + piece.shape[1]
            pieces.append(pcm)
        pcm = torch.cat(pieces, dim=1) if pieces else torch.zeros(batch, 0, device=self.device)
        keep = torch.arange(pcm.shape[1], device=self.device)[None, :] < real[:, None]
        longest = int(real.max()) if batch else 0
        return (pcm * keep)[:, :longest]

    # ---------------------------------------------------------------- streamed
    def new_state(self) -> CodecState:
        """A stream's state before its first frame (its past reads as the zero padding)."""
        return CodecState(past=self.empty_past(1), position=torch.zeros(1, dtype=torch.long, device=self.device))

    @torch.inference_mode()
    def decode_chunk(self, codes: torch.Tensor, state: CodecState) -> torch.Tensor:
        """The next ``codes [F, 16]`` of one stream -> its ``F * samples_per_frame`` samples;
        ``state`` advances past them."""
        return self.decode_streams([codes], [state])[0]

    @torch.inference_mode()
    def decode_streams(self, chunks: list[torch.Tensor], states: list[CodecState]) -> list[torch.Tensor]:
        """The next chunk of each of several streams (``chunks[i] [F_i, 16]`` for ``states[i]``),
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
            state.frames += frames
            out[i] = pcm[j]

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
        if dims == 3 and codes.numel() and int(codes.max()) >= self.config.codebook_size:
            raise InvalidRequestError(
                f"codec: code {int(codes.max())} is outside the codebook (size {self.config.codebook_size})")
