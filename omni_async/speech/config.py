"""A Qwen3-TTS 12 Hz checkpoint's configuration, read once from the folder's ``config.json``
and ``generation_config.json`` (the ``qwen-tts`` package's layout), or built for a
random-weight model at a named size.

Why a config of our own: the talker is a Qwen3 decoder that our native decoder runs as it
is (:class:`~omni_async.models.config.ModelConfig`), but around it sit parts no text
checkpoint has: a text embedding with its projection, a code predictor, the codec's
special ids, speakers and languages. They are read here, in one place, and everything
else reads this.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..errors import ModelLoadError
from ..models.config import ModelConfig, read_folder_json

__all__ = ["PredictorConfig", "TTSConfig", "SpeechDefaults", "FRAME_RATE", "named_config"]

# The 12 Hz codec: 12.5 frames a second, each frame 80 ms of audio.
FRAME_RATE = 12.5


@dataclass(frozen=True)
class PredictorConfig:
    """The code predictor: a small Qwen3 decoder, autoregressive over a frame's residual
    codebooks (``num_code_groups - 1`` of them), restarting at position 0 every frame."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    num_code_groups: int = 16


@dataclass(frozen=True)
class SpeechDefaults:
    """Sampling defaults of the checkpoint's generation config (the release's values when
    the file is absent): the talker's (codebook 0) and the predictor's (the rest)."""

    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    do_sample: bool = True
    predictor_temperature: float = 0.9
    predictor_top_k: int = 50
    predictor_top_p: float = 1.0
    predictor_do_sample: bool = True
    max_new_tokens: int = 8192

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "SpeechDefaults":
        d = cls()
        return cls(
            temperature=float(raw.get("temperature", d.temperature)),
            top_k=int(raw.get("top_k", d.top_k)),
            top_p=float(raw.get("top_p", d.top_p)),
            repetition_penalty=float(raw.get("repetition_penalty", d.repetition_penalty)),
            do_sample=bool(raw.get("do_sample", d.do_sample)),
            predictor_temperature=float(raw.get("subtalker_temperature", d.predictor_temperature)),
            predictor_top_k=int(raw.get("subtalker_top_k", d.predictor_top_k)),
            predictor_top_p=float(raw.get("subtalker_top_p", d.predictor_top_p)),
            predictor_do_sample=bool(raw.get("subtalker_dosample", d.predictor_do_sample)),
            max_new_tokens=int(raw.get("max_new_tokens", d.max_new_tokens)),
        )


@dataclass(frozen=True)
class TTSConfig:
    """Everything the speech stage needs to know about a checkpoint."""

    talker: ModelConfig  # the talker decoder: vocabulary = the codec's 3072 ids
    predictor: PredictorConfig
    text_vocab_size: int
    text_hidden_size: int
    # Text-side special tokens (the prompt's pad / begin / end rows).
    tts_pad_token_id: int
    tts_bos_token_id: int
    tts_eos_token_id: int
    # Codec-side special ids (rows of the talker's codec embedding).
    codec_pad_id: int
    codec_bos_id: int
    codec_eos_id: int
    codec_think_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    speakers: Mapping[str, int] = field(default_factory=dict)  # name (lower case) -> codec id
    speaker_dialects: Mapping[str, str | None] = field(default_factory=dict)  # name -> dialect language or None
    languages: Mapping[str, int] = field(default_factory=dict)  # name (lower case) -> codec id
    model_type: str = "custom_voice"
    model_size: str = "0b6"
    defaults: SpeechDefaults = SpeechDefaults()
    transformers_version: str | None = None  # of config.json: decides the tokenizer's regex

    @property
    def num_code_groups(self) -> int:
        return self.predictor.num_code_groups

    @property
    def codebook_size(self) -> int:
        return self.predictor.vocab_size

    def suppressed_codec_ids(self) -> list[int]:
        """Ids the talker never samples: the top 1024 of its vocabulary (control ids),
        except the codec EOS, as the reference's suppression does."""
        vocab = self.talker.vocab_size
        return [i for i in range(vocab - 1024, vocab) if i != self.codec_eos_id]

    @classmethod
    def from_folder(cls, folder: str | Path) -> "TTSConfig":
        folder = Path(folder)
        raw, path = read_folder_json(folder, "config.json", "a Qwen3-TTS checkpoint folder holds one")
        gen_path = folder / "generation_config.json"
        gen = json.loads(gen_path.read_text(encoding="utf-8")) if gen_path.is_file() else {}
        return cls.from_dict(raw, gen, source=str(path))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], generation: Mapping[str, Any] | None = None, *, source: str = "config") -> "TTSConfig":
        if raw.get("model_type") not in (None, "qwen3_tts"):
            raise ModelLoadError(f"{source}: model_type {raw.get('model_type')!r} is not a Qwen3-TTS checkpoint ('qwen3_tts')")
        if raw.get("tokenizer_type", "qwen3_tts_tokenizer_12hz") != "qwen3_tts_tokenizer_12hz":
            raise ModelLoadError(f"{source}: tokenizer_type {raw.get('tokenizer_type')!r}: only the 12 Hz codec is supported")
        try:
            t = raw["talker_config"]
            p = t["code_predictor_config"]
            talker = ModelConfig(
                family="qwen3", vocab_size=int(t["vocab_size"]), hidden_size=int(t["hidden_size"]),
                intermediate_size=int(t["intermediate_size"]), num_layers=int(t["num_hidden_layers"]),
                num_heads=int(t["num_attention_heads"]), num_kv_heads=int(t["num_key_value_heads"]),
                head_dim=int(t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]),
                rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)), rope_theta=float(t.get("rope_theta", 1e6)),
                # M-RoPE with three equal position rows is plain rotate-half RoPE: the talker's
                # positions are the same in every section.
                rope_scaling=None, max_position_embeddings=int(t.get("max_position_embeddings", 32768)),
                qk_norm=True, qkv_bias=bool(t.get("attention_bias", False)), o_bias=bool(t.get("attention_bias", False)),
                eos_token_ids=(int(t["codec_eos_token_id"]),), dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            )
            predictor = PredictorConfig(
                hidden_size=int(p["hidden_size"]), intermediate_size=int(p["intermediate_size"]),
                num_layers=int(p["num_hidden_layers"]), num_heads=int(p["num_attention_heads"]),
                num_kv_heads=int(p["num_key_value_heads"]),
                head_dim=int(p.get("head_dim") or p["hidden_size"] // p["num_attention_heads"]),
                vocab_size=int(p["vocab_size"]), rms_norm_eps=float(p.get("rms_norm_eps", 1e-6)),
                rope_theta=float(p.get("rope_theta", 1e6)), num_code_groups=int(p.get("num_code_groups", t.get("num_code_groups", 16))),
            )
            dialects = {str(k).lower(): (v if isinstance(v, str) and v else None) for k, v in (t.get("spk_is_dialect") or {}).items()}
            return cls(
                talker=talker, predictor=predictor,
                text_vocab_size=int(t["text_vocab_size"]), text_hidden_size=int(t["text_hidden_size"]),
                tts_pad_token_id=int(raw["tts_pad_token_id"]), tts_bos_token_id=int(raw["tts_bos_token_id"]),
                tts_eos_token_id=int(raw["tts_eos_token_id"]),
                codec_pad_id=int(t["codec_pad_id"]), codec_bos_id=int(t["codec_bos_id"]), codec_eos_id=int(t["codec_eos_token_id"]),
                codec_think_id=int(t["codec_think_id"]), codec_nothink_id=int(t["codec_nothink_id"]),
                codec_think_bos_id=int(t["codec_think_bos_id"]), codec_think_eos_id=int(t["codec_think_eos_id"]),
                speakers={str(k).lower(): int(v) for k, v in (t.get("spk_id") or {}).items()},
                speaker_dialects=dialects,
                languages={str(k).lower(): int(v) for k, v in (t.get("codec_language_id") or {}).items()},
                model_type=str(raw.get("tts_model_type", "custom_voice")), model_size=str(raw.get("tts_model_size", "0b6")),
                defaults=SpeechDefaults.from_dict(generation or {}),
                transformers_version=raw.get("transformers_version"),
            )
        except KeyError as exc:
            raise ModelLoadError(f"{source}: a Qwen3-TTS config needs {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{source}: malformed Qwen3-TTS config ({exc})") from None


# Codec ids shared by every released 12 Hz checkpoint (and the sizes' public configs).
_CODEC_IDS = dict(codec_pad_id=2148, codec_bos_id=2149, codec_eos_id=2150, codec_think_id=2154, codec_nothink_id=2155,
                  codec_think_bos_id=2156, codec_think_eos_id=2157)
_LANGUAGES = {"chinese": 2055, "english": 2050, "german": 2053, "italian": 2070, "portuguese": 2071, "spanish": 2054,
              "japanese": 2058, "korean": 2064, "french": 2061, "russian": 2069}
_SPEAKERS = {"ryan": 3061, "vivian": 3065, "serena": 3066, "aiden": 2861, "eric": 2875, "dylan": 2878, "uncle_fu": 3010,
             "ono_anna": 2873, "sohee": 2864}


def named_config(size: str) -> TTSConfig:
    """The shapes of a released size (``"0.6b"``, ``"1.7b"``) for random-weight speed runs, or
    ``"tiny"`` (a few MB: tests and the CPU demo). Text-side special ids follow the
    released vocabulary; ``tiny`` has a byte-level text vocabulary of its own."""
    pred_real = PredictorConfig(hidden_size=1024, intermediate_size=3072, num_layers=5, num_heads=16, num_kv_heads=8,
                                head_dim=128, vocab_size=2048)
    if size == "tiny":
        talker = ModelConfig(family="qwen3", vocab_size=3072, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=32, rope_theta=1e6, max_position_embeddings=4096, qk_norm=True,
                             eos_token_ids=(2150,), dtype="float32")
        predictor = PredictorConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                                    vocab_size=2048)
        text = dict(text_vocab_size=260, text_hidden_size=48, tts_pad_token_id=257, tts_bos_token_id=258, tts_eos_token_id=259)
    elif size in ("0.6b", "1.7b"):
        hidden, inter = (1024, 3072) if size == "0.6b" else (2048, 6144)
        talker = ModelConfig(family="qwen3", vocab_size=3072, hidden_size=hidden, intermediate_size=inter, num_layers=28,
                             num_heads=16, num_kv_heads=8, head_dim=128, rope_theta=1e6, max_position_embeddings=32768,
                             qk_norm=True, eos_token_ids=(2150,), dtype="bfloat16")
        predictor = pred_real
        text = dict(text_vocab_size=151936, text_hidden_size=2048, tts_pad_token_id=151671, tts_bos_token_id=151672,
                    tts_eos_token_id=151673)
    else:
        raise ModelLoadError(f"unknown speech model name {size!r}: a Qwen3-TTS folder, 'tiny', '0.6b' or '1.7b'")
    return TTSConfig(talker=talker, predictor=predictor, speakers=dict(_SPEAKERS), languages=dict(_LANGUAGES),
                     speaker_dialects={"dylan": "beijing_dialect", "eric": "sichuan_dialect"},
                     model_size="0b6" if size != "1.7b" else "1b7", **text, **_CODEC_IDS)

