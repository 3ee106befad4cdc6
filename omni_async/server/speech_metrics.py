"""Prometheus metrics of the speech server: the talker stage's gauges (running and
waiting requests, KV pages, read from ``scheduler.info()`` at scrape time, as the text
server's) and per-utterance figures: requests by finish reason, frames and seconds of
audio sent, time to first audio."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from .metrics import PREFIX, StageCollector

if TYPE_CHECKING:
    from ..speech import AudioChunk, SpeechPipeline

__all__ = ["SpeechMetrics", "Utterance"]

_FIRST_AUDIO_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.4, 0.6, 1.0, 2.0, 5.0, 10.0, 30.0)


class Utterance:
    """One request's figures, recorded as its chunks pass on the way to the client."""

    def __init__(self, metrics: "SpeechMetrics") -> None:
        self.metrics = metrics
        self.started = time.perf_counter()
        self.frames = 0
        self.samples = 0
        self.first_audio: float | None = None
        self.reason: str | None = None  # the utterance's finish reason, once its last chunk passed
        self.done = False

    def chunk(self, chunk: "AudioChunk") -> None:
        if self.first_audio is None and len(chunk.audio):
            self.first_audio = time.perf_counter() - self.started
            self.metrics.first_audio.labels(self.metrics.model).observe(self.first_audio)
        self.frames += int(chunk.codes.shape[0])
        self.samples += len(chunk.audio)
        self.metrics.frames.labels(self.metrics.model).inc(int(chunk.codes.shape[0]))
        self.metrics.audio_seconds.labels(self.metrics.model).inc(len(chunk.audio) / chunk.sample_rate)
        if chunk.finished:
            self.reason = chunk.finish_reason or "stop"

    def finish(self, reason: str | None = None) -> None:
        """Counted once, by ``reason`` if given ("error", "abort"), else by how the
        utterance ended ("stop", "length"), else "abort" (it did not end: the client left)."""
        if not self.done:
            self.done = True
            self.metrics.requests.labels(self.metrics.model, reason or self.reason or "abort").inc()


class SpeechMetrics:
    def __init__(self, pipeline: "SpeechPipeline", model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        self.registry.register(StageCollector(pipeline.engine))
        self.requests = Counter(f"{PREFIX}_speech_requests", "Speech requests ended, by finish reason", ["model", "finish_reason"],
                                registry=self.registry)
        self.frames = Counter(f"{PREFIX}_speech_frames", "Codec frames sent (80 ms each)", ["model"], registry=self.registry)
        self.audio_seconds = Counter(f"{PREFIX}_speech_audio_seconds", "Seconds of audio sent", ["model"], registry=self.registry)
        self.first_audio = Histogram(f"{PREFIX}_speech_time_to_first_audio_seconds", "Request to its first audio chunk", ["model"],
                                     buckets=_FIRST_AUDIO_BUCKETS, registry=self.registry)

    def utterance(self) -> Utterance:
        return Utterance(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)
