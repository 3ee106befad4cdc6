"""Qwen3-Omni's Code2Wav: the talker's code frames (16 codebooks, 12.5 frames a second) to
24 kHz PCM, one-shot or streamed, from a ``Qwen3OmniMoeForConditionalGeneration`` folder.

It is the Qwen3-TTS speech-tokenizer decoder's network (:mod:`~omni_async.speech.codec`)
with another front end, so it is built from the same layers
(:mod:`~omni_async.speech.codec_layers`) and its tensors load by name: a frame's vector is
the mean of its codebooks' rows of one embedding table (``code_embedding``; no RVQ, no
pre-conv), the sliding-window transformer runs at ``hidden_size`` without the in and out
projections, and the upsampling and vocoder follow as in Qwen3-TTS.

One difference in the vocoder: each stage's transposed conv drops ``rate`` samples at
the start of its output as well as at the end, so the decode of F frames is
``F * 1920 - 555`` samples long (at the released shape) and runs 555 samples ahead of a
causal decode. Here a call computes the causal layers' ``F * 1920`` samples and each
layer downstream of a transposed conv zeroes, in a stream's first chunk, the samples its
input holds ahead of the signal (``Stateful.lead``): what the one-shot decode's zero
padding gives at the start of its shorter signal. A stream's first ``leading_samples``
samples (zeros) are then dropped by whoever reads it: ``decode``, ``decode_streams``, or
the codec stage. So a stream decoded chunk by chunk gives ``decode``'s samples, and
``decode`` gives transformers' ``Qwen3OmniMoeCode2Wav.forward``.

transformers' ``generate(return_audio=True)`` calls ``chunked_decode`` (300-frame pieces,
each with 25 frames of context from position 0, each 555 samples short): up to 300 frames
that is ``forward`` exactly; beyond, it differs from the one-shot decode (docs/speech.md).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from ..errors import ModelLoadError
from ..models.loader import check_tensors, safetensors_files
from .code2wav_config import Code2WavConfig
from .codec_base import CodecState, StreamDecoder
from .codec_layers import Carry, CausalConv, SnakeBeta, Upsample, VocoderBlock, run_layers
from .codec_transformer import Transformer

__all__ = ["Code2Wav", "CodecState"]

PREFIX = "code2wav."


class Code2Wav(StreamDecoder):
    """Codes ``[B, F, num_quantizers]`` to float32 PCM ``[B, F * samples_per_frame -
    leading_samples]``, one-shot or streamed (:class:`~omni_async.speech.codec_base.StreamDecoder`)."""

    def __init__(self, config: Code2WavConfig) -> None:
        super().__init__(config)
        c = config
        self.leading_samples = c.leading_samples
        self.code_embedding = nn.Embedding(c.codebook_size * c.num_quantizers, c.hidden_size)
        self.register_buffer("code_offset", torch.arange(c.num_quantizers) * c.codebook_size, persistent=False)
        self.pre_transformer = Transformer(c)
        self.upsample = nn.ModuleList([Upsample(c.hidden_size, f) for f in c.upsampling_ratios])
        widths = [c.decoder_dim // 2 ** i for i in range(len(c.upsample_rates) + 1)]
        self.decoder = nn.ModuleList(
            [CausalConv(c.hidden_size, c.decoder_dim, 7)]
            + [VocoderBlock(widths[i], widths[i + 1], rate) for i, rate in enumerate(c.upsample_rates)]
            + [SnakeBeta(widths[-1]), CausalConv(widths[-1], 1, 7)])
        if _mark_leads(self.decoder) != self.leading_samples:
            raise ModelLoadError("code2wav: the vocoder's lead does not match its config")  # a layer-shape bug
        self._index_stateful()

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_folder(cls, folder: str | Path, *, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> "Code2Wav":
        """From a Qwen3-Omni folder: ``code2wav_config`` in ``config.json`` and the
        ``code2wav.*`` tensors of its safetensors (no other tensor is read). A tensor missing,
        unexpected or of another shape is a ModelLoadError naming it."""
        folder = Path(folder)
        model = cls(Code2WavConfig.from_folder(folder))
        state = {}
        for file in safetensors_files(folder):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name.startswith(PREFIX):
                        state[name[len(PREFIX):]] = f.get_tensor(name)
        check_tensors(model.state_dict(), state, folder, "the code2wav tensors", PREFIX)
        model.load_state_dict(state, strict=True)
        return model._placed(device, dtype)

    # ---------------------------------------------------------------- the step
    def forward(self, codes: torch.Tensor, past: list[torch.Tensor],
                position: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One call over ``codes [B, T, Q]`` of B streams whose pasts are stacked in ``past`` and
        whose next frame indices are ``position [B]``: float32 PCM ``[B, T * samples_per_frame]``
        (a stream's first ``leading_samples`` zeros in the rows at position 0) and the pasts
        after the chunk. Static shapes per (B, T), no host sync: graph-safe. Codes are
        clamped into the codebook (an index outside would fault the device)."""
        carry = Carry(past, position)
        ids = codes.clamp(0, self.codebook_size - 1) + self.code_offset
        h = F.embedding(ids, self.code_embedding.weight).mean(dim=2)
        h = self.pre_transformer(h, carry).transpose(1, 2)
        for stage in self.upsample:
            h = stage(h, carry)
        h = run_layers(self.decoder, h, carry)
        h = carry.clear_lead(h, self.leading_samples)
        return h[:, 0].clamp(-1.0, 1.0).float(), carry.next  # type: ignore[return-value]


def _mark_leads(decoder: nn.ModuleList) -> int:
    """Set ``lead`` on every vocoder layer that mixes time, in order: a stage's transposed
    conv reads the lead so far and adds ``kernel - stride`` (scaled by its stride), its
    residual units' dilated convs and the last conv read the result. Returns the output's."""
    lead = 0
    for block in decoder:
        if isinstance(block, VocoderBlock):
            trans = block.block[1]
            trans.lead = lead
            kernel, stride = trans.conv.kernel_size[0], trans.conv.stride[0]
            lead = lead * stride + kernel - stride
            for unit in block.block[2:]:
                unit.conv1.lead = lead
    decoder[-1].lead = lead
    return lead
