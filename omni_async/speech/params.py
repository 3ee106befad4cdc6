"""What a caller may ask of one utterance, and how it maps onto the talker's sampling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import SamplingParams
from ..errors import InvalidRequestError
from .config import TTSConfig
from .runner import PREDICTOR_KEY, predictor_settings

__all__ = ["SpeechParams"]


@dataclass(frozen=True)
class SpeechParams:
    """Sampling of one utterance. ``None`` takes the checkpoint's generation config.

    ``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``: the talker (codebook 0;
    the penalty over the codebook-0 ids written so far, as the reference applies it, in
    greedy mode too). ``predictor_*``: the code predictor (codebooks 1..15). A
    ``temperature`` of 0 is greedy for both, unless ``predictor_temperature`` says
    otherwise. ``max_frames``: at most that many frames (80 ms each); ``min_frames``: the
    codec EOS is not taken before. ``ignore_eos``: always ``max_frames``."""

    max_frames: int | None = None
    min_frames: int = 1
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    predictor_temperature: float | None = None
    predictor_top_k: int | None = None
    predictor_top_p: float | None = None
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_frames is not None and (not isinstance(self.max_frames, int) or isinstance(self.max_frames, bool) or self.max_frames < 1):
            raise InvalidRequestError(f"max_frames must be a positive int, got {self.max_frames!r}")
        if not isinstance(self.min_frames, int) or isinstance(self.min_frames, bool) or self.min_frames < 1:
            raise InvalidRequestError(f"min_frames must be an int >= 1, got {self.min_frames!r}")
        if self.max_frames is not None and self.min_frames > self.max_frames:
            raise InvalidRequestError(f"min_frames ({self.min_frames}) exceeds max_frames ({self.max_frames})")
        for name in ("temperature", "predictor_temperature"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0 or v == float("inf")):
                raise InvalidRequestError(f"{name} must be a finite number >= 0, got {v!r}")
        for name in ("top_k", "predictor_top_k"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise InvalidRequestError(f"{name} must be an int >= 0 (0 = off), got {v!r}")
        for name in ("top_p", "predictor_top_p"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 1):
                raise InvalidRequestError(f"{name} must be in (0, 1], got {v!r}")
        rp = self.repetition_penalty
        if rp is not None and (not isinstance(rp, (int, float)) or isinstance(rp, bool) or not 0 < rp < float("inf")):
            raise InvalidRequestError(f"repetition_penalty must be a finite number > 0, got {rp!r}")

    @classmethod
    def of(cls, value: "SpeechParams | dict[str, Any] | None") -> "SpeechParams":
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                raise InvalidRequestError(f"unknown SpeechParams field(s): {', '.join(unknown)}")
            return cls(**value)
        raise InvalidRequestError(f"params must be SpeechParams or a dict, got {type(value).__name__}")

    def resolve(self, cfg: TTSConfig, max_frames: int) -> tuple[SamplingParams, dict[str, Any]]:
        """The talker's SamplingParams and the request metadata carrying the predictor's
        settings, ``max_frames`` being the cap the caller did not lower."""
        d = cfg.defaults
        if self.temperature is not None:
            temperature = float(self.temperature)
        else:
            temperature = d.temperature if d.do_sample else 0.0
        if self.predictor_temperature is not None:
            p_temp = float(self.predictor_temperature)
        elif self.temperature == 0:
            p_temp = 0.0
        else:
            p_temp = d.predictor_temperature if d.predictor_do_sample else 0.0
        frames = self.max_frames if self.max_frames is not None else max_frames
        sampling = SamplingParams(
            max_new_tokens=frames + 1,  # frame k travels with codebook 0 of frame k + 1
            min_new_tokens=max(2, self.min_frames + 1),
            temperature=temperature,
            top_k=self.top_k if self.top_k is not None else d.top_k,
            top_p=self.top_p if self.top_p is not None else d.top_p,
            repetition_penalty=self.repetition_penalty if self.repetition_penalty is not None else d.repetition_penalty,
            suppress_tokens=cfg.suppressed_codec_ids(),
            ignore_eos=self.ignore_eos,
            seed=self.seed,
        )
        predictor = predictor_settings(p_temp, self.predictor_top_k if self.predictor_top_k is not None else d.predictor_top_k,
                                       self.predictor_top_p if self.predictor_top_p is not None else d.predictor_top_p)
        return sampling, {PREDICTOR_KEY: predictor}
