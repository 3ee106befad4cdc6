"""Qwen3-Omni's Code2Wav shape, read from the ``code2wav_config`` of a
``Qwen3OmniMoeForConditionalGeneration`` folder's ``config.json``.

Why a config of its own beside :class:`~omni_async.speech.codec_config.CodecConfig`: the
network is the Qwen3-TTS decoder's, but its fields are not that decoder's (no quantizer, no
latent width: the transformer, the upsampling and the vocoder's first conv all run at
``hidden_size``), and one fact follows from its shape that the Qwen3-TTS decoder does not
have: ``leading_samples``, how far its output runs ahead of a causal decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

from ..errors import ModelLoadError
from ..models.config import read_folder_json
from .omni_config import ARCHITECTURE

__all__ = ["Code2WavConfig"]


@dataclass(frozen=True)
class Code2WavConfig:
    """The fields of transformers' ``Qwen3OmniMoeCode2WavConfig`` that shape the decoder.

    Defaults are transformers' (and the released Qwen3-Omni-30B-A3B's): 16 codebooks of
    2048, a transformer of width 1024 (8 layers, 16 heads of 64, a 72-frame window), two x2
    upsampling stages and a vocoder of width 1536 at x8 x5 x4 x3: 1920 samples a frame at
    24 kHz. ``qwen3_omni()`` names them for speed runs at the real size.
    """

    codebook_size: int = 2048
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 64
    sliding_window: int = 72
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    attention_bias: bool = False
    num_quantizers: int = 16
    upsampling_ratios: tuple[int, ...] = (2, 2)
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    decoder_dim: int = 1536
    sample_rate: int = 24000

    def __post_init__(self) -> None:
        if self.hidden_act != "silu":
            raise ModelLoadError(f"code2wav: hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.num_quantizers < 1 or self.codebook_size < 1:
            raise ModelLoadError("code2wav: num_quantizers and codebook_size must be at least 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError("code2wav: num_attention_heads must be a multiple of num_key_value_heads")
        if self.decoder_dim % 2 ** len(self.upsample_rates):
            raise ModelLoadError("code2wav: decoder_dim must halve cleanly at every vocoder stage")
        if self.sliding_window < 2:
            raise ModelLoadError("code2wav: sliding_window must be at least 2 (a frame and one before it)")

    @property
    def samples_per_frame(self) -> int:
        """Output samples per code frame: the product of every upsampling factor."""
        return math.prod(self.upsampling_ratios) * math.prod(self.upsample_rates)

    @property
    def leading_samples(self) -> int:
        """How many samples shorter than ``frames * samples_per_frame`` a decode is (555 at
        the released shape). Each vocoder stage's transposed conv (kernel ``2 * rate``) drops
        ``rate`` samples at both ends of its output where a causal one drops them at the end
        only; the start's cut, scaled by the stages after it, adds up to this."""
        lead = 0
        for rate in self.upsample_rates:
            lead = lead * rate + rate
        return lead

    @classmethod
    def qwen3_omni(cls) -> "Code2WavConfig":
        """The released Code2Wav's sizes (for random-weight speed runs)."""
        return cls()

    @classmethod
    def tiny(cls) -> "Code2WavConfig":
        """A small decoder with the real upsampling (1920 samples a frame) for tests."""
        return cls(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=16, decoder_dim=64)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, source: str = "code2wav_config") -> "Code2WavConfig":
        """From a ``code2wav_config`` mapping; keys this decoder does not read are ignored."""
        known = {f.name for f in fields(cls)} - {"head_dim", "rope_theta", "sample_rate"}
        values: dict[str, Any] = {k: v for k, v in raw.items() if k in known}
        for key in ("upsampling_ratios", "upsample_rates"):
            if key in values:
                values[key] = tuple(int(x) for x in values[key])
        try:
            heads = int(raw.get("num_attention_heads", cls.num_attention_heads))
            hidden = int(raw.get("hidden_size", cls.hidden_size))
            values["head_dim"] = int(raw.get("head_dim") or hidden // heads)
            values["rope_theta"] = _rope_theta(raw, source)
            return cls(**values)
        except (TypeError, ValueError, ZeroDivisionError) as exc:
            raise ModelLoadError(f"{source}: malformed code2wav_config ({exc})") from None

    @classmethod
    def from_folder(cls, folder: str | Path) -> "Code2WavConfig":
        """From a Qwen3-Omni folder's ``config.json`` (its ``code2wav_config``)."""
        raw, path = read_folder_json(folder, "config.json", "a Qwen3-Omni checkpoint folder holds one")
        if ARCHITECTURE not in (raw.get("architectures") or []) and raw.get("model_type") != "qwen3_omni_moe":
            raise ModelLoadError(f"{path}: not a Qwen3-Omni checkpoint ({ARCHITECTURE})")
        if not isinstance(raw.get("code2wav_config"), Mapping):
            raise ModelLoadError(f"{path}: a Qwen3-Omni config needs 'code2wav_config' to make audio")
        return cls.from_dict(raw["code2wav_config"], source=str(path))


def _rope_theta(raw: Mapping[str, Any], source: str) -> float:
    """``rope_parameters.rope_theta`` (transformers 5) or ``rope_theta`` (older files); only
    plain RoPE is read."""
    rope = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), Mapping) else {}
    kind = rope.get("rope_type", "default")
    if kind != "default":
        raise ModelLoadError(f"{source}: code2wav rope_type {kind!r} is not supported (only 'default')")
    return float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
