"""Speech out: Qwen3-TTS 12 Hz (talker, code predictor, codec) on the native stage.

``SpeechPipeline.from_pretrained(path_or_name, device=..., loop=...)`` loads a checkpoint
folder in the ``qwen-tts`` layout (or a built-in random model: ``"tiny"``, ``"0.6b"``,
``"1.7b"``); ``synthesize`` returns a :class:`SpeechResult`, ``stream`` yields
:class:`AudioChunk` s as the codec decodes them. See docs/speech.md.
"""

from .codec_stage import AudioChunk
from .params import SpeechParams
from .pipeline import SpeechPipeline, SpeechResult

__all__ = ["SpeechPipeline", "SpeechParams", "SpeechResult", "AudioChunk"]
