"""Text to the talker's prefill rows, as the reference builds them.

The text is tokenised inside its template, ``<|im_start|>assistant\\n{text}<|im_end|>\\n
<|im_start|>assistant\\n``, as one string: ids ``[:3]`` are the role, ``[3:-5]`` the text,
and the fixed tail is never embedded. Rows (``T`` = projected text embedding, ``C`` =
the talker's codec embedding):

- ``T(role)`` (3 rows);
- the codec tags, each under ``T(tts_pad)``: think, think_bos, the language, think_eos
  (``Auto``: nothink, think_bos, think_eos), the speaker; then ``T(tts_bos) + C(pad)``;
- ``T(text_i) + C(pad)`` for each text token, then ``T(tts_eos) + C(pad)``;
- ``T(tts_pad) + C(bos)``.

The tokenizer's pre-tokenizer regex is the one the reference ends up with when it loads a
checkpoint from a local folder: transformers 4.57.3 replaces the Qwen2 split regex with
its "fixed Mistral" one when the vocabulary is over 100,000 entries and the folder's
config.json was written by no transformers or by one in (4.57.2, 5.0). The two regexes
split CamelCase words differently, so the same text gives other ids and other speech.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InvalidRequestError, ModelLoadError
from .config import TTSConfig
from .model import SpeechModel

__all__ = ["SpeechTokenizer", "ByteSpeechTokenizer", "prefill_rows", "resolve_voice"]

# The pattern transformers substitutes (see the module docstring).
PATCHED_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}"
    r"\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEMPLATE = "<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def regex_patched(transformers_version: str | None) -> bool:
    """Whether the reference's load path swaps the split regex (given a >100k vocabulary)."""
    if not transformers_version:
        return True
    v = _version(transformers_version)
    return (4, 57, 2) < v < (5, 0, 0)


class SpeechTokenizer:
    """A checkpoint's ``tokenizer.json``, split regex as the reference uses it."""

    def __init__(self, folder: str | Path, cfg: TTSConfig) -> None:
        import tokenizers

        path = Path(folder) / "tokenizer.json"
        try:
            spec = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ModelLoadError(f"{folder}: no tokenizer.json (the speech model's text tokenizer)") from None
        base_vocab = len(spec.get("model", {}).get("vocab", {}))
        pre = spec.get("pre_tokenizer") or {}
        if base_vocab > 100000 and regex_patched(cfg.transformers_version) and pre.get("type") == "Sequence" and pre["pretokenizers"]:
            pre["pretokenizers"][0] = {"type": "Split", "pattern": {"Regex": PATCHED_SPLIT}, "behavior": "Isolated", "invert": False}
        self._tok = tokenizers.Tokenizer.from_str(json.dumps(spec))

    def template_ids(self, text: str) -> list[int]:
        return self._tok.encode(TEMPLATE.format(text=text), add_special_tokens=True).ids


class ByteSpeechTokenizer:
    """The built-in tiny model's text side: UTF-8 bytes, and the template's three markers
    as single ids, so the reference's slicing holds."""

    IM_START, IM_END, ASSISTANT, NEWLINE = 256, 257, 258, 10

    def template_ids(self, text: str) -> list[int]:
        role = [self.IM_START, self.ASSISTANT, self.NEWLINE]
        return role + list(text.encode("utf-8")) + [self.IM_END, self.NEWLINE] + role


@dataclass(frozen=True)
class Voice:
    speaker_id: int | None
    language_id: int | None


def resolve_voice(cfg: TTSConfig, voice: str | None, language: str | None) -> Voice:
    """The codec ids of a speaker and language as the reference picks them (a dialect
    speaker speaking Chinese, or with ``Auto``, takes the dialect's id); a typed error
    naming what exists for an unknown one."""
    speaker_id = None
    if voice:
        key = voice.lower()
        if key not in cfg.speakers:
            raise InvalidRequestError(f"unknown voice {voice!r}; this model has: {', '.join(sorted(cfg.speakers)) or 'none'}")
        speaker_id = cfg.speakers[key]
    lang = (language or "auto").lower()
    if lang == "auto":
        language_id = None
    elif lang in cfg.languages:
        language_id = cfg.languages[lang]
    else:
        raise InvalidRequestError(f"unknown language {language!r}; this model has: auto, {', '.join(sorted(cfg.languages))}")
    if voice and lang in ("chinese", "auto"):
        dialect = cfg.speaker_dialects.get(voice.lower())
        if dialect and dialect in cfg.languages:
            language_id = cfg.languages[dialect]
    return Voice(speaker_id, language_id)


@torch.inference_mode()
def prefill_rows(model: SpeechModel, ids: list[int], voice: Voice) -> torch.Tensor:
    """The talker's prefill ``[len(ids) + 6 or so, H]`` for template ids ``ids``."""
    cfg = model.config
    if len(ids) < 9:
        raise InvalidRequestError("the text is empty: there is nothing to speak")
    role, text = ids[:3], ids[3:-5]
    if voice.language_id is None:
        tags = [cfg.codec_nothink_id, cfg.codec_think_bos_id, cfg.codec_think_eos_id]
    else:
        tags = [cfg.codec_think_id, cfg.codec_think_bos_id, voice.language_id, cfg.codec_think_eos_id]
    if voice.speaker_id is not None:
        tags.append(voice.speaker_id)
    specials = model.text_rows([cfg.tts_pad_token_id, cfg.tts_bos_token_id, cfg.tts_eos_token_id])
    pad, bos, eos = specials[0], specials[1], specials[2]
    codec = model.codec_rows(tags + [cfg.codec_pad_id, cfg.codec_bos_id])
    n_tags = len(tags)
    tag_rows = torch.cat((pad.expand(n_tags, -1), bos[None]), dim=0) + codec[: n_tags + 1]
    codec_pad, codec_bos = codec[n_tags], codec[n_tags + 1]
    text_rows = torch.cat((model.text_rows(text), eos[None]), dim=0) + codec_pad
    return torch.cat((model.text_rows(role), tag_rows, text_rows, (pad + codec_bos)[None]), dim=0)
