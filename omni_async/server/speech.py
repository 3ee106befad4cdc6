"""The speech app: a Qwen3-TTS model behind OpenAI's ``POST /v1/audio/speech``.

Routes: ``POST /v1/audio/speech`` (the body: :mod:`omni_async.server.speech_protocol`),
``GET /v1/audio/voices``, ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``,
``GET /metrics``, ``GET /version``; errors in the text server's shape
(:mod:`omni_async.server.handlers`).

A response is the whole file, or (``stream_format``) the audio as the codec decodes it:
``audio`` sends the bytes themselves (a WAV's header with its sizes left open, then PCM),
``sse`` sends them base64 in ``speech.audio.delta`` events and ends with
``speech.audio.done`` carrying the usage (input text tokens, frames out). Every way
sends the same bytes for the same request: one conversion (:mod:`..speech.audio_format`).

As in the text server, a streamed response waits for the utterance's first chunk before
its headers, so a refused request (unknown voice, empty input, a text past the context)
gets its 400 rather than a broken 200. A client that goes away ends its request: a
streamed body is cancelled where it waits for the next chunk, and closes the pipeline's
stream on its way out; a whole-file response races the utterance against
``http.disconnect``. Either way the talker's request is aborted and the codec's state
dropped.
"""

from __future__ import annotations

import base64
import contextlib
from typing import Any, AsyncIterator

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .. import errors
from ..logs import log
from ..speech import AudioChunk, SpeechPipeline
from ..speech.audio_format import pcm16, wav_file, wav_header
from ..version import __version__
from .app import default_model_name
from .disconnect import until_disconnect
from .errors import body_of, error_body
from .handlers import add_error_handlers, add_service_routes
from .options import ApiKeyGuard
from .speech_metrics import SpeechMetrics, Utterance
from .speech_protocol import FORMATS, SPEECH_NAMES, SpeechPlan, SpeechRequest
from .wire import FastJsonRoute, event

__all__ = ["create_speech_app", "SpeechServer"]

# The reference's template puts 3 role ids before the text and 5 fixed ids after it.
_ROLE_IDS, _TAIL_IDS = 3, 5


class SpeechServer:
    """Route handlers bound to one pipeline, its metrics and its served model name."""

    def __init__(self, pipeline: SpeechPipeline, metrics: SpeechMetrics, model_name: str) -> None:
        self.pipeline = pipeline
        self.metrics = metrics
        self.model_name = model_name

    # ------------------------------------------------------------ what is served

    def card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "omni-async",
                "max_model_len": self.pipeline.engine.scheduler.limits.context_length, "sample_rate": self.pipeline.sample_rate}

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.card()]}

    def model(self, model_id: str) -> Response:
        return self.check_model(model_id) or JSONResponse(self.card())

    def voices(self) -> dict[str, Any]:
        return {"object": "list", "model": self.model_name, "voices": self.pipeline.voices(), "languages": self.pipeline.languages(),
                "sample_rate": self.pipeline.sample_rate}

    def check_model(self, model: str | None) -> JSONResponse | None:
        if model is None or model == self.model_name:
            return None
        body = error_body(f"model {model!r} is not served here; this server serves {self.model_name!r}", 404, code="model_not_found",
                          param="model")
        return JSONResponse(body, status_code=404)

    def input_tokens(self, text: str) -> int:
        """The input's text tokens (the template's fixed ids not counted)."""
        return len(self.pipeline.stage.tokenizer.template_ids(text)) - _ROLE_IDS - _TAIL_IDS

    # ------------------------------------------------------------ POST /v1/audio/speech

    async def speech(self, body: SpeechRequest, request: Request) -> Response:
        request.state.client_names = SPEECH_NAMES
        wrong = self.check_model(body.model)
        if wrong is not None:
            return wrong
        plan = body.plan()
        tally = self.metrics.utterance()
        chunks = self.pipeline.stream(body.input, plan.voice, plan.language, params=plan.params)
        headers = {"X-Sample-Rate": str(self.pipeline.sample_rate)}
        if plan.stream_format is None:
            completed, audio = await until_disconnect(request, self.whole(chunks, tally))
            if not completed:
                tally.finish("abort")
                return Response(status_code=499)  # nobody is listening any more
            data = wav_file(audio, self.pipeline.sample_rate) if plan.response_format == "wav" else pcm16(audio)
            return Response(data, media_type=FORMATS[plan.response_format], headers=headers)
        completed, first = await until_disconnect(request, anext(chunks, None))  # a refused request raises here: its status
        if not completed:
            tally.finish("abort")
            return Response(status_code=499)
        if plan.stream_format == "sse":
            return StreamingResponse(self.events(body.input, chunks, first, plan, tally), media_type="text/event-stream", headers=headers)
        return StreamingResponse(self.audio(chunks, first, plan, tally), media_type=FORMATS[plan.response_format], headers=headers)

    async def whole(self, chunks: AsyncIterator[AudioChunk], tally: Utterance) -> np.ndarray:
        """The utterance's PCM. A request that fails before its first chunk (a refused
        one) raises uncounted, as a streamed one does."""
        pieces: list[np.ndarray] = []
        try:
            async for chunk in chunks:
                tally.chunk(chunk)
                pieces.append(chunk.audio)
        except Exception:
            if pieces:
                tally.finish("error")
            raise
        tally.finish()
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)

    async def encoded(self, chunks: AsyncIterator[AudioChunk], first: AudioChunk | None, plan: SpeechPlan,
                      tally: Utterance) -> AsyncIterator[bytes]:
        """Each chunk's bytes as it arrives, counted as it passes; a ``wav`` stream's
        first bytes are its header, sizes left open."""
        pending = wav_header(self.pipeline.sample_rate, None) if plan.response_format == "wav" else b""
        chunk = first
        while chunk is not None:
            tally.chunk(chunk)
            data, pending = pending + pcm16(chunk.audio), b""
            if data:
                yield data
            chunk = await anext(chunks, None)

    async def audio(self, chunks: AsyncIterator[AudioChunk], first: AudioChunk | None, plan: SpeechPlan,
                    tally: Utterance) -> AsyncIterator[bytes]:
        """The body of ``stream_format: audio``. A failure after the headers drops the
        connection, the body left short."""
        try:
            async with contextlib.aclosing(self.encoded(chunks, first, plan, tally)) as pieces:
                async for data in pieces:
                    yield data
        except Exception:
            tally.finish("error")
            raise
        finally:
            tally.finish()  # the client left: "abort", unless the utterance ended
            await chunks.aclose()

    async def events(self, text: str, chunks: AsyncIterator[AudioChunk], first: AudioChunk | None, plan: SpeechPlan,
                     tally: Utterance) -> AsyncIterator[bytes]:
        """The body of ``stream_format: sse``: a ``speech.audio.delta`` per chunk, then
        ``speech.audio.done`` with the usage; a failure after the headers is an
        ``error`` event."""
        try:
            async with contextlib.aclosing(self.encoded(chunks, first, plan, tally)) as pieces:
                async for data in pieces:
                    yield event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})
            n_in = self.input_tokens(text)
            usage = {"input_tokens": n_in, "output_tokens": tally.frames, "total_tokens": n_in + tally.frames}
            yield event({"type": "speech.audio.done", "usage": usage})
        except errors.OmniAsyncError as exc:
            tally.finish("error")
            yield event({"type": "error", **body_of(exc, SPEECH_NAMES)[1]})
        except Exception as exc:  # a bug is still an error event
            tally.finish("error")
            log.error("speech_stream_failed", error=repr(exc))
            yield event({"type": "error", **error_body(f"internal server error: {type(exc).__name__}", 500)})
        finally:
            tally.finish()
            await chunks.aclose()


def create_speech_app(pipeline: SpeechPipeline, *, model_name: str | None = None, close_engine: bool = True,
                      api_key: str | None = None) -> FastAPI:
    """The app for ``pipeline``. With ``close_engine`` (the default) the app runs the
    pipeline: enters it at startup and closes it at shutdown; without, the caller runs it
    (``async with pipeline``) around the server. ``model_name``: the id clients send (by
    default the checkpoint folder's last path component, or the built-in's name);
    ``api_key``: as the text server's."""
    name = model_name or default_model_name(str(pipeline.stage.folder or pipeline.engine.scheduler.info().get("model_name") or "tts"))
    metrics = SpeechMetrics.of_pipeline(pipeline, name)
    server = SpeechServer(pipeline, metrics, name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if close_engine:
            await pipeline.__aenter__()
        log.info("server_started", model=name, kind="speech")
        try:
            yield
        finally:
            log.info("server_stopping", model=name)
            if close_engine:
                await pipeline.aclose()

    app = FastAPI(title="omni-async", version=__version__, lifespan=lifespan)
    app.router.route_class = FastJsonRoute
    app.state.pipeline = pipeline
    app.state.metrics = metrics
    app.state.model_name = name
    if api_key:
        app.add_middleware(ApiKeyGuard, api_key=api_key)
    add_error_handlers(app)

    app.get("/v1/models")(server.models)
    app.get("/v1/models/{model_id:path}", response_model=None)(server.model)
    app.post("/v1/audio/speech", response_model=None)(server.speech)
    app.get("/v1/audio/voices")(server.voices)

    add_service_routes(app, pipeline.engine, metrics)

    return app
