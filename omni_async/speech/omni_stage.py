"""The Qwen3-Omni talker as a stage: the native stage with :class:`OmniTalkerRunner`
(a frame per decode step, each request's text rows per frame), and what a request to it
holds.

A request is its talker prompt (:func:`~omni_async.speech.omni_talker.talker_prompt`):
the prefill rows as ``input_embeds``, the trailing text rows in its metadata, and the
talker's sampling: codebook 0 greedy with the reference's repetition penalty, the control
ids suppressed, the codec EOS as the stop id (the stage's EOS), ``max_frames + 1`` tokens
(frame ``k`` travels with codebook 0 of frame ``k + 1``). The predictor is greedy. The
frames come back as the request's hidden-state rows, the first (its prefill's) a row of
-1: :func:`frames_of`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidRequestError
from ..config import SamplingParams
from .omni_runner import TRAILING_KEY, OmniTalkerRunner
from .omni_config import OmniTalkerConfig
from .omni_talker import OmniTalker, TalkerPrompt, load_omni_talker, random_omni_talker
from .runner import PREDICTOR_KEY, predictor_settings
from .stage import SpeechStage, build_talker_stage

__all__ = ["build_omni_talker_stage", "talker_request", "frames_of"]


def build_omni_talker_stage(source: str | Path | OmniTalkerConfig, *, device: str = "cpu", loop: str = "overlap",
                            dtype: Any = None, seed: int = 0, **limits: Any) -> SpeechStage:
    """The talker of a Qwen3-Omni folder (or, given a config, random weights drawn on the
    device from ``seed``: speed runs) on its own stage (``limits``: SchedulerConfig
    fields). ``stage.engine`` serves :func:`talker_request` s."""
    if isinstance(source, OmniTalkerConfig):
        cfg = source

        def load_random(dev: torch.device) -> tuple[OmniTalker, None, Path | None]:
            return random_omni_talker(cfg, device=dev, dtype=dtype, seed=seed), None, None

        return build_talker_stage(RANDOM_NAME, load_random, OmniTalkerRunner, device=device, loop=loop, dtype=dtype, seed=seed,
                                  **limits)
    folder = Path(source)

    def load_folder(dev: torch.device) -> tuple[OmniTalker, None, Path | None]:
        return load_omni_talker(folder, device=dev, dtype=dtype), None, folder

    return build_talker_stage(str(folder), load_folder, OmniTalkerRunner, device=device, loop=loop, dtype=dtype, seed=seed, **limits)


# The name a random-weight talker's stage goes by (no folder behind it).
RANDOM_NAME = "omni-talker-random"


def talker_request(talker: OmniTalker, prompt: TalkerPrompt, *, max_frames: int,
                   repetition_penalty: float = 1.05) -> dict[str, Any]:
    """``engine.submit`` 's keyword arguments for one greedy request of up to
    ``max_frames`` frames."""
    if max_frames < 1:
        raise InvalidRequestError(f"max_frames must be at least 1, got {max_frames}")
    sampling = SamplingParams(max_new_tokens=max_frames + 1, temperature=0.0, repetition_penalty=repetition_penalty,
                              suppress_tokens=talker.config.suppressed_codec_ids(), return_hidden_states=True)
    metadata = {PREDICTOR_KEY: predictor_settings(0.0, 0, 1.0), TRAILING_KEY: prompt.trailing}
    return {"input_embeds": prompt.prefill, "sampling": sampling, "metadata": metadata}


def frames_of(hidden_states: torch.Tensor) -> torch.Tensor:
    """A finished request's frames ``[frames, groups]`` (long, CPU) from its hidden-state
    rows: the first row is its prefill's."""
    return hidden_states[1:].to("cpu").long()
