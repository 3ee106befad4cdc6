"""Speech out: Qwen3-TTS 12 Hz (talker, code predictor, codec) on the native stage.

``SpeechPipeline.from_pretrained(path_or_name, device=..., loop=...)`` loads a checkpoint
folder in the ``qwen-tts`` layout (or a built-in random model: ``"tiny"``, ``"0.6b"``,
``"1.7b"``); ``synthesize`` returns a :class:`SpeechResult`, ``stream`` yields
:class:`AudioChunk` s as the codec decodes them. ``OmniPipeline.from_pretrained(folder)``
runs a Qwen3-Omni folder's thinker, talker and Code2Wav: ``chat`` returns an
:class:`OmniResult` (text and audio), ``stream`` yields :class:`OmniDelta` s. See
docs/speech.md.

The names below are imported when first used (PEP 562's module ``__getattr__``), as the
root package's are: the command line reads :mod:`.names` to build its parser, and that
must not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .codec_stage import AudioChunk
    from .omni_pipeline import OmniDelta, OmniPipeline, OmniResult
    from .params import SpeechParams
    from .pipeline import SpeechPipeline, SpeechResult
    from .schedule import SpeechSchedule

# Each public name and the module that defines it.
_MODULE_OF = {
    "AudioChunk": ".codec_stage",
    "OmniPipeline": ".omni_pipeline",
    "OmniResult": ".omni_pipeline",
    "OmniDelta": ".omni_pipeline",
    "SpeechParams": ".params",
    "SpeechPipeline": ".pipeline",
    "SpeechResult": ".pipeline",
    "SpeechSchedule": ".schedule",
}

__all__ = ["SpeechPipeline", "SpeechParams", "SpeechResult", "SpeechSchedule", "AudioChunk", "OmniPipeline", "OmniResult", "OmniDelta"]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use and keep the name here."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
