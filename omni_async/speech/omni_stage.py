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

A streamed request (``streamed=True``: the thinker's reply still being written) carries no
trailing rows: they come as the request's stream chunks (rows ``[n, H]`` on the talker's
device, :func:`send_text_rows`), ``T(tts_eos)`` the last of them, and its stream's end
(:func:`end_text_rows`) closes them. The stage's request builder gives such a request a
``conditioning`` starting at its first frame input, so the batch core runs frame ``k``
only once row ``k`` arrived or the rows are closed: the codes do not depend on when the
rows come.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import anyio
import torch

from ..config import SamplingParams
from ..core.conditioning import StepConditioning
from ..engine import Engine
from ..errors import InvalidRequestError
from ..messages import IncomingMessage
from ..stage.weak import weak_method
from .omni_runner import TRAILING_KEY, OmniTalkerRunner
from .omni_config import OmniTalkerConfig
from .omni_talker import OmniTalker, TalkerPrompt, load_omni_talker, random_omni_talker
from .runner import PREDICTOR_KEY, predictor_settings
from .stage import SpeechStage, build_talker_stage

__all__ = ["build_omni_talker_stage", "talker_request", "frames_of", "send_text_rows", "end_text_rows"]

# The request metadata key marking a streamed request (its trailing rows come as chunks).
STREAMED_KEY = "omni_streamed_text"


def build_omni_talker_stage(source: str | Path | OmniTalkerConfig, *, device: str = "cpu", loop: str = "overlap",
                            dtype: Any = None, seed: int = 0, **limits: Any) -> SpeechStage:
    """The talker of a Qwen3-Omni folder (or, given a config, random weights drawn on the
    device from ``seed``: speed runs) on its own stage (``limits``: SchedulerConfig
    fields). ``stage.engine`` serves :func:`talker_request` s."""
    if isinstance(source, OmniTalkerConfig):
        cfg = source

        def load_random(dev: torch.device) -> tuple[OmniTalker, None, Path | None]:
            return random_omni_talker(cfg, device=dev, dtype=dtype, seed=seed), None, None

        name, load = RANDOM_NAME, load_random
    else:
        folder = Path(source)

        def load_folder(dev: torch.device) -> tuple[OmniTalker, None, Path | None]:
            return load_omni_talker(folder, device=dev, dtype=dtype), None, folder

        name, load = str(folder), load_folder
    callbacks, bind = _streamed_text_callbacks()
    stage = build_talker_stage(name, load, OmniTalkerRunner, device=device, loop=loop, dtype=dtype, seed=seed, callbacks=callbacks,
                               **limits)
    bind(stage.engine.scheduler, stage.model.config.talker.hidden_size)
    return stage


def _streamed_text_callbacks() -> tuple[dict[str, Any], Callable[[Any, int], None]]:
    """The stage's callbacks for streamed requests (the module's docstring), and ``bind``
    to call with the built stage's scheduler (held weakly) and the talker's width."""
    bound: dict[str, Any] = {}

    def build(payload: Any) -> Any:
        data = bound["default"](payload)
        if (getattr(payload, "metadata", None) or {}).get(STREAMED_KEY):
            data.req.conditioning = StepConditioning(start=len(data.req.prompt_ids))
        return data

    def on_chunk(data: Any, rows: Any) -> None:
        cond = data.req.conditioning
        if cond is None:
            raise InvalidRequestError("this talker request took its text rows at submission: "
                                      "send rows as it speaks only to a request made with streamed=True")
        if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape[1] != bound["width"]:
            raise InvalidRequestError(f"the talker's text rows are [n, {bound['width']}] tensors, got "
                                      f"{tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__}")
        cond.add(rows)

    def on_done(data: Any) -> None:
        data.stream_done = True
        if data.req.conditioning is not None:
            data.req.conditioning.close()

    def bind(scheduler: Any, width: int) -> None:
        bound["default"] = weak_method(scheduler.door.build_default)
        bound["width"] = width

    return {"request_builder": build, "stream_chunk_handler": on_chunk, "stream_done_handler": on_done}, bind


# The name a random-weight talker's stage goes by (no folder behind it).
RANDOM_NAME = "omni-talker-random"


def talker_request(talker: OmniTalker, prompt: TalkerPrompt, *, max_frames: int, repetition_penalty: float = 1.05,
                   streamed: bool = False) -> dict[str, Any]:
    """``engine.submit`` 's keyword arguments for one greedy request of up to
    ``max_frames`` frames. ``streamed``: its trailing rows (``prompt.trailing`` and those
    after) are sent as it speaks (:func:`send_text_rows`, :func:`end_text_rows`), not held
    in the request."""
    if max_frames < 1:
        raise InvalidRequestError(f"max_frames must be at least 1, got {max_frames}")
    sampling = SamplingParams(max_new_tokens=max_frames + 1, temperature=0.0, repetition_penalty=repetition_penalty,
                              suppress_tokens=talker.config.suppressed_codec_ids(), return_hidden_states=True)
    metadata: dict[str, Any] = {PREDICTOR_KEY: predictor_settings(0.0, 0, 1.0)}
    metadata.update({STREAMED_KEY: True} if streamed else {TRAILING_KEY: prompt.trailing})
    return {"input_embeds": prompt.prefill, "sampling": sampling, "metadata": metadata}


def send_text_rows(engine: Engine, request_id: str, rows: torch.Tensor) -> None:
    """A streamed request's next trailing rows ``[n, H]`` (projected, on the talker's
    device), in order; they may arrive before the request is admitted."""
    if rows.shape[0]:
        _send(engine, IncomingMessage(request_id, "stream_chunk", rows))


def end_text_rows(engine: Engine, request_id: str) -> None:
    """No more trailing rows for a streamed request: its frames past them add ``T(tts_pad)``."""
    _send(engine, IncomingMessage(request_id, "stream_done"))


def _send(engine: Engine, msg: IncomingMessage) -> None:
    try:
        engine.scheduler.inbox.send_nowait(msg)  # the inbox is unbounded
    except (anyio.ClosedResourceError, anyio.BrokenResourceError):
        pass  # the stage closed: the request has ended with its error already


def frames_of(hidden_states: torch.Tensor) -> torch.Tensor:
    """A finished request's frames ``[frames, groups]`` (long, CPU) from its hidden-state
    rows: the first row is its prefill's."""
    return hidden_states[1:].to("cpu").long()
