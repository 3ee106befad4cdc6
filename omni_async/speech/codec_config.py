"""The speech-tokenizer decoder's shape, read from ``speech_tokenizer/config.json``.

Only the decoder half of the 12 Hz speech tokenizer is described here: the encoder (used to
clone a voice from audio) is never run when the codes come from the talker.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError

TOKENIZER_MODEL_TYPE = "qwen3_tts_tokenizer_12hz"


@dataclass(frozen=True)
class CodecConfig:
    """The ``decoder_config`` fields of a 12 Hz speech tokenizer, plus its output rate.

    Defaults are the released decoder's sizes as published weight listings show them
    (codebook vectors of 256, transformer width 512 with 16 heads of 64, latent 1024,
    vocoder width 1536); ``qwen3_tts_12hz()`` names them for speed runs at the real size.
    """

    codebook_size: int = 2048
    codebook_dim: int = 512
    hidden_size: int = 512
    latent_dim: int = 1024
    intermediate_size: int = 1024
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
            raise ModelLoadError(f"speech tokenizer: hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.num_quantizers < 2:
            raise ModelLoadError("speech tokenizer: num_quantizers must be at least 2 (one semantic, the rest acoustic)")
        if self.codebook_dim % 2:
            raise ModelLoadError(f"speech tokenizer: codebook_dim {self.codebook_dim} must be even")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError("speech tokenizer: num_attention_heads must be a multiple of num_key_value_heads")
        if self.decoder_dim % 2 ** len(self.upsample_rates):
            raise ModelLoadError("speech tokenizer: decoder_dim must halve cleanly at every vocoder stage")
        if self.sliding_window < 2:
            raise ModelLoadError("speech tokenizer: sliding_window must be at least 2 (a frame and one before it)")

    @property
    def samples_per_frame(self) -> int:
        """Output samples per code frame: the product of every upsampling factor."""
        return math.prod(self.upsampling_ratios) * math.prod(self.upsample_rates)

    @classmethod
    def qwen3_tts_12hz(cls) -> "CodecConfig":
        """The released decoder's sizes (for random-weight speed runs)."""
        return cls()

    @classmethod
    def tiny(cls) -> "CodecConfig":
        """A small decoder with the real upsampling (1920 samples a frame) for tests."""
        return cls(codebook_dim=32, hidden_size=32, latent_dim=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=16, decoder_dim=64)

    @classmethod
    def from_dict(cls, decoder: dict[str, Any], *, sample_rate: int = 24000) -> "CodecConfig":
        """From a ``decoder_config`` mapping; keys this decoder does not read are ignored."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in decoder.items() if k in known}
        for key in ("upsampling_ratios", "upsample_rates"):
            if key in values:
                values[key] = tuple(int(x) for x in values[key])
        if "head_dim" not in decoder and "hidden_size" in decoder and "num_attention_heads" in decoder:
            values["head_dim"] = int(decoder["hidden_size"]) // int(decoder["num_attention_heads"])
        if "num_key_value_heads" not in decoder and "num_attention_heads" in decoder:
            values["num_key_value_heads"] = int(decoder["num_attention_heads"])
        try:
            return cls(**values, sample_rate=int(sample_rate))
        except TypeError as exc:
            raise ModelLoadError(f"speech tokenizer: bad decoder_config: {exc}") from exc

    @classmethod
    def from_folder(cls, folder: str | Path) -> "CodecConfig":
        """From ``speech_tokenizer/config.json`` (the folder holding it)."""
        path = Path(folder) / "config.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"speech tokenizer: cannot read {path}: {exc}") from exc
        if raw.get("model_type") != TOKENIZER_MODEL_TYPE:
            raise ModelLoadError(
                f"speech tokenizer: {path} has model_type {raw.get('model_type')!r}; only "
                f"{TOKENIZER_MODEL_TYPE!r} (the 12 Hz tokenizer) is supported")
        config = cls.from_dict(raw.get("decoder_config") or {}, sample_rate=raw.get("output_sample_rate", 24000))
        upsample = raw.get("decode_upsample_rate")
        if upsample is not None and int(upsample) != config.samples_per_frame:
            raise ModelLoadError(
                f"speech tokenizer: decode_upsample_rate {upsample} differs from the decoder's upsampling "
                f"product {config.samples_per_frame}")
        return config
