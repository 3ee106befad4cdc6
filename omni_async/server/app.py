"""The OpenAI-compatible ASGI app (FastAPI) over one Engine.

Routes: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (whole or SSE-streamed), ``POST /v1/responses``
(:mod:`.responses_api`), the tokenizer's routes (:mod:`.tokenize`), ``GET /health``,
``GET /metrics``.
Every error, whatever raised it (a typed engine error, a body that does not parse, an
unknown route, a bug), is answered with its status and an OpenAI-style body
(:mod:`omni_async.server.errors`).

Errors come before the stream starts: ``Engine.submit`` raises typed errors early, and a
streamed response waits for the request's first delta (or its error, e.g. queue full)
before it sends its headers, so a client gets a status code it can act on instead of an
error inside a 200 stream. A client that goes away aborts its request: the streamed
response's generator is closed (which closes the handle's stream), and a whole response
races the result against the ``http.disconnect`` message.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .. import errors
from ..text.chat import chat_template_of, render_chat_ids, template_names
from ..config import SamplingParams
from ..engine import Engine
from ..client.handle import RequestHandle
from ..logs import log
from .metrics import EngineMetrics
from ..version import __version__
from .chat_messages import ChatMessage, TrackedMessage, check_fields_read, template_messages, tool_turns_as_text
from .disconnect import until_disconnect
from .audio_chat import AudioChat
from .audio_turns import AudioTurns
from .omni_metrics import OmniMetrics
from .errors import ClientNames, body_of, error_body, invalid
from .prompt_list import combined_result, merged_deltas
from .protocol import DEFAULT_COMPLETION_MAX_TOKENS, ChatCompletionRequest, CompletionRequest
from .wire import DONE, ChunkFrames, FastJsonRoute, event
from .request_errors import chat_names, completion_names
from .responses import ResponseContext, usage
from .responses_api import add_responses_route
from .scoring import PromptScores, check_max_tokens, echoed_prompts, engine_prompt_logprobs
from .options import ApiKeyGuard, chat_template_text, generation_defaults
from .reasoning import starts_inside, thinks
from .handlers import add_error_handlers, add_service_routes
from .tokenize import add_tokenize_routes
from .tool_parsers import parser_for_template, with_tools_message
from .worker_routes import add_worker_routes
from .tools import ToolPlan, plan_tools

if TYPE_CHECKING:
    from ..speech.omni_pipeline import OmniPipeline

__all__ = ["create_app", "default_model_name"]


def default_model_name(model: str) -> str:
    """The model id for what ``--model`` named: ``tiny`` and ``smollm2`` stay as they
    are; a folder or a .gguf file is served under its last path component."""
    return os.path.basename(os.path.normpath(model)) or model


class OpenAIServer:
    """Route handlers bound to one engine, its metrics and its served model name."""

    def __init__(
        self, engine: Engine, metrics: EngineMetrics, model_name: str, *, tool_call_parser: str = "auto",
        sampling_defaults: dict[str, Any] | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name
        self.tool_call_parser = tool_call_parser
        self.sampling_defaults = dict(sampling_defaults or {})
        self.stopping = False  # set by the stop on SIGINT/SIGTERM (server.run)
        self.audio_chat: AudioChat | None = None  # chat with audio out: a server over a Qwen3-Omni pipeline

    def answerable(self, exc: errors.OmniAsyncError) -> errors.OmniAsyncError:
        """The error a client is told: a request the stop aborted says so."""
        if self.stopping and isinstance(exc, errors.SchedulerClosedError):
            return errors.SchedulerClosedError("the server is shutting down: this request was aborted")
        return exc

    def check_room(self, n_prompt: int, max_tokens: int, field: str) -> None:
        """A ``max_tokens`` the context cannot hold after the prompt is the client's mistake
        (400 context_length_exceeded), not something to shorten silently."""
        context = self.engine.scheduler.limits.context_length
        if n_prompt + max_tokens > context:
            err = errors.RequestRejectedError(
                f"this model's maximum context length is {context} tokens; the prompt has {n_prompt} and {field} "
                f"asks for {max_tokens} more (over by {n_prompt + max_tokens - context}): lower {field} or shorten the prompt"
            )
            err.param = field  # type: ignore[attr-defined]
            raise err

    def completion_inputs(self, body: CompletionRequest) -> list[dict[str, Any]]:
        """The prompts as token ids (text encoded here, as the engine would) so their
        lengths can be checked against ``max_tokens``."""
        tokenizer = self.engine.tokenizer
        inputs = body.engine_inputs()
        if tokenizer is None:
            return inputs
        return [{"input_ids": tokenizer.encode(one["prompt"])} if one.get("prompt") else one for one in inputs]

    def check_model(self, model: str) -> JSONResponse | None:
        if model != self.model_name:
            body = error_body(f"model {model!r} is not served here; this server serves {self.model_name!r}", 404, code="model_not_found", param="model")
            return JSONResponse(body, status_code=404)
        return None

    def card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "omni-async",
            "max_model_len": self.engine.scheduler.limits.context_length,
        }

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.card()]}

    def model(self, model_id: str) -> Response:
        """``GET /v1/models/{id}``: the card, or 404 model_not_found."""
        return self.check_model(model_id) or JSONResponse(self.card())

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        request.state.client_names = completion_names()
        wrong = self.check_model(body.model)
        if wrong is not None:
            return wrong
        max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        scored = engine_prompt_logprobs(echo=body.echo, logprobs=body.logprobs, prompt_logprobs=body.prompt_logprobs, max_tokens=max_tokens)
        check_max_tokens(max_tokens, scored)
        sampling = body.sampling(max_tokens, top_logprobs=body.logprobs, constraint=body.constraint(), defaults=self.sampling_defaults,
                                 prompt_logprobs=scored)
        inputs = self.completion_inputs(body)
        if "max_tokens" in body.model_fields_set:
            for one in inputs:
                if "input_ids" in one:
                    self.check_room(len(one["input_ids"]), max_tokens, "max_tokens")
        handles = await self.submit_all(inputs, sampling)
        ctx = ResponseContext(
            "completion", self.model_name, self.engine.tokenizer, logprobs=body.logprobs is not None, n=body.n, echo=body.echo,
            top_logprobs=body.logprobs or 0, prompt_logprobs=body.prompt_logprobs,
            prompts=echoed_prompts(body.engine_inputs(), inputs, self.engine.tokenizer) if body.echo or body.prompt_logprobs is not None else None,
        )
        return await self.respond(request, handles, ctx, stream=body.stream, n=body.n, include_usage=body.include_usage())

    async def submit_all(self, inputs: list[dict[str, Any]], sampling: SamplingParams) -> list[RequestHandle]:
        """One request per prompt; if one is refused, those already submitted are aborted."""
        handles: list[RequestHandle] = []
        try:
            for one in inputs:
                handles.append(await self.engine.submit(**one, sampling=sampling))
        except BaseException:
            for handle in handles:
                await self.engine.abort(handle.request_id)
            raise
        return handles

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        request.state.client_names = chat_names(max_completion_tokens=body.max_completion_tokens is not None)
        wrong = self.check_model(body.model)
        if wrong is not None:
            return wrong
        if body.wants_audio():
            return await self.spoken_chat(body, request)
        handle, ctx = await self.submit_chat(body)
        return await self.respond(request, [handle], ctx, stream=body.stream, n=body.n, include_usage=body.include_usage())

    async def spoken_chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        """A chat request asking for audio out: the thinker's prompt and sampling made
        here, as for text; the reply by the omni pipeline (:mod:`.audio_chat`)."""
        if self.audio_chat is None:
            raise invalid("this model writes text only: modalities [\"text\", \"audio\"] need a Qwen3-Omni model", "modalities")
        for name in ("tools", "logprobs", "prompt_logprobs"):
            if getattr(body, name):
                raise invalid(f"{name} is not available with audio out", name)
        ids, constraint, _ = self.chat_prompt(body, hears=True)
        heard = await self.audio_chat.heard(body, ids)  # input_audio parts heard, placeholders expanded
        sampling = body.sampling(self.chat_max_tokens(body, heard.ids), top_logprobs=None, constraint=constraint,
                                 defaults=self.sampling_defaults)
        return await self.audio_chat.respond(request, body, heard, sampling)

    def chat_max_tokens(self, body: ChatCompletionRequest, ids: list[int]) -> int:
        """The request's token budget, checked against the room after its prompt; as much
        as the context (and the KV cache) leaves when it sets none."""
        max_tokens = body.requested_max_tokens()
        if max_tokens is None:
            limits = self.engine.scheduler.limits
            return max(1, min(limits.context_length, limits.kv_capacity_tokens) - len(ids))
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        self.check_room(len(ids), max_tokens, field)
        check_max_tokens(max_tokens, body.prompt_logprobs, field)
        return max_tokens

    async def submit_chat(self, body: ChatCompletionRequest) -> tuple[RequestHandle, ResponseContext]:
        """The chat request submitted, and the context its output is read in (tool calls,
        reasoning): shared by ``/v1/chat/completions`` and ``/v1/responses``. Over a
        pipeline that hears, ``input_audio`` parts go in as the thinker's input embeddings."""
        ids, constraint, tools = self.chat_prompt(body, hears=self.audio_chat is not None)
        heard = await self.audio_chat.heard(body, ids) if self.audio_chat is not None else None
        ids = ids if heard is None else heard.ids
        max_tokens = self.chat_max_tokens(body, ids)
        top = body.chat_top_logprobs()
        sampling = body.sampling(max_tokens, top_logprobs=top, constraint=constraint, defaults=self.sampling_defaults,
                                 prompt_logprobs=body.prompt_logprobs)
        given = {"input_ids": ids} if heard is None or heard.embeds is None else {"input_embeds": heard.embeds}
        handle = await self.engine.submit(**given, sampling=sampling)
        template = chat_template_of(self.engine.tokenizer)
        ctx = ResponseContext(
            "chat", self.model_name, self.engine.tokenizer, logprobs=top is not None, tools=tools if tools.parse else None,
            tool_format=parser_for_template(self.tool_call_parser, template), reasoning=thinks(template),
            reasoning_inside=thinks(template) and starts_inside(self.engine.tokenizer.decode(ids[-32:], skip_special_tokens=False)),
            prompt_logprobs=body.prompt_logprobs, prompts=[PromptScores("", ids)] if body.prompt_logprobs is not None else None,
        )
        return handle, ctx

    def chat_prompt(self, body: ChatCompletionRequest, hears: bool = False) -> tuple[list[int], dict[str, Any], ToolPlan]:
        """The prompt ids (messages and tools through the template), the grammar fields
        (``response_format``, or the one that forces a tool call) and the tool plan."""
        reads = template_names(chat_template_of(self.engine.tokenizer))
        tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, reads | {"tools"})
        constraint = body.constraint()
        if tools.ebnf is not None:
            if constraint:
                raise errors.InvalidRequestError("response_format cannot be combined with a tool_choice that forces a call")
            constraint = {"ebnf": tools.ebnf}
        ids = self.render(body.messages, tools.tools, template_kwargs=body.chat_template_kwargs, hears=hears)
        return ids, constraint, tools

    def render(
        self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None, *, add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None, hears: bool = False,
    ) -> list[int]:
        """The prompt ids of a conversation: tools and tool turns go to a template that
        reads them, or else in as Hermes text (any model can use tools); a message field
        the template ignored is refused."""
        reads = template_names(chat_template_of(self.engine.tokenizer))
        takes_tools = "tools" in reads
        if self.audio_chat is not None:  # an assistant turn may be an earlier spoken reply, by its audio id
            messages = self.audio_chat.turns.resolve(messages)
        tracked = template_messages(messages, hears=hears)
        rendered = tracked if "tool_calls" in reads else tool_turns_as_text(tracked)
        if tools and not takes_tools:
            rendered = with_tools_message(rendered, tools, TrackedMessage)
        ids = render_chat_ids(
            self.engine.tokenizer, rendered, add_generation_prompt=add_generation_prompt, tools=tools if takes_tools else None,
            template_kwargs=template_kwargs,
        )
        check_fields_read(tracked)
        return ids

    async def results(self, handles: list[RequestHandle]) -> list[Any]:
        """The requests' results; the first error aborts the others."""
        tasks = [asyncio.ensure_future(self.metrics.result(h)) for h in handles]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def respond(self, request: Request, handles: list[RequestHandle], ctx: ResponseContext, *, stream: bool, n: int, include_usage: bool) -> Response:
        if not stream:
            completed, results = await until_disconnect(request, self.results(handles))
            if not completed:
                return Response(status_code=499)  # nobody is listening any more
            ctx.take_scores(results)
            return JSONResponse(ctx.response(combined_result(results, n)))
        deltas = merged_deltas([self.metrics.observe(h) for h in handles], n)
        try:
            first = await deltas.__anext__()
        except StopAsyncIteration:
            first = None
        except BaseException:
            await deltas.aclose()
            raise  # a typed error: answered with its status code by the handler
        names = getattr(request.state, "client_names", None)
        return StreamingResponse(self.events(handles, ctx, deltas, first, n, include_usage, names), media_type="text/event-stream")

    async def events(
        self, handles: list[RequestHandle], ctx: ResponseContext, deltas: AsyncIterator[Any], first: Any, n: int, include_usage: bool,
        names: ClientNames | None = None,
    ) -> AsyncIterator[bytes]:
        """The SSE stream: role chunks (chat), one chunk per delta, a closing chunk for a
        completion whose last delta carried no finish reason, usage, ``[DONE]``. A
        completion's plain text delta (the common case) takes the framing's fast path."""
        finished: set[int] = set()
        offsets = [0] * (n * len(handles))
        frames = ChunkFrames(ctx.id, ctx.chunk_object, ctx.created, ctx.model)
        plain = ctx.kind == "completion" and not ctx.logprobs and not ctx.echo
        try:
            if ctx.kind == "chat":
                for i in range(n):
                    yield frames.chunk([ctx.role_choice(i)])
            delta = first
            while delta is not None:
                if plain and not delta.finished:
                    if delta.text or (delta.text is None and delta.token_ids):  # no tokenizer: a chunk per step still
                        yield frames.text(delta.index, delta.text or "")
                else:
                    if delta.finished:
                        finished.add(delta.index)
                    sent = delta.text or ""
                    if delta.text or delta.finished or (ctx.logprobs and delta.token_ids) or ctx.echo_pending(delta.index):
                        choice = ctx.delta_choice(delta, offsets[delta.index])
                        if choice is not None:
                            yield frames.chunk([choice])
                            sent = choice.get("text", sent)  # with the echoed prompt
                    offsets[delta.index] += len(sent)
                delta = await anext(deltas, None)
            result = combined_result([await h.result() for h in handles], n)
            for out in result.outputs:
                if out.index not in finished:
                    yield frames.chunk([ctx.final_choice(out.index, out.finish_reason)])
            if include_usage:
                yield frames.chunk([], usage(result))
        except errors.OmniAsyncError as exc:  # after the headers: reported in the stream
            yield event(body_of(self.answerable(exc), names)[1])
        except Exception as exc:  # a bug is still an error event, and the stream still ends with [DONE]
            log.error("server_stream_failed", error=repr(exc))
            yield event(error_body(f"internal server error: {type(exc).__name__}", 500))
        finally:
            await deltas.aclose()
        yield DONE


def create_app(
    engine: Engine,
    *,
    model_name: str | None = None,
    metrics: EngineMetrics | None = None,
    close_engine: bool = True,
    api_key: str | None = None,
    chat_template: str | None = None,
    tool_call_parser: str = "auto",
    generation_config: str = "auto",
    omni: "OmniPipeline | None" = None,
    audio_turns: AudioTurns | None = None,
) -> FastAPI:
    """The app for ``engine``. It starts the engine at startup and, with ``close_engine``,
    closes it at shutdown. ``metrics`` defaults to a fresh registry for this engine, its
    request figures labelled with the served model name. ``api_key``: every route but
    /health, /metrics and /version needs it as a Bearer token; ``chat_template`` (a file or
    an inline template) replaces the checkpoint's; ``tool_call_parser``: the format tool
    calls are parsed in (``auto``: from the template); ``generation_config``: ``auto``
    takes sampling defaults from the checkpoint's generation_config.json, ``none`` not.
    ``omni``: the Qwen3-Omni pipeline whose thinker ``engine`` is: chat requests may ask
    for audio out (:mod:`.audio_chat`); the app starts and closes the whole pipeline, and
    ``metrics`` (by default a fresh registry; one passed in must not be attached to an
    engine) counts both stages and the audio (:mod:`.omni_metrics`). ``audio_turns``: where
    its spoken replies are kept for later turns to refer to by audio id (by default an
    hour each, the latest 4096; :mod:`.audio_turns`)."""
    info = engine.scheduler.info()
    name = model_name or default_model_name(str(info.get("model_name") or info.get("model_path", "model")))
    if metrics is None:
        metrics = EngineMetrics(engine if omni is None else None, model_name=name)
    if chat_template is not None:
        if engine.tokenizer is None:
            raise errors.ConfigError("--chat-template needs a model with a tokenizer")
        engine.tokenizer.chat_template = chat_template_text(chat_template)
    parser_for_template(tool_call_parser, "")  # a bad name fails at startup
    if generation_config not in ("auto", "none"):
        raise errors.ConfigError(f"generation_config must be 'auto' or 'none', got {generation_config!r}")
    defaults = generation_defaults(info.get("model_path")) if generation_config == "auto" else {}
    if defaults:
        log.info("server_sampling_defaults", source="generation_config.json", **defaults)
    server = OpenAIServer(engine, metrics, name, tool_call_parser=tool_call_parser, sampling_defaults=defaults)
    if omni is not None:
        if omni.thinker is not engine:
            raise errors.ConfigError("create_app(omni=...): engine must be the pipeline's thinker")
        server.audio_chat = AudioChat(omni, name, OmniMetrics(metrics, omni), audio_turns if audio_turns is not None else AudioTurns())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if omni is not None:
            await omni.__aenter__()
        else:
            await engine.start()
        log.info("server_started", model=name)
        try:
            yield
        finally:
            log.info("server_stopping", model=name)
            if close_engine:
                await (omni.aclose() if omni is not None else engine.aclose())

    app = FastAPI(title="omni-async", version=__version__, lifespan=lifespan)
    app.router.route_class = FastJsonRoute  # set before the routes are added
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.model_name = name
    app.state.server = server
    if api_key:
        app.add_middleware(ApiKeyGuard, api_key=api_key)

    add_error_handlers(app, server.answerable)

    app.get("/v1/models")(server.models)
    app.get("/v1/models/{model_id:path}", response_model=None)(server.model)
    app.post("/v1/completions", response_model=None)(server.completions)
    app.post("/v1/chat/completions", response_model=None)(server.chat)
    add_tokenize_routes(app, server)
    add_responses_route(app, server)
    add_worker_routes(app, server)  # what a router reads: /get_model_info, /get_load ...

    add_service_routes(app, engine, metrics)

    return app
