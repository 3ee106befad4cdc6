"""Prometheus audio metrics: the speech server's (a Qwen3-TTS pipeline: the talker stage's
gauges, running and waiting requests, KV pages, read from ``scheduler.info()`` at scrape
time, as the text server's, and the audio's own figures) and the Omni chat server's
spoken replies (the same audio figures, under the same names, beside the text server's:
:mod:`.omni_metrics`). What they read is a talker engine and a codec stage, and the
admission gate where there is one.

Per utterance, as its chunks pass on the way to the client: requests by finish reason,
frames and seconds of audio sent, time to first audio (TTFP), real-time factor (request
to last chunk over the audio's length), the worst silent gap a player that plays each
chunk from the first one's arrival would hear (0 for a stream that never ran dry) and
the number of such underruns, results with no audio, codec chunk sizes. Per stage: the
talker's step time and the codec's round time. At scrape time: streams whose listener is
out of audio now, streams playing, and (with a gate) requests waiting at the admission
gate and refusals by reason. A structured log line per utterance carries its TTFP,
frames and worst gap.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..logs import log
from ..speech.playback import Playback
from .metrics import PREFIX, StageCollector

if TYPE_CHECKING:
    from ..engine import Engine
    from ..speech import AudioChunk, SpeechPipeline
    from ..speech.admission import SpeechAdmission
    from ..speech.codec_stage import CodecStage

__all__ = ["SpeechMetrics", "Utterance"]

_FIRST_AUDIO_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.4, 0.6, 1.0, 2.0, 5.0, 10.0, 30.0)
_RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)
_GAP_BUCKETS = (0.0, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
_CHUNK_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class Utterance:
    """One request's figures, recorded as its chunks pass on the way to the client;
    ``log_event``: the name of its structured log line."""

    def __init__(self, metrics: "SpeechMetrics", log_event: str = "speech_response") -> None:
        self.metrics = metrics
        self.log_event = log_event
        self.started = time.perf_counter()
        self.frames = 0
        self.samples = 0
        self.first_audio: float | None = None
        self.player = Playback(created=self.started)  # the client's player, as the benchmark's
        self.reason: str | None = None  # the utterance's finish reason, once its last chunk passed
        self.done = False

    def chunk(self, chunk: "AudioChunk") -> None:
        m, model = self.metrics, self.metrics.model
        if self.first_audio is None and len(chunk.audio):
            self.first_audio = time.perf_counter() - self.started
            m.first_audio.labels(model).observe(self.first_audio)
        frames = int(chunk.codes.shape[0])
        self.frames += frames
        self.samples += len(chunk.audio)
        self.player.on_audio(chunk.seconds)
        if frames:
            m.chunk_frames.labels(model).observe(frames)
        m.frames.labels(model).inc(frames)
        m.audio_seconds.labels(model).inc(len(chunk.audio) / chunk.sample_rate)
        if chunk.finished:
            self.reason = chunk.finish_reason or "stop"

    def finish(self, reason: str | None = None, **log_fields: Any) -> None:
        """Counted once, by ``reason`` if given ("error", "abort"), else by how the
        utterance ended ("stop", "length"), else "abort" (it did not end: the client left).
        ``log_fields``: more of the request's figures for its log line."""
        if self.done:
            return
        self.done = True
        m, model = self.metrics, self.metrics.model
        why = reason or self.reason or "abort"
        m.requests.labels(model, why).inc()
        audio_s = self.player.sent_s
        if why in ("stop", "length"):
            if audio_s > 0:
                m.rtf.labels(model).observe((time.perf_counter() - self.started) / audio_s)
                m.worst_gap.labels(model).observe(self.player.worst_gap_s)
            else:
                m.empty_audio.labels(model).inc()
        m.underruns.labels(model).inc(self.player.underruns)
        log.info(self.log_event, finish_reason=why, ttfp_s=None if self.first_audio is None else round(self.first_audio, 4),
                 frames=self.frames, audio_s=round(audio_s, 3), worst_gap_s=round(self.player.worst_gap_s, 4),
                 underruns=self.player.underruns, **log_fields)


class PlaybackCollector:
    """Read at scrape time from the codec stage: streams in underrun now, streams
    playing; and from the admission gate, where there is one, its waiting line and
    refusals by reason."""

    def __init__(self, codec: "CodecStage", admission: "SpeechAdmission | None", model: str) -> None:
        self._codec, self._admission, self._model = codec, admission, model

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        codec, gate, model = self._codec, self._admission, self._model
        gauges = {
            "speech_streams_in_underrun": ("Streams playing whose listener is out of audio now", codec.streams_in_underrun()),
            "speech_streams_open": ("Speech streams open (talking or decoding)", codec.active()),
        }
        if gate is not None:
            gauges["speech_admission_waiting"] = ("Speech requests waiting at the admission gate", gate.waiting())
        for name, (doc, value) in gauges.items():
            family = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["model"])
            family.add_metric([model], float(value))
            yield family
        if gate is None:
            return
        refused = CounterMetricFamily(f"{PREFIX}_speech_admission_refused", "Speech requests refused by the admission gate, by reason",
                                      labels=["model", "reason"])
        for reason in ("queue_full", "ttfp_budget"):
            refused.add_metric([model, reason], float(gate.refused.get(reason, 0)))
        yield refused


class SpeechMetrics:
    """The audio figures of a talker engine and its codec stage (and admission gate,
    where there is one), labelled with the served ``model``, in ``registry`` (a new one
    by default; the Omni chat server passes the text metrics' own)."""

    def __init__(self, model: str, talker: "Engine", codec: "CodecStage", *, admission: "SpeechAdmission | None" = None,
                 registry: CollectorRegistry | None = None) -> None:
        self.model = model
        r = self.registry = registry if registry is not None else CollectorRegistry()
        r.register(PlaybackCollector(codec, admission, model))
        self.requests = Counter(f"{PREFIX}_speech_requests", "Speech requests ended, by finish reason", ["model", "finish_reason"], registry=r)
        self.frames = Counter(f"{PREFIX}_speech_frames", "Codec frames sent (80 ms each)", ["model"], registry=r)
        self.audio_seconds = Counter(f"{PREFIX}_speech_audio_seconds", "Seconds of audio sent", ["model"], registry=r)
        self.first_audio = Histogram(f"{PREFIX}_speech_time_to_first_audio_seconds", "Request to its first audio chunk", ["model"],
                                     buckets=_FIRST_AUDIO_BUCKETS, registry=r)
        self.rtf = Histogram(f"{PREFIX}_speech_real_time_factor", "Request to its last chunk, over the audio's length (completed streams)",
                             ["model"], buckets=_RTF_BUCKETS, registry=r)
        self.worst_gap = Histogram(f"{PREFIX}_speech_underrun_seconds",
                                   "A completed stream's worst silent gap, played from its first chunk (0: none)", ["model"],
                                   buckets=_GAP_BUCKETS, registry=r)
        self.underruns = Counter(f"{PREFIX}_speech_underruns", "Chunks that reached the client after its audio ran out", ["model"],
                                 registry=r)
        self.empty_audio = Counter(f"{PREFIX}_speech_empty_audio", "Completed speech requests with no audio at all", ["model"], registry=r)
        self.chunk_frames = Histogram(f"{PREFIX}_speech_chunk_frames", "Frames per audio chunk the codec sent", ["model"],
                                      buckets=_CHUNK_BUCKETS, registry=r)
        self.step_seconds = Histogram(f"{PREFIX}_speech_step_seconds", "A talker step (launch to processed) or a codec round",
                                      ["model", "stage"], buckets=_STEP_BUCKETS, registry=r)
        for family in (self.frames, self.audio_seconds, self.first_audio, self.rtf, self.worst_gap, self.underruns, self.empty_audio,
                       self.chunk_frames):
            family.labels(model)  # present (at 0) from the first scrape
        talker.scheduler.add_step_observer(self.step_seconds.labels(model, "talker").observe)
        codec.round_observers.append(self.step_seconds.labels(model, "codec").observe)

    @classmethod
    def of_pipeline(cls, pipeline: "SpeechPipeline", model: str) -> "SpeechMetrics":
        """The speech server's: a Qwen3-TTS pipeline's audio figures and its talker
        stage's gauges."""
        metrics = cls(model, pipeline.engine, pipeline.codec, admission=pipeline.admission)
        metrics.registry.register(StageCollector(pipeline.engine))
        return metrics

    def utterance(self, log_event: str = "speech_response") -> Utterance:
        return Utterance(self, log_event)

    def render(self) -> bytes:
        return generate_latest(self.registry)
