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

from pathlib import Path

import torch
from torch import nn

from ..errors import ModelLoadError
from .codec_base import CodecState, StreamDecoder
from .codec_config import CodecConfig
from .codec_layers import Carry, CausalConv, SnakeBeta, Upsample, VocoderBlock, run_layers
from .codec_quantizer import Quantizer
from .codec_transformer import Transformer

__all__ = ["CodecDecoder", "CodecState"]

# Tensors of the checkpoint's decoder this decoder does not use: the RVQ's input projections
# serve the encoder side.
_UNUSED = ("quantizer.rvq_first.input_proj.weight", "quantizer.rvq_rest.input_proj.weight")


class CodecDecoder(StreamDecoder):
    """Codes ``[B, F, 16]`` to float32 PCM ``[B, F * samples_per_frame]``, one-shot or streamed
    (:class:`~omni_async.speech.codec_base.StreamDecoder`)."""

    def __init__(self, config: CodecConfig) -> None:
        super().__init__(config)
        c = config
        self.quantizer = Quantizer(c)
        self.pre_conv = CausalConv(c.codebook_dim, c.latent_dim, 3)
        self.pre_transformer = Transformer(c, c.latent_dim)
        self.upsample = nn.ModuleList([Upsample(c.latent_dim, f) for f in c.upsampling_ratios])
        widths = [c.decoder_dim // 2 ** i for i in range(len(c.upsample_rates) + 1)]
        self.decoder = nn.ModuleList(
            [CausalConv(c.latent_dim, c.decoder_dim, 7)]
            + [VocoderBlock(widths[i], widths[i + 1], rate) for i, rate in enumerate(c.upsample_rates)]
            + [SnakeBeta(widths[-1]), CausalConv(widths[-1], 1, 7)])
        self._index_stateful()

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
        h = run_layers(self.decoder, h, carry)
        return h[:, 0].clamp(-1.0, 1.0).float(), carry.next  # type: ignore[return-value]
