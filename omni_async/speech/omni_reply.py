"""One spoken reply's way through Qwen3-Omni's three stages (:class:`Reply`), and what a
caller gets of it (:class:`OmniDelta`, :class:`OmniResult`).

A reply is a task of the pipeline's task group that reads the thinker request's deltas
and keeps the talker request fed: once the thinker has written two tokens (the talker's
prefill reads the first reply token as an input, and a reply's last token never is one)
it builds the talker's input from the thinker's rows (``talker_prompt``), submits the
talker request streamed and sends it the trailing text rows known so far; each later
thinker delta sends the rows it made known; the thinker's end sends ``T(tts_eos)`` and
closes the rows. The talker stage's conditioning rule holds each frame until its row is
there, so the codes are the same whenever the rows come: with ``stream_talker=False``
the talker starts only at the thinker's end (the stages in order), on the same path.
Frames go to the codec stage as they are written; its chunks, and the thinker's deltas,
reach the caller as :class:`OmniDelta` s through one channel, in the order they happen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import numpy as np
import torch

from .. import errors
from .codec_stage import AudioChunk, CodecStream
from .omni_stage import end_text_rows, send_text_rows, talker_request

if TYPE_CHECKING:
    from .codec_stage import CodecStage
    from .omni_config import OmniTalkerConfig
    from .omni_talker import OmniTalker, TalkerPrompt
    from .stage import SpeechStage

__all__ = ["OmniDelta", "OmniResult", "Reply", "ReplyParts", "ThinkerRows", "Stages"]


@dataclass
class OmniDelta:
    """One event of a streamed reply. ``kind`` "text": the thinker's new tokens
    (``token_ids``, ``text`` when the folder has a tokenizer), ``finished`` on its last,
    with the thinker's ``finish_reason``. ``kind`` "audio": a chunk of the spoken reply
    (``audio``), ``finished`` on the last, with the talker's ``finish_reason`` ("stop":
    the codec EOS, "length": ``max_frames``)."""

    request_id: str
    kind: str
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    audio: AudioChunk | None = None
    finished: bool = False
    finish_reason: str | None = None


@dataclass
class OmniResult:
    """A whole reply: the thinker's tokens and text, and the talker's frames ``codes``
    ``[frames, groups]`` (CPU) with their PCM ``audio`` (float32 at ``sample_rate``)."""

    request_id: str
    output_ids: list[int]
    text: str | None
    finish_reason: str | None
    codes: torch.Tensor
    audio: np.ndarray
    sample_rate: int
    audio_finish_reason: str | None

    @property
    def seconds(self) -> float:
        return len(self.audio) / self.sample_rate


class ReplyParts:
    """A streamed reply's events gathered into its :class:`OmniResult`, in one place:
    what :meth:`~.omni_pipeline.OmniPipeline.chat` returns and what a server answers a
    whole reply with, while it looks at each event on the way (metrics)."""

    def __init__(self, num_code_groups: int, sample_rate: int, with_text: bool) -> None:
        self.groups, self.sample_rate, self.with_text = num_code_groups, sample_rate, with_text
        self.request_id = ""
        self.ids: list[int] = []
        self.texts: list[str] = []
        self.audio: list[np.ndarray] = []
        self.codes: list[torch.Tensor] = []
        self.reason: str | None = None
        self.audio_reason: str | None = None

    def add(self, delta: OmniDelta) -> None:
        self.request_id = delta.request_id
        if delta.kind == "text":
            self.ids.extend(delta.token_ids)
            self.texts.append(delta.text or "")
            self.reason = delta.finish_reason if delta.finished else self.reason
        elif delta.audio is not None:
            self.audio.append(delta.audio.audio)
            self.codes.append(delta.audio.codes)
            self.audio_reason = delta.finish_reason if delta.finished else self.audio_reason

    def result(self) -> OmniResult:
        text = "".join(self.texts) if self.with_text else None
        pcm = np.concatenate(self.audio) if self.audio else np.zeros(0, dtype=np.float32)
        frames = torch.cat(self.codes) if self.codes else torch.zeros((0, self.groups), dtype=torch.long)
        return OmniResult(self.request_id, self.ids, text, self.reason, frames, pcm, self.sample_rate, self.audio_reason)


class ThinkerRows:
    """What the talker needs of a thinker request, gathered from its deltas on the
    thinker's device: its tokens, its prompt's layer rows and one layer row per token."""

    def __init__(self) -> None:
        self.output_ids: list[int] = []
        self.prompt_hidden: torch.Tensor | None = None
        self.hidden: list[torch.Tensor] = []

    def add(self, delta: Any) -> None:
        self.output_ids.extend(delta.token_ids)
        if delta.prompt_hidden_states is not None:
            self.prompt_hidden = delta.prompt_hidden_states
        if delta.hidden_states is not None:
            self.hidden.append(delta.hidden_states)

    def layer_rows(self) -> torch.Tensor:
        """The layer rows at every position the thinker ran: the prompt's, then those of
        the positions that produced tokens 2.. (token ``i`` comes from position
        ``prompt + i - 1``; the reply's last token is never an input)."""
        assert self.prompt_hidden is not None, "the thinker returned no prompt rows"
        out = torch.cat(self.hidden) if self.hidden else self.prompt_hidden[:0]
        return torch.cat((self.prompt_hidden, out[1:len(self.output_ids)]))


class Stages(Protocol):
    """What a reply uses of its pipeline (:class:`~.omni_pipeline.OmniPipeline`)."""

    stream_talker: bool
    talker: "SpeechStage"
    talker_model: "OmniTalker"
    config: "OmniTalkerConfig"
    codec: "CodecStage"
    sample_rate: int

    async def talker_prompt(self, prompt_ids: list[int], rows: ThinkerRows, voice: str) -> "TalkerPrompt": ...

    def frames_room(self, prompt: "TalkerPrompt", max_frames: int | None) -> int: ...

    def start_soon(self, fn: Any, *args: Any) -> None: ...

    async def text_rows(self, tokens: list[int]) -> torch.Tensor: ...


class Reply:
    """One request through the three stages (the module's docstring). ``events`` is the
    caller's end of its channel: :class:`OmniDelta` s, or the error that ended it."""

    def __init__(self, pipe: Stages, rid: str, prompt_ids: list[int], voice: str, max_frames: int | None,
                 repetition_penalty: float) -> None:
        self.pipe, self.rid, self.prompt_ids, self.voice = pipe, rid, prompt_ids, voice
        self.max_frames, self.penalty = max_frames, repetition_penalty
        self._send, self.events = anyio.create_memory_object_stream(math.inf)
        self.rows = ThinkerRows()
        self.talker: Any = None  # the talker request's handle, once submitted
        self.codec_stream: CodecStream | None = None
        self.sent = 0  # the thinker's input rows whose text rows went to the talker (its tokens' index)
        self.scope = anyio.CancelScope()
        self._open_parts = {"text", "audio"}

    # ------------------------------------------------------------ the caller's channel

    def _emit(self, item: Any) -> None:
        try:
            self._send.send_nowait(item)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass  # the caller left

    def _fail(self, exc: BaseException) -> None:
        self._emit(exc)
        self._send.close()

    def _ended(self, kind: str) -> None:
        """The text's or the audio's last event was sent: the channel ends with both."""
        self._open_parts.discard(kind)
        if not self._open_parts:
            self._send.close()

    # ------------------------------------------------------------ the thinker's side

    async def run(self, thinker: Any) -> None:
        """Read the thinker request ``thinker`` (a handle) to its end, feeding the talker."""
        with self.scope:
            try:
                async for delta in thinker:
                    self.rows.add(delta)
                    self._emit(OmniDelta(self.rid, "text", list(delta.token_ids), delta.text, finished=delta.finished,
                                         finish_reason=delta.finish_reason))
                    if self.pipe.stream_talker and not delta.finished:
                        await self._speak(final=False)
                await self._speak(final=True)
                self._ended("text")
            except Exception as exc:
                self._fail(exc)

    async def _speak(self, *, final: bool) -> None:
        """Start the talker once it can, or send it the rows made known since; at the
        thinker's end, ``T(tts_eos)`` and the rows' end (or silence for a one-token reply)."""
        n = len(self.rows.output_ids)
        if self.talker is None:
            if n < 2:
                if final:
                    self._emit(OmniDelta(self.rid, "audio", audio=self._silence(), finished=True, finish_reason="stop"))
                    self._ended("audio")
                return
            await self._start(final)
        elif not self.talker.done:
            await self._send_rows(len(self.prompt_ids) + n - 1)
        if final and not self.talker.done:
            send_text_rows(self.pipe.talker.engine, self.rid, self.pipe.talker_model.tts_eos[None])
            end_text_rows(self.pipe.talker.engine, self.rid)

    async def _start(self, final: bool) -> None:
        prompt = await self.pipe.talker_prompt(self.prompt_ids, self.rows, self.voice)
        request = talker_request(self.pipe.talker_model, prompt, max_frames=self.pipe.frames_room(prompt, self.max_frames),
                                 repetition_penalty=self.penalty, streamed=True)
        self.codec_stream = self.pipe.codec.open(self.rid)
        self.talker = await self.pipe.talker.engine.submit(**request, request_id=self.rid)
        self.pipe.start_soon(self.pipe.codec.feed, self.talker, self.codec_stream)
        self.pipe.start_soon(self._forward_audio)
        send_text_rows(self.pipe.talker.engine, self.rid, prompt.trailing)
        self.sent = len(self.prompt_ids) + len(self.rows.output_ids) - 1

    async def _send_rows(self, upto: int) -> None:
        """The text rows of the thinker's input rows ``sent .. upto - 1``."""
        if upto <= self.sent:
            return
        tokens = [*self.prompt_ids, *self.rows.output_ids][self.sent:upto]
        rows = await self.pipe.text_rows(tokens)
        send_text_rows(self.pipe.talker.engine, self.rid, rows)
        self.sent = upto

    def _silence(self) -> AudioChunk:
        groups = self.pipe.config.num_code_groups
        return AudioChunk(self.rid, np.zeros(0, dtype=np.float32), self.pipe.sample_rate, torch.zeros((0, groups), dtype=torch.long),
                          0, True, "stop")

    # ------------------------------------------------------------ the codec's side

    async def _forward_audio(self) -> None:
        """The codec stream's chunks to the caller; the channel ends with the last one,
        or with the talker request's error if it ended without it."""
        stream = self.codec_stream
        assert stream is not None
        finished = False
        async with stream.receive:
            async for chunk in stream.receive:
                finished = chunk.finished
                self._emit(OmniDelta(self.rid, "audio", audio=chunk, finished=chunk.finished, finish_reason=chunk.finish_reason))
        if finished:
            self._ended("audio")
            return
        try:
            await self.talker.result()
            raise errors.RequestAbortedError(f"omni request {self.rid!r} ended without its last audio chunk")
        except Exception as exc:
            self._fail(exc)
