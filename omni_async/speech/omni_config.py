"""The talker side of a Qwen3-Omni checkpoint's configuration
(``Qwen3OmniMoeForConditionalGeneration``: thinker, talker, code predictor and code2wav
in one ``config.json``), read once here.

Why a config of its own rather than :class:`~omni_async.speech.config.TTSConfig`: the
Qwen3-Omni talker is a mixture-of-experts decoder (every layer sparse, with a shared
expert gated per token), its input is built from the thinker's rows (the thinker's input
embeddings and, for audio/image/video positions, its rows at ``accept_hidden_layer``)
through two projections, and its special ids sit in three places of the file (the codec's
in ``talker_config``, the text side's at the top, the multimodal ones in
``thinker_config``). The code predictor is the Qwen3-TTS one's shape
(:class:`~omni_async.speech.config.PredictorConfig`) without the width projection.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from ..errors import InvalidRequestError, ModelLoadError
from ..models.config import ModelConfig, read_folder_json
from .config import PredictorConfig

__all__ = ["OmniTalkerConfig", "speaks"]

ARCHITECTURE = "Qwen3OmniMoeForConditionalGeneration"


def speaks(path_or_name: str | Path) -> bool:
    """Whether ``path_or_name`` is a Qwen3-Omni folder that speaks: its config.json names
    the architecture (or ``model_type`` ``qwen3_omni_moe``) with a talker and a Code2Wav,
    and does not turn audio output off (``enable_audio_output``)."""
    path = Path(str(path_or_name)) / "config.json"
    if not path.is_file():
        return False
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    omni = ARCHITECTURE in (raw.get("architectures") or []) or raw.get("model_type") == "qwen3_omni_moe"
    return bool(omni and raw.get("talker_config") and raw.get("code2wav_config") and raw.get("enable_audio_output", True))


@dataclass(frozen=True)
class OmniTalkerConfig:
    """Everything the Qwen3-Omni talker needs to know about its checkpoint."""

    talker: ModelConfig  # the MoE decoder: vocabulary = the codec's (codebook 0 and control ids)
    predictor: PredictorConfig
    thinker_hidden_size: int
    projection_size: int  # the inner width of text_projection / hidden_projection
    accept_hidden_layer: int  # the thinker layer whose rows feed multimodal positions
    codec_eos_id: int
    codec_pad_id: int
    codec_bos_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    tts_bos_token_id: int
    tts_eos_token_id: int
    tts_pad_token_id: int
    im_start_token_id: int
    user_token_id: int
    assistant_token_id: int
    multimodal_token_ids: tuple[int, ...]  # the thinker's audio, image and video placeholders
    speakers: Mapping[str, int] = field(default_factory=dict)  # lower-case name -> codec id

    @property
    def num_code_groups(self) -> int:
        return self.predictor.num_code_groups

    def suppressed_codec_ids(self) -> list[int]:
        """Ids the talker never writes: the top 1024 of its vocabulary (control ids) but
        the codec EOS, as the reference's ``generate`` suppresses them."""
        vocab = self.talker.vocab_size
        return [i for i in range(max(0, vocab - 1024), vocab) if i != self.codec_eos_id]

    def speaker_id(self, name: str) -> int:
        """The codec id of voice ``name`` (case-insensitive); an InvalidRequestError
        naming the voices there are."""
        sid = self.speakers.get(name.lower())
        if sid is None:
            raise InvalidRequestError(f"unknown speaker {name!r}; this checkpoint has {sorted(self.speakers) or 'none'}")
        return sid

    @classmethod
    def from_folder(cls, folder: str | Path) -> "OmniTalkerConfig":
        raw, path = read_folder_json(folder, "config.json", "a Qwen3-Omni checkpoint folder holds one")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, source: str = "config") -> "OmniTalkerConfig":
        if ARCHITECTURE not in (raw.get("architectures") or []) and raw.get("model_type") != "qwen3_omni_moe":
            raise ModelLoadError(f"{source}: not a Qwen3-Omni checkpoint ({ARCHITECTURE})")
        try:
            t, thinker = raw["talker_config"], raw["thinker_config"]
            return cls(
                talker=_talker_decoder(t["text_config"], raw, source),
                predictor=_predictor(t["code_predictor_config"], t),
                thinker_hidden_size=int(t["thinker_hidden_size"]),
                projection_size=int(t["text_config"]["intermediate_size"]),
                accept_hidden_layer=int(t["accept_hidden_layer"]),
                codec_eos_id=int(t["codec_eos_token_id"]), codec_pad_id=int(t["codec_pad_id"]),
                codec_bos_id=int(t["codec_bos_id"]), codec_nothink_id=int(t["codec_nothink_id"]),
                codec_think_bos_id=int(t["codec_think_bos_id"]), codec_think_eos_id=int(t["codec_think_eos_id"]),
                tts_bos_token_id=int(raw["tts_bos_token_id"]), tts_eos_token_id=int(raw["tts_eos_token_id"]),
                tts_pad_token_id=int(raw["tts_pad_token_id"]), im_start_token_id=int(raw["im_start_token_id"]),
                user_token_id=int(raw["user_token_id"]), assistant_token_id=int(raw["assistant_token_id"]),
                multimodal_token_ids=tuple(int(thinker[k]) for k in ("audio_token_id", "image_token_id", "video_token_id")
                                           if thinker.get(k) is not None),
                speakers={str(k).lower(): int(v) for k, v in (t.get("speaker_id") or {}).items()},
            )
        except KeyError as exc:
            raise ModelLoadError(f"{source}: a Qwen3-Omni config needs {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{source}: malformed Qwen3-Omni talker config ({exc})") from None


def _talker_decoder(text: Mapping[str, Any], raw: Mapping[str, Any], source: str) -> ModelConfig:
    """The talker as a Qwen3-MoE decoder. transformers builds every talker layer sparse
    with a shared expert whatever ``mlp_only_layers`` / ``decoder_sparse_step`` say, so
    they are overridden here. Its M-RoPE, with the three position rows equal on a talker's
    text-only positions, is plain RoPE (the thinker's decoder reads it the same way)."""
    cfg = ModelConfig.from_hf({**text, "model_type": "qwen3_moe", "architectures": None, "mlp_only_layers": [],
                               "decoder_sparse_step": 1})
    if cfg.moe is None or not cfg.moe.shared_intermediate_size:
        raise ModelLoadError(f"{source}: the talker needs routed experts and a shared expert "
                             "(num_experts, shared_expert_intermediate_size)")
    dtype = str(raw.get("torch_dtype") or raw.get("dtype") or cfg.dtype)
    return replace(cfg, eos_token_ids=(int(raw["talker_config"]["codec_eos_token_id"]),), dtype=dtype)


def _predictor(p: Mapping[str, Any], t: Mapping[str, Any]) -> PredictorConfig:
    rope = p.get("rope_parameters") if isinstance(p.get("rope_parameters"), Mapping) else {}
    return PredictorConfig(
        hidden_size=int(p["hidden_size"]), intermediate_size=int(p["intermediate_size"]),
        num_layers=int(p["num_hidden_layers"]), num_heads=int(p["num_attention_heads"]),
        num_kv_heads=int(p["num_key_value_heads"]),
        head_dim=int(p.get("head_dim") or p["hidden_size"] // p["num_attention_heads"]),
        vocab_size=int(p["vocab_size"]), rms_norm_eps=float(p.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", p.get("rope_theta", 10000.0))),
        num_code_groups=int(p.get("num_code_groups", t.get("num_code_groups", 16))),
    )
