"""Text in, speech out: the talker stage (frames) and the codec stage (PCM) in one event
loop, with the API of ``omni_async.speech``."""

from __future__ import annotations

import functools
import itertools
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

import anyio
import numpy as np
import torch

from .. import errors
from ..client.heap import configure_gc
from ..core.policy import DeadlinePolicy, FCFSPolicy, SchedulingPolicy
from ..logs import log
from .admission import FrameClock, SpeechAdmission
from .codec import CodecDecoder
from .codec_config import CodecConfig
from .codec_stage import AudioChunk, CodecStage, CodecStream
from .config import FRAME_RATE
from .params import SpeechParams
from .playback import Playback
from .prompt import prefill_rows, resolve_voice
from .schedule import SpeechSchedule
from .stage import SpeechStage, build_speech_stage, builtin_name

__all__ = ["SpeechPipeline", "SpeechResult", "AudioChunk", "SpeechParams", "SpeechSchedule"]


@dataclass
class SpeechResult:
    """One utterance: ``codes`` ``[frames, 16]`` (codebook 0 first, on the CPU), ``audio``
    float32 PCM at ``sample_rate``, ``finish_reason`` "stop" (the codec EOS) or
    "length" (``max_frames``)."""

    request_id: str
    codes: torch.Tensor
    audio: np.ndarray
    sample_rate: int
    finish_reason: str | None

    @property
    def seconds(self) -> float:
        return len(self.audio) / self.sample_rate


class SpeechPipeline:
    """Use ``async with``; ``synthesize`` for a whole utterance, ``stream`` for its
    chunks as they are decoded."""

    def __init__(self, stage: SpeechStage, codec: CodecDecoder, *, first_chunk_frames: int = 2, max_chunk_frames: int = 32,
                 codec_graphs: bool | None = None, schedule: SpeechSchedule | dict[str, Any] | None = None,
                 codec_stream: str = "own", codec_sms: int | None = None) -> None:
        self.stage = stage
        self.engine = stage.engine
        self.model = stage.model
        self.config = stage.model.config
        # ``codec_graphs``: the codec's calls as CUDA graphs; by default wherever the
        # talker's frames are graphed (eager, a codec call is hundreds of small launches:
        # 64 streams of the 1.7B shape on an H100 made 88 audio-s/s with it, 258 graphed).
        graphed = stage.runner.frame_graphs is not None
        # ``codec_stream``: "own" (the codec's calls on a stream of their own, beside the
        # talker's steps) or "talker" (queued on the talker's stream, between its steps:
        # the device runs one stage at a time, neither waiting for SMs the other holds).
        # ``codec_sms``: with its own stream, the codec's kernels on at most this many SMs (a
        # green context), the others left to the talker's small kernels (None: all SMs).
        _check_codec_stream(codec_stream, codec_sms)
        self.codec = CodecStage(codec, stage.runner.device, first_chunk_frames=first_chunk_frames, max_chunk_frames=max_chunk_frames,
                                cuda_graphs=graphed if codec_graphs is None else codec_graphs and graphed,
                                stream=self._talker_stream() if codec_stream == "talker" else None, sms=codec_sms)
        self.sample_rate = codec.sample_rate
        self._tg: Any = None
        self._ids = itertools.count()
        self._streams: dict[str, CodecStream] = {}  # the open streams by request id: their playback
        self._talking: set[str] = set()  # streams whose talker request runs (admission counts them)
        self.frame_clock = FrameClock()
        self.admission = SpeechAdmission(lambda: len(self._talking), self.frame_clock, frame_s=1.0 / FRAME_RATE,
                                         audio_rate=self.codec.audio_rate, playing=self.codec.active)
        self.schedule = SpeechSchedule()
        self.set_schedule(schedule)
        self.codec.capture_graphs()  # every call a round under the schedule's frame budget makes
        self.engine.scheduler.add_step_observer(self._stepped)

    def _talker_stream(self) -> Any:
        """The CUDA stream the talker launches on: its own, or the default one where it has
        none (``own_cuda_stream=False``); None on a CPU."""
        runner = self.stage.runner
        if runner.device.type != "cuda":
            return None
        return runner.stream if runner.stream is not None else torch.cuda.default_stream(runner.device)

    @classmethod
    def from_pretrained(cls, path_or_name: str, *, device: str = "cpu", loop: str = "overlap", dtype: Any = None, seed: int = 0,
                        first_chunk_frames: int = 2, max_chunk_frames: int = 32, codec_graphs: bool | None = None,
                        schedule: SpeechSchedule | dict[str, Any] | None = None, codec_stream: str = "own", codec_sms: int | None = None,
                        **limits: Any) -> "SpeechPipeline":
        """A Qwen3-TTS 12 Hz checkpoint folder (the ``qwen-tts`` layout), or a built-in
        random-weight model: ``"tiny"`` (tests, the CPU demo), ``"0.6b"``, ``"1.7b"``
        (the released sizes' shapes, for speed runs). ``codec_graphs``: the codec's calls
        as CUDA graphs (default: where the talker's frames are graphed, see ``__init__``). ``schedule``: how streams share the
        stages (:class:`SpeechSchedule`: the deadline policy by default, no admission
        limits). ``codec_stream``, ``codec_sms``: see ``__init__``. ``limits``: SchedulerConfig fields."""
        schedule = SpeechSchedule.of(schedule)  # a bad one fails before the model loads
        _check_codec_stream(codec_stream, codec_sms)
        stage = build_speech_stage(path_or_name, device=device, loop=loop, dtype=dtype, seed=seed, **limits)
        dev, dt = stage.runner.device, stage.model.dtype
        if stage.folder is not None:
            codec = CodecDecoder.from_folder(stage.folder / "speech_tokenizer", device=dev, dtype=torch.float32 if dev.type == "cpu" else dt)
        else:
            codec = CodecDecoder.random(_codec_config(builtin_name(path_or_name) or ""), device=dev, dtype=torch.float32 if dev.type == "cpu" else dt,
                                        seed=seed)
        pipeline = cls(stage, codec, first_chunk_frames=first_chunk_frames, max_chunk_frames=max_chunk_frames, codec_graphs=codec_graphs,
                       schedule=schedule, codec_stream=codec_stream, codec_sms=codec_sms)
        # The GC options as Engine.from_pretrained applies them, once the codec's graphs are
        # made too (``gc_freeze``: what the server's command line turns on by default).
        config = stage.engine.scheduler.config
        configure_gc(config.gc_freeze, config.gc_gen0_threshold, str(dev))
        return pipeline

    @classmethod
    async def load(cls, path_or_name: str, **kwargs: Any) -> "SpeechPipeline":
        """``from_pretrained`` in a worker thread (the event loop keeps serving)."""
        return await anyio.to_thread.run_sync(functools.partial(cls.from_pretrained, path_or_name, **kwargs))

    # ------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> "SpeechPipeline":
        await self.engine.__aenter__()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self.codec.run)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        tg, self._tg = self._tg, None
        if tg is not None:
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
        await self.engine.__aexit__(*exc)

    async def aclose(self) -> None:
        await self.__aexit__(None, None, None)

    # ------------------------------------------------------------ scheduling

    def set_schedule(self, schedule: SpeechSchedule | dict[str, Any] | None) -> None:
        """Use ``schedule`` from the talker's next step on (streams already running keep
        running; the admission limits apply to requests that arrive from now on)."""
        self.schedule = sched = SpeechSchedule.of(schedule)
        policy: SchedulingPolicy
        if sched.policy == "deadline":
            # a talker row's first chunk needs first_chunk_frames + 1 tokens: frame k comes with g0(k + 1)
            policy = DeadlinePolicy(self._slack, max_decode_rows=sched.max_decode_rows, express_tokens=self.codec.first_chunk_frames + 1)
        else:
            policy = FCFSPolicy(max_decode_rows=sched.max_decode_rows)
        self.engine.scheduler.core.set_policy(policy)
        self.codec.max_streams_per_round = sched.codec_max_streams
        self.codec.max_frames_per_round = sched.codec_max_frames
        self.codec.express = sched.codec_express
        self.codec.round_plan = sched.codec_round_plan
        gate = self.admission
        gate.max_streams, gate.max_waiting, gate.wait_s = sched.max_streams, sched.max_waiting_streams, sched.admission_wait_s
        gate.rows_per_step = sched.max_decode_rows
        gate.notify()

    def _slack(self, req: Any) -> float | None:
        """A talker row's slack for the deadline policy: its stream's first-chunk budget
        left, or the audio its listener has buffered plus the frames waiting for the codec."""
        stream = self._streams.get(req.rid)
        if stream is None:
            return None
        return stream.playback.deadline_slack(self.schedule.ttfp_budget_s, stream.pending_frames * self.codec.frame_seconds)

    def _stepped(self, took: float) -> None:
        """After each talker step: the frame clock's sample, and a look for waiters."""
        self.frame_clock.observe(len(self.engine.scheduler.core.running), self.stage.runner.frames_written)
        self.admission.notify()

    def playback(self, request_id: str) -> dict[str, Any] | None:
        """The open stream's playback state (audio sent and played, slack, TTFP so far,
        underruns, worst gap), or None when no such stream is open."""
        stream = self._streams.get(request_id)
        return None if stream is None else stream.playback.snapshot()

    def streams_in_underrun(self) -> int:
        """Streams playing now whose listener has run out of audio."""
        return self.codec.streams_in_underrun()

    # ------------------------------------------------------------ what it knows

    def voices(self) -> list[str]:
        return sorted(self.config.speakers)

    def languages(self) -> list[str]:
        return ["auto", *sorted(self.config.languages)]

    def info(self) -> dict[str, Any]:
        """The talker stage's info (loop, steps, KV pages, ...) and the speech side's."""
        return {**self.engine.scheduler.info(), "speech": {"model_size": self.config.model_size, "voices": self.voices(), "sample_rate": self.sample_rate,
                                   "frame_rate": FRAME_RATE, "codec_calls": self.codec.calls,
                                   "codec_frames": self.codec.frames_decoded, "codec_frames_padded": self.codec.frames_padded, "codec_rounds": self.codec.rounds,
                                   "codec_largest_round_frames": self.codec.largest_round_frames, "codec_streams": self.codec.active(),
                                   "codec_graph_replays": self.codec.graph_replays, "codec_audio_rate": self.codec.audio_rate.rate(),
                                   "codec_express_calls": self.codec.express_calls, "codec_express_chunks": self.codec.express_chunks,
                                   "codec_bulk_shapes": self.codec.bulk_shapes.summary(), "codec_express_shapes": self.codec.express_shapes.summary(),
                                   "scheduling_policy": self.schedule.policy,
                                   "streams_in_underrun": self.streams_in_underrun(), **self.admission.stats(),
                                   "streams": {rid: s.playback.snapshot() for rid, s in self._streams.items()}}}

    async def decode(self, codes: torch.Tensor) -> np.ndarray:
        """PCM of ``codes`` ``[frames, 16]`` decoded in one call (the codec's one-shot
        decode, which streamed chunks reproduce exactly), off the event loop."""
        codes = torch.as_tensor(codes, dtype=torch.long)
        if codes.ndim != 2 or codes.shape[1] != self.config.num_code_groups:
            raise errors.InvalidRequestError(f"codes must be [frames, {self.config.num_code_groups}], got {tuple(codes.shape)}")
        decoder = self.codec.decoder

        def run() -> np.ndarray:
            with torch.inference_mode():
                return decoder.decode(codes[None].to(decoder.device))[0].float().cpu().numpy()

        return await anyio.to_thread.run_sync(run)

    # ------------------------------------------------------------ requests

    def _prompt(self, text: Any, voice: str | None, language: str | None, params: SpeechParams) -> tuple[torch.Tensor, Any, dict]:
        if not isinstance(text, str):
            raise errors.InvalidRequestError(f"text must be a string, got {type(text).__name__}")
        if not text.strip():
            raise errors.InvalidRequestError("the text is empty: there is nothing to speak")
        if voice is None and self.config.speakers and self.config.model_type == "custom_voice":
            raise errors.InvalidRequestError(f"a voice is needed; this model has: {', '.join(self.voices())}")
        rows = prefill_rows(self.model, self.stage.tokenizer.template_ids(text), resolve_voice(self.config, voice, language))
        context = self.engine.scheduler.limits.context_length
        room = min(context - rows.shape[0] - 1, self.config.defaults.max_new_tokens - 1)
        if room < 1:
            raise errors.InvalidRequestError(
                f"the text is too long: its prompt takes {rows.shape[0]} of the talker's {context} positions, leaving no room to speak")
        if params.max_frames is not None and params.max_frames > room:
            raise errors.InvalidRequestError(
                f"max_frames={params.max_frames} does not fit: the prompt takes {rows.shape[0]} of {context} positions "
                f"({room} frames are left)")
        sampling, metadata = params.resolve(self.config, room)
        return rows, sampling, metadata

    async def stream(self, text: str, voice: str | None = None, language: str | None = None, *,
                     params: SpeechParams | dict[str, Any] | None = None, request_id: str | None = None) -> AsyncIterator[AudioChunk]:
        """The utterance's audio chunk by chunk; the last has ``finished``. Leaving the
        loop early (or cancelling) aborts the talker's request and drops the codec's state."""
        if self._tg is None:
            raise errors.SchedulerClosedError("the speech pipeline is not running: use `async with`")
        params = SpeechParams.of(params)
        rows, sampling, metadata = self._prompt(text, voice, language, params)
        rid = request_id or f"speech-{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        if rid in self._streams:
            raise errors.RequestRejectedError(f"duplicate request id {rid!r}: a speech stream with this id is open")
        playback = Playback()  # from the request's arrival: TTFP counts a wait at the gate
        await self.admission.enter()
        self._talking.add(rid)
        stream = self.codec.open(rid, playback)  # known to the policy before the talker sees the request
        self._streams[rid] = stream
        try:
            handle = await self.engine.submit(input_embeds=rows, sampling=sampling, metadata=metadata, request_id=rid)
        except BaseException:
            self.codec.close(stream)
            self._streams.pop(rid, None)
            self._stop_talking(rid)
            raise
        self._tg.start_soon(self._feed, handle, stream)
        done = False
        try:
            async with stream.receive:
                async for chunk in stream.receive:
                    done = chunk.finished
                    yield chunk
            if not done:  # the talker's request failed: its error, typed
                await handle.result()
                raise errors.RequestAbortedError(f"speech request {rid!r} ended without its last chunk")
        finally:
            if not done:
                with anyio.CancelScope(shield=True):
                    await self.engine.abort(rid)
            self.codec.close(stream)
            self._stop_talking(rid)
            if self._streams.get(rid) is stream:
                del self._streams[rid]
            log.info("speech_request", request_id=rid, ttfp_s=playback.ttfp_s, frames=stream.frames_sent, audio_s=round(playback.sent_s, 3),
                     worst_gap_s=round(playback.worst_gap_s, 4), underruns=playback.underruns,
                     finish_reason=stream.finish_reason if done else "abort")

    def _stop_talking(self, rid: str) -> None:
        if rid in self._talking:
            self._talking.discard(rid)
            self.admission.notify()

    async def _feed(self, handle: Any, stream: CodecStream) -> None:
        """The talker's frames into the codec stage; the stream stops counting as talking
        once its request ends."""
        try:
            await self.codec.feed(handle, stream)
        finally:
            self._stop_talking(stream.request_id)

    async def synthesize(self, text: str, voice: str | None = None, language: str | None = None, *,
                         params: SpeechParams | dict[str, Any] | None = None, request_id: str | None = None) -> SpeechResult:
        """The whole utterance."""
        audio, codes, reason, rid = [], [], None, request_id
        async for chunk in self.stream(text, voice, language, params=params, request_id=request_id):
            audio.append(chunk.audio)
            codes.append(chunk.codes)
            reason, rid = chunk.finish_reason, chunk.request_id
        pcm = np.concatenate(audio) if audio else np.zeros(0, dtype=np.float32)
        all_codes = torch.cat(codes) if codes else torch.zeros((0, self.config.num_code_groups), dtype=torch.long)
        return SpeechResult(rid or "", all_codes, pcm, self.sample_rate, reason)


def _codec_config(name: str) -> CodecConfig:
    """The codec of a built-in model: the released decoder's shapes for a released size,
    a small one (the shapes of the test checkpoint's decoder) for ``tiny``."""
    return CodecConfig.tiny() if name == "tiny" else CodecConfig.qwen3_tts_12hz()


def _check_codec_stream(value: str, sms: int | None = None) -> None:
    if value not in ("own", "talker"):
        raise errors.ConfigError(f"codec_stream must be 'own' or 'talker', got {value!r}")
    if sms is not None and (not isinstance(sms, int) or isinstance(sms, bool) or sms < 1):
        raise errors.ConfigError(f"codec_sms must be None or an integer >= 1, got {sms!r}")
