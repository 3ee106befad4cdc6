"""The Omni chat server's metrics: a spoken reply counted as what it is, a chat
completion and an utterance.

One registry (the text metrics', :class:`~.metrics.EngineMetrics`) holds:

- the thinker's figures of every chat request, as the text server records them: requests
  by finish reason, prompt and generated tokens, time to first token, inter-token
  latency, end-to-end latency, thinker step time; a spoken reply's text counted there as
  a text reply's is;
- each spoken reply's audio figures, by the speech server's rule and under its names
  (:class:`~.speech_metrics.SpeechMetrics`, :class:`~.speech_metrics.Utterance`): frames
  and seconds sent, time to first audio, real-time factor, worst gap and underruns, empty
  replies, codec chunk sizes, talker step and codec round times, streams in underrun;
- both stages' gauges at scrape time (running, waiting, KV pages, steps ...), each
  labelled ``stage="thinker"`` or ``stage="talker"``.

A structured log line per spoken reply (``omni_chat_response``) carries its TTFP, frames,
worst gap and underruns with its text tokens and time to first token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import errors
from .metrics import EngineMetrics, StageCollector, refused_status
from .speech_metrics import SpeechMetrics

if TYPE_CHECKING:
    from ..speech.omni_pipeline import OmniDelta, OmniPipeline

__all__ = ["OmniMetrics", "SpokenTally"]


class OmniMetrics:
    """The metrics of an Omni pipeline's server, in ``text``'s registry (``text`` is not
    attached to an engine: the stages are attached here, labelled)."""

    def __init__(self, text: EngineMetrics, pipeline: "OmniPipeline") -> None:
        self.text = text
        text.registry.register(StageCollector({"thinker": pipeline.thinker, "talker": pipeline.talker.engine}))
        pipeline.thinker.scheduler.add_step_observer(text.observe_step)
        self.speech = SpeechMetrics(text.model_name, pipeline.talker.engine, pipeline.codec, registry=text.registry)

    def reply(self, prompt_tokens: int) -> "SpokenTally":
        """The figures of one spoken reply to a prompt of ``prompt_tokens``, from now."""
        return SpokenTally(self, prompt_tokens)


class SpokenTally:
    """One spoken reply's figures, fed its events as they pass on the way to the client;
    ended once, by :meth:`finish` (the reply ended) or :meth:`fail` (an error, or the
    client left)."""

    def __init__(self, metrics: OmniMetrics, prompt_tokens: int) -> None:
        self.timer = metrics.text.timer()
        self.utterance = metrics.speech.utterance("omni_chat_response")
        self.prompt_tokens = prompt_tokens
        self.text_tokens = 0
        self.text_reason: str | None = None

    def on_event(self, delta: "OmniDelta") -> None:
        if delta.kind == "text":
            self.text_tokens += len(delta.token_ids)
            self.timer.on_tokens(len(delta.token_ids))
            if delta.finished:
                self.text_reason = delta.finish_reason
        elif delta.audio is not None:
            self.utterance.chunk(delta.audio)

    def _log_fields(self) -> dict[str, object]:
        first = self.timer.first_token_at
        return {"text_tokens": self.text_tokens, "text_finish_reason": self.text_reason,
                "ttft_s": None if first is None else round(first - self.timer.start, 4)}

    def finish(self) -> None:
        """The reply ended whole: its text counted by the thinker's finish reason, its
        audio by the talker's."""
        self.timer.ended(self.text_reason or "unknown", prompt_tokens=self.prompt_tokens, generated_tokens=self.text_tokens)
        self.utterance.finish(**self._log_fields())

    def fail(self, exc: BaseException | None) -> None:
        """The reply ended by ``exc`` (None: the client left). A refused request (400,
        429) is counted as refused only: no utterance began."""
        if self.timer.done:
            return
        self.timer.fail(exc)
        if refused_status(exc) is None:
            aborted = exc is None or isinstance(exc, errors.RequestAbortedError)
            self.utterance.finish("abort" if aborted else "error", **self._log_fields())
