"""Chat in, text and speech out: Qwen3-Omni's thinker, talker and Code2Wav as three
stages in one event loop.

The chain is made of the pieces each stage already is: the thinker is an
:class:`~omni_async.engine.Engine` on the folder's text decoder, capturing the rows of the
talker's ``accept_hidden_layer``; the talker is the Qwen3-Omni talker stage
(:mod:`.omni_stage`); the codec is a :class:`~.codec_stage.CodecStage`. A request's way
through them is a :class:`~.omni_reply.Reply`: the thinker's reply streams to the caller
as text deltas while its rows stay on the thinker's device; after its first two tokens
:func:`.omni_talker.talker_prompt` builds the talker's input from those rows (the
thinker's input embeddings, read from its own embedding table on its device, and the
layer rows it returned) and the talker starts, fed the reply's text rows as the thinker
writes them (``stream_talker=False``: only once the reply is complete, the stages in
order); the codec turns the frames into PCM chunks as they arrive, as
:class:`~.pipeline.SpeechPipeline` does for Qwen3-TTS.

Every request ends in each stage it reached: leaving a stream early, cancelling, or a
failure in any stage aborts the request in the thinker and the talker (each frees its
KV once) and drops its codec state; other requests are untouched.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import anyio
import torch

from .. import errors
from ..client.heap import configure_gc
from ..config import SamplingParams
from ..core.policy import DeadlinePolicy
from ..engine import Engine
from ..models.random_weights import random_weights_of
from ..runners.streams import STREAMS
from ..stage.executor import await_future
from ..stage.request_checks import sampling_of
from ..text.chat import render_chat_ids
from .code2wav import Code2Wav
from .code2wav_config import Code2WavConfig
from .codec_stage import CodecStage
from .omni_config import OmniTalkerConfig
from .omni_hearing import AudioPart, Hearing, HeardPrompt, split_audio_parts
from .omni_input import TalkerInput
from .omni_reply import OmniDelta, OmniResult, Reply, ReplyParts, ThinkerRows
from .omni_stage import build_omni_talker_stage
from .model import ids_on
from .omni_talker import OmniTalker, TalkerPrompt, talker_prompt
from .schedule import SpeechSchedule
from .stage import SpeechStage

__all__ = ["OmniPipeline", "OmniDelta", "OmniResult"]


# The voice a request without one speaks in (the reference's default), when the
# checkpoint has it; else its first voice by name.
DEFAULT_VOICE = "ethan"

# ``codec_loader(folder, device, dtype) -> decoder``: a folder's Code2Wav, in the decoder
# protocol CodecStage reads (sample_rate, samples_per_frame, num_quantizers, empty_past,
# a call on codes, pasts and positions).
CodecLoader = Callable[[Path, torch.device, torch.dtype], Any]


class OmniPipeline:
    """Use ``async with``; :meth:`chat` for a whole reply, :meth:`stream` for its text
    deltas and audio chunks as they come."""

    def __init__(self, thinker: Engine, talker: SpeechStage, codec: Any, *, first_chunk_frames: int = 2,
                 max_chunk_frames: int = 32, stream_talker: bool = True, codec_graphs: bool | None = None,
                 input_thread: bool | None = None, hearing: Hearing | None = None) -> None:
        """``stream_talker``: the talker starts after the thinker's first two tokens and is
        fed as it writes (False: once the reply is complete). ``codec_graphs``: the codec's
        calls as CUDA graphs (default: on CUDA; an eager codec call is hundreds of small
        launches). ``input_thread``: the
        talker's input built on a thread and stream of its own (default: on CUDA, see
        :mod:`.omni_input`). ``hearing``: the thinker's audio encoder and feature
        extractor (:mod:`.omni_hearing`); None: a prompt with audio is refused."""
        self.thinker = thinker
        self.hearing = hearing
        if hearing is not None:
            hearing.check_width(self.thinker_embed.weight.shape[1])
        self.stream_talker = stream_talker
        self.talker = talker
        self.talker_model: OmniTalker = talker.model  # type: ignore[assignment]
        self.config: OmniTalkerConfig = self.talker_model.config
        if getattr(codec, "num_quantizers", self.config.num_code_groups) != self.config.num_code_groups:
            raise errors.ConfigError(f"the codec reads {codec.num_quantizers} codebooks a frame; the talker writes "
                                     f"{self.config.num_code_groups}")
        device = talker.runner.device
        # The speech pipeline's round budget (SpeechSchedule's default, a power of two, so
        # every call a round makes has a graph captured up front): without one a round of 64
        # streams' long chunks made calls past them and captured one inside the round (a
        # device-wide wait, and out of memory beside the 30B thinker on an H100).
        self.codec = CodecStage(codec, device, first_chunk_frames=first_chunk_frames, max_chunk_frames=max_chunk_frames,
                                cuda_graphs=device.type == "cuda" if codec_graphs is None else codec_graphs,
                                max_frames_per_round=SpeechSchedule().codec_max_frames)
        self.codec.capture_graphs()
        # Arrival order, with the first chunk's express for multi-step talker steps (a
        # reply's first chunk needs first_chunk_frames + 1 talker tokens).
        talker.engine.scheduler.core.set_policy(DeadlinePolicy(lambda req: None, express_tokens=first_chunk_frames + 1))
        self.sample_rate: int = codec.sample_rate
        self._tg: Any = None
        self._ids = itertools.count()
        self._open: set[str] = set()
        threaded = device.type == "cuda" if input_thread is None else input_thread
        self.input = TalkerInput(device, self._text_rows_of, threaded=threaded, prompts_of=self._talker_prompts)

    @classmethod
    def from_pretrained(cls, folder: str | Path, *, device: str = "cpu", loop: str = "overlap", dtype: Any = None, seed: int = 0,
                        codec: Any = None, codec_loader: CodecLoader | None = None, first_chunk_frames: int = 2,
                        max_chunk_frames: int = 32, stream_talker: bool = True, codec_graphs: bool | None = None,
                        input_thread: bool | None = None, thinker_limits: dict[str, Any] | None = None,
                        talker_limits: dict[str, Any] | None = None) -> "OmniPipeline":
        """The three stages of a ``Qwen3OmniMoeForConditionalGeneration`` folder on one
        ``device``. ``codec``: a decoder to use in place of the folder's Code2Wav, or
        ``codec_loader`` to build one; ``stream_talker``, ``codec_graphs``, ``input_thread``:
        see ``__init__``; ``thinker_limits`` / ``talker_limits``: each
        stage's SchedulerConfig fields (KV sizing, chunked prefill ...).

        A folder of ``config.json`` and ``random_weights.json`` (a benchmark's: the
        released checkpoint does not fit beside anything on the GPU machine's disk) has
        every stage's weights drawn on the device from the file's seed
        (:mod:`omni_async.models.random_weights`, ``random_omni_talker``,
        ``Code2Wav.random``)."""
        folder = Path(folder)
        cfg = OmniTalkerConfig.from_folder(folder)  # a folder that is no Qwen3-Omni one fails before anything loads
        drawn = random_weights_of(folder, json.loads((folder / "config.json").read_text(encoding="utf-8")))
        # The talker (its KV sized by its builder), the codec and the audio encoder first: the thinker, unless
        # its limits size its KV, takes what the device has left, as a lone engine would.
        talker = build_omni_talker_stage(folder if drawn is None else cfg, device=device, loop=loop, dtype=dtype,
                                         seed=seed if drawn is None else drawn.seed, **(talker_limits or {}))
        if codec is None:
            dev, dt = talker.runner.device, talker.model.dtype
            codec_dtype = torch.float32 if dev.type == "cpu" else dt
            if drawn is not None and codec_loader is None:
                codec = Code2Wav.random(Code2WavConfig.from_folder(folder), device=dev, dtype=codec_dtype, seed=drawn.seed)
            else:
                codec = (codec_loader or folder_code2wav)(folder, dev, codec_dtype)
        hearing = Hearing.from_folder(folder, device=talker.runner.device, dtype=talker.model.dtype,
                                      seed=None if drawn is None else drawn.seed)
        thinker = Engine.from_pretrained(str(folder), device=device, loop=loop, dtype=dtype, seed=seed,
                                         hidden_states_layer=cfg.accept_hidden_layer, **(thinker_limits or {}))
        pipeline = cls(thinker, talker, codec, first_chunk_frames=first_chunk_frames, max_chunk_frames=max_chunk_frames,
                       stream_talker=stream_talker, codec_graphs=codec_graphs, input_thread=input_thread, hearing=hearing)
        # The thinker's GC options again, once the talker's and the codec's objects exist too
        # (Engine.from_pretrained applied them when the thinker was built).
        config = thinker.scheduler.config
        configure_gc(config.gc_freeze, config.gc_gen0_threshold, str(talker.runner.device))
        return pipeline

    @classmethod
    async def load(cls, folder: str | Path, **kwargs: Any) -> "OmniPipeline":
        """``from_pretrained`` in a worker thread (the event loop keeps serving)."""
        return await anyio.to_thread.run_sync(functools.partial(cls.from_pretrained, folder, **kwargs))

    # ------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> "OmniPipeline":
        await self.thinker.__aenter__()
        try:
            await self.talker.engine.__aenter__()
        except BaseException:
            await self.thinker.aclose()
            raise
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self.codec.run)
        self._tg.start_soon(self.input.run)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        tg, self._tg = self._tg, None
        if tg is not None:
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
        try:
            await self.talker.engine.__aexit__(*exc)
        finally:
            await self.thinker.__aexit__(*exc)
            self.input.close()

    async def aclose(self) -> None:
        await self.__aexit__(None, None, None)

    # ------------------------------------------------------------ what it knows

    def voices(self) -> list[str]:
        return sorted(self.config.speakers)

    @property
    def default_voice(self) -> str | None:
        voices = self.voices()
        return DEFAULT_VOICE if DEFAULT_VOICE in voices else (voices[0] if voices else None)

    @property
    def open_requests(self) -> list[str]:
        return sorted(self._open)

    # ------------------------------------------------------------ requests

    async def thinker_prompt(self, messages: Any = None, input_ids: Any = None,
                             audio: list[AudioPart] | None = None) -> HeardPrompt:
        """The thinker's prompt: ``messages`` through the chat template (their audio
        parts heard), or ``input_ids`` with one audio placeholder per ``audio`` part."""
        if (messages is None) == (input_ids is None):
            raise errors.InvalidRequestError("give exactly one of messages or input_ids")
        if messages is not None:
            if audio:
                raise errors.InvalidRequestError("audio goes with input_ids; in messages it is a content part")
            messages, audio = split_audio_parts(messages)
            ids = render_chat_ids(self.thinker.tokenizer, messages, add_generation_prompt=True)
        elif not isinstance(input_ids, (list, tuple)) or not all(isinstance(t, int) for t in input_ids):
            raise errors.InvalidRequestError("input_ids must be a list of integers")
        else:
            ids = list(input_ids)
        if not audio:
            return HeardPrompt(ids, None)
        if self.hearing is None:
            raise errors.InvalidRequestError("this checkpoint cannot hear: it has no audio encoder (thinker_config.audio_config)")
        counts = self.hearing.rows(audio)
        context = self.thinker.scheduler.limits.context_length
        if len(ids) + sum(counts) - len(counts) > context:  # refused before the encoder runs
            raise errors.InvalidRequestError(f"the prompt with its audio heard takes {len(ids) + sum(counts) - len(counts)} "
                                             f"positions; the thinker's context holds {context}")
        return await anyio.to_thread.run_sync(functools.partial(self._hear, ids, audio))

    def _hear(self, ids: list[int], audio: list[AudioPart]) -> HeardPrompt:
        """The heard prompt, its rows on the host (the thinker's door checks their values
        on the loop, with no device read). On CUDA on a stream of its own: the stages'
        launches wait for the default stream's work, and hearing takes milliseconds to
        seconds of encoder time that must not hold their steps back."""
        assert self.hearing is not None
        device = self.thinker_embed.weight.device
        if device.type != "cuda":
            return self.hearing.prompt(ids, audio, self.thinker_embed)
        with STREAMS.borrowed(device) as stream, torch.cuda.stream(stream):
            prompt = self.hearing.prompt(ids, audio, self.thinker_embed)
            # the copy waits for this stream's work alone, the encoder's
            return prompt if prompt.embeds is None else HeardPrompt(prompt.ids, prompt.embeds.cpu())

    def check_voice(self, voice: str | None) -> str:
        """The voice a request speaks in (``None``: the default), or InvalidRequestError
        naming the voices there are."""
        name = voice if voice is not None else self.default_voice
        if name is None:
            raise errors.InvalidRequestError("this checkpoint names no voices: there is no speaker to speak with")
        self.config.speaker_id(name)  # InvalidRequestError naming the voices there are
        return name

    @property
    def thinker_embed(self) -> torch.nn.Embedding:
        """The thinker's embedding table (on its device)."""
        return self.thinker.stack.loaded.model.model.embed_tokens

    def thinker_embeddings(self, tokens: list[int]) -> torch.Tensor:
        """The thinker's input embeddings of ``tokens`` ``[n, Ht]``, on its device."""
        embed = self.thinker_embed
        with torch.inference_mode():
            return embed(ids_on(tokens, embed.weight.device))  # an asynchronous copy: no wait for the stream

    async def talker_prompt(self, prompt_ids: list[int], rows: ThinkerRows, voice: str) -> TalkerPrompt:
        """The talker's input from the thinker's rows so far (at least two reply tokens),
        its trailing rows those known so far; built in one pass with every other reply's
        wanted at the same time (:meth:`TalkerInput.prompt`)."""
        return await self.input.prompt((prompt_ids, rows, voice))

    def _talker_prompts(self, wanted: list[tuple[list[int], ThinkerRows, str]]) -> list[TalkerPrompt | Exception]:
        """Each reply's prompt, or the error it alone failed with. The talker's door checks
        a prompt's rows (finite values) on the loop: on the host, which reads nothing back
        from the device, so the prefills come over in one copy."""
        built: list[TalkerPrompt | Exception] = []
        for prompt_ids, rows, voice in wanted:
            try:
                tokens = [*prompt_ids, *rows.output_ids[:-1]]
                built.append(talker_prompt(self.talker_model, prompt_ids, rows.output_ids, self.thinker_embeddings(tokens),
                                           rows.layer_rows(), voice, complete=False))
            except Exception as exc:
                built.append(exc)
        ok = [p for p in built if isinstance(p, TalkerPrompt)]
        if ok and ok[0].prefill.device.type == "cuda":
            host = iter(torch.cat([p.prefill for p in ok]).cpu().split([p.prefill.shape[0] for p in ok]))
            built = [TalkerPrompt(next(host), p.trailing) if isinstance(p, TalkerPrompt) else p for p in built]
        return built

    def frames_room(self, prompt: TalkerPrompt, max_frames: int | None) -> int:
        """The request's frame budget: ``max_frames``, or what the talker's context leaves."""
        limits = self.talker.engine.scheduler.limits
        room = min(limits.context_length, limits.kv_capacity_tokens) - prompt.prefill.shape[0] - 1
        if room < 1:
            raise errors.InvalidRequestError(f"the talker's prompt takes {prompt.prefill.shape[0]} of its {limits.context_length} "
                                             "positions, leaving no room to speak")
        if max_frames is not None and max_frames > room:
            raise errors.InvalidRequestError(f"max_frames={max_frames} does not fit: the talker's prompt leaves {room} frames")
        return max_frames if max_frames is not None else room

    def start_soon(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` in the pipeline's task group (a reply's helpers)."""
        self._tg.start_soon(fn, *args)

    @property
    def input_thread(self) -> bool:
        """Whether the talker's input is built on a thread (and CUDA stream) of its own
        (:mod:`.omni_input`; default: on CUDA)."""
        return self.input.threaded

    @input_thread.setter
    def input_thread(self, threaded: bool) -> None:
        self.input.threaded = threaded

    async def text_rows(self, tokens: list[int]) -> torch.Tensor:
        """The talker's text rows of thinker ``tokens``, built with every other reply's
        wanted at the same time (:meth:`TalkerInput.text_rows`)."""
        return await self.input.text_rows(tokens)

    def _text_rows_of(self, tokens: list[int]) -> torch.Tensor:
        return self.talker_model.text_rows(self.thinker_embeddings(tokens))

    async def stream(self, messages: Any = None, *, input_ids: list[int] | None = None, audio: list[AudioPart] | None = None,
                     prompt: HeardPrompt | None = None, voice: str | None = None,
                     sampling: SamplingParams | dict[str, Any] | None = None, max_frames: int | None = None,
                     repetition_penalty: float = 1.05, request_id: str | None = None) -> AsyncIterator[OmniDelta]:
        """The reply's text deltas and audio chunks as they come (with ``stream_talker``
        they interleave: the talker speaks while the thinker writes); the last of each
        kind has ``finished``. ``messages`` may hold audio content parts, or
        ``input_ids`` one audio placeholder per ``audio`` part (:mod:`.omni_hearing`);
        or ``prompt``, one :meth:`thinker_prompt` made.
        ``sampling``: the thinker's (``n`` must be 1); the talker is
        greedy with the reference's ``repetition_penalty``. Leaving the loop early (or
        cancelling) aborts the request in every stage it reached."""
        if self._tg is None:
            raise errors.SchedulerClosedError("the omni pipeline is not running: use `async with`")
        name = self.check_voice(voice)
        if max_frames is not None and max_frames < 1:
            raise errors.InvalidRequestError(f"max_frames must be at least 1, got {max_frames}")
        thinker_sampling = _thinker_sampling(sampling)
        if prompt is None:
            prompt = await self.thinker_prompt(messages, input_ids, audio)
        elif messages is not None or input_ids is not None or audio:
            raise errors.InvalidRequestError("give a heard prompt alone, without messages, input_ids or audio")
        prompt_ids = prompt.ids
        rid = request_id or f"omni-{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        if rid in self._open:
            raise errors.RequestRejectedError(f"duplicate request id {rid!r}: a reply with this id is open")
        self._open.add(rid)
        reply = Reply(self, rid, prompt_ids, name, max_frames, repetition_penalty)
        ended: set[str] = set()  # the parts ("text", "audio") whose last event came
        done = False
        try:
            given = dict(input_ids=prompt_ids) if prompt.embeds is None else dict(input_embeds=prompt.embeds)
            handle = await self.thinker.submit(**given, sampling=thinker_sampling, request_id=rid)
            self._tg.start_soon(reply.run, handle)
            async with reply.events:
                async for event in reply.events:
                    if isinstance(event, BaseException):
                        raise event
                    if event.finished:
                        ended.add(event.kind)
                    done = len(ended) == 2
                    yield event
            if not done:
                raise errors.RequestAbortedError(f"omni request {rid!r} ended without its last audio chunk")
        finally:
            if not done:
                reply.scope.cancel()
                with anyio.CancelScope(shield=True):
                    await self.thinker.abort(rid)
                    await self.talker.engine.abort(rid)
            if reply.codec_stream is not None:
                self.codec.close(reply.codec_stream)
            self._open.discard(rid)

    async def chat(self, messages: Any = None, *, input_ids: list[int] | None = None, audio: list[AudioPart] | None = None,
                   prompt: HeardPrompt | None = None, voice: str | None = None,
                   sampling: SamplingParams | dict[str, Any] | None = None, max_frames: int | None = None,
                   repetition_penalty: float = 1.05, request_id: str | None = None) -> OmniResult:
        """The whole reply (the arguments of :meth:`stream`)."""
        parts = self.reply_parts()
        async for delta in self.stream(messages, input_ids=input_ids, audio=audio, prompt=prompt, voice=voice, sampling=sampling,
                                       max_frames=max_frames, repetition_penalty=repetition_penalty, request_id=request_id):
            parts.add(delta)
        return parts.result()

    def reply_parts(self) -> ReplyParts:
        """An empty gathering of a streamed reply's events into its :class:`OmniResult`."""
        return ReplyParts(self.config.num_code_groups, self.sample_rate, self.thinker.tokenizer is not None)


def _thinker_sampling(sampling: SamplingParams | dict[str, Any] | None) -> SamplingParams:
    """The caller's thinker sampling, with the rows the talker reads asked for."""
    sampling = sampling_of(sampling)
    if sampling.n != 1:
        raise errors.InvalidRequestError(f"a spoken reply is one completion: n must be 1, got {sampling.n}")
    return dataclasses.replace(sampling, return_hidden_states=True, return_prompt_hidden_states=True)


def folder_code2wav(folder: Path, device: torch.device, dtype: torch.dtype) -> Code2Wav:
    """The folder's Code2Wav (``code2wav_config``, the ``code2wav.*`` tensors)."""
    return Code2Wav.from_folder(folder, device=device, dtype=dtype)
