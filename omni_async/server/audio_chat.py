"""Chat with audio out: ``POST /v1/chat/completions`` with ``modalities: ["text", "audio"]``
and ``audio: {"voice", "format"}``, on a server over a Qwen3-Omni pipeline
(:class:`~omni_async.speech.omni_pipeline.OmniPipeline`), in OpenAI's audio-chat shape.

Whole: ``choices[0].message`` has ``content`` null and ``audio``: ``id``, ``data`` (the
reply's audio in ``audio.format``, base64), ``expires_at`` and ``transcript`` (the
reply's text). Streamed: after the role chunk, the text as ``delta.audio.transcript``
pieces and the audio as ``delta.audio.data`` pieces (base64; ``wav``: the first opens
with a WAV header whose sizes are left open, as a streamed WAV's are), each with the
reply's audio ``id``, in the order the stages write them (the talker speaks while the
thinker writes); then a chunk with the ``finish_reason`` (the thinker's) and
``delta.audio.expires_at``, the usage when asked, ``[DONE]``. The usage counts the
frames spoken as ``completion_tokens_details.audio_tokens``.

A reply that ended is kept by its audio id until its ``expires_at``
(:mod:`.audio_turns`): a later turn may send it back as ``{"role": "assistant", "audio":
{"id": ...}}``. Each reply is counted in ``/metrics`` as its events pass
(:mod:`.omni_metrics`); both are done before the reply's last chunk (or its body) goes
out, so a client that has it can scrape or refer to it at once.

Audio in: the messages' ``input_audio`` parts (:mod:`.audio_input`), heard by the
pipeline (the prompt's tokens counted with each audio's placeholders expanded); a text
reply to them is the thinker's alone, its prompt from :meth:`AudioChat.heard`.

As for text, a streamed reply waits for its first event before its headers, so a refused
request (an unknown voice, a prompt without room) gets its status code; a client that goes
away aborts the reply in every stage (its stream is closed, or its whole reply cancelled).
"""

from __future__ import annotations

import base64
import contextlib
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .. import errors
from ..config import SamplingParams
from ..logs import log
from ..speech.audio_format import pcm16, wav_file, wav_header
from .audio_input import audio_parts
from .audio_turns import AudioTurns
from .disconnect import until_disconnect
from .errors import body_of, error_body, invalid
from .omni_metrics import OmniMetrics, SpokenTally
from .protocol import ChatCompletionRequest
from .wire import DONE, ChunkFrames, event

if TYPE_CHECKING:
    from ..speech.omni_hearing import HeardPrompt
    from ..speech.omni_pipeline import OmniPipeline, OmniResult

__all__ = ["AudioChat"]


class AudioChat:
    """Spoken chat replies of one pipeline, served under ``model_name``, counted in
    ``metrics`` and kept in ``turns`` for later turns to refer to."""

    def __init__(self, pipeline: "OmniPipeline", model_name: str, metrics: OmniMetrics, turns: AudioTurns) -> None:
        self.pipeline = pipeline
        self.model_name = model_name
        self.metrics = metrics
        self.turns = turns

    async def heard(self, body: ChatCompletionRequest, prompt_ids: list[int]) -> "HeardPrompt":
        """The thinker's prompt: the rendered ids with the messages' ``input_audio`` parts
        heard (as they are when there are none)."""
        return await self.pipeline.thinker_prompt(input_ids=prompt_ids, audio=audio_parts(body.messages, self.pipeline.hearing))

    async def respond(self, request: Request, body: ChatCompletionRequest, prompt: "HeardPrompt",
                      sampling: SamplingParams) -> Response:
        """The reply to a checked request (``body.wants_audio()``) whose prompt (heard:
        :meth:`heard`) and thinker sampling the text route made."""
        assert body.audio is not None
        try:
            voice = self.pipeline.check_voice(body.audio.voice)
        except errors.InvalidRequestError as exc:
            raise invalid(str(exc), "audio.voice") from None
        reply = _Reply(self.model_name, body.audio.format, self.pipeline.sample_rate, len(prompt.ids), self.turns)
        tally = self.metrics.reply(len(prompt.ids))
        events = self.pipeline.stream(prompt=prompt, voice=voice, sampling=sampling)
        if not body.stream:
            completed, result = await until_disconnect(request, self.whole(events, tally))
            if not completed:
                tally.fail(None)
                return Response(status_code=499)  # nobody is listening any more
            return JSONResponse(reply.whole(result))
        try:
            first = await events.__anext__()
        except BaseException as exc:
            tally.fail(exc if isinstance(exc, Exception) else None)
            await events.aclose()
            raise  # a typed error: answered with its status code by the handler
        return StreamingResponse(reply.events(events, first, body.include_usage(), tally), media_type="text/event-stream")

    async def whole(self, events: AsyncIterator[Any], tally: SpokenTally) -> "OmniResult":
        """The whole reply, its events counted as they come."""
        parts = self.pipeline.reply_parts()
        try:
            async with contextlib.aclosing(events):
                async for delta in events:
                    tally.on_event(delta)
                    parts.add(delta)
        except BaseException as exc:
            tally.fail(exc if isinstance(exc, Exception) else None)
            raise
        tally.finish()
        return parts.result()


class _Reply:
    """One reply's envelope, audio id and encoding; once it ends, kept in ``turns``."""

    def __init__(self, model: str, fmt: str, sample_rate: int, prompt_tokens: int, turns: AudioTurns) -> None:
        self.id = "chatcmpl-" + uuid.uuid4().hex[:24]
        self.audio_id = "audio_" + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model, self.format, self.sample_rate, self.prompt_tokens = model, fmt, sample_rate, prompt_tokens
        self.turns = turns

    def usage(self, text_tokens: int, frames: int) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": text_tokens + frames,
                "total_tokens": self.prompt_tokens + text_tokens + frames,
                "completion_tokens_details": {"text_tokens": text_tokens, "audio_tokens": frames}}

    def whole(self, result: "OmniResult") -> dict[str, Any]:
        """The reply's body; the reply kept for later turns."""
        expires_at = self.turns.keep(self.audio_id, result.text or "")
        data = wav_file(result.audio, self.sample_rate) if self.format == "wav" else pcm16(result.audio)
        audio = {"id": self.audio_id, "data": base64.b64encode(data).decode("ascii"), "expires_at": expires_at,
                 "transcript": result.text or ""}
        message = {"role": "assistant", "content": None, "refusal": None, "audio": audio}
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": result.finish_reason}],
                "usage": self.usage(len(result.output_ids), int(result.codes.shape[0]))}

    def _audio_bytes(self, pcm: Any, first: bool) -> bytes:
        data = pcm16(pcm)
        return wav_header(self.sample_rate, None) + data if first and self.format == "wav" else data

    async def events(self, events: AsyncIterator[Any], first: Any, include_usage: bool, tally: SpokenTally) -> AsyncIterator[bytes]:
        frames = ChunkFrames(self.id, "chat.completion.chunk", self.created, self.model)
        text_tokens = spoken = 0
        reason = None
        opened = False
        transcript: list[str] = []
        try:
            yield frames.chunk([_choice({"role": "assistant", "content": None})])
            delta = first
            while delta is not None:
                tally.on_event(delta)
                if delta.kind == "text":
                    text_tokens += len(delta.token_ids)
                    reason = delta.finish_reason if delta.finished else reason
                    if delta.text:
                        transcript.append(delta.text)
                        yield frames.chunk([_choice({"audio": {"id": self.audio_id, "transcript": delta.text}})])
                elif delta.audio is not None:
                    spoken += int(delta.audio.codes.shape[0])
                    data = self._audio_bytes(delta.audio.audio, not opened)
                    opened = True
                    if data:
                        yield frames.chunk([_choice({"audio": {"id": self.audio_id, "data": base64.b64encode(data).decode("ascii")}})])
                delta = await anext(events, None)
            expires_at = self.turns.keep(self.audio_id, "".join(transcript))
            tally.finish()
            yield frames.chunk([_choice({"audio": {"id": self.audio_id, "expires_at": expires_at}}, reason)])
            if include_usage:
                yield frames.chunk([], self.usage(text_tokens, spoken))
        except errors.OmniAsyncError as exc:  # after the headers: reported in the stream
            tally.fail(exc)
            yield event(body_of(exc)[1])
        except Exception as exc:  # a bug is still an error event, and the stream still ends with [DONE]
            tally.fail(exc)
            log.error("server_audio_stream_failed", error=repr(exc))
            yield event(error_body(f"internal server error: {type(exc).__name__}", 500))
        finally:
            tally.fail(None)  # the client left: "abort", unless the reply ended
            await events.aclose()
        yield DONE


def _choice(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
