"""``POST /v1/responses``: OpenAI's Responses API, as the openai client's
``responses.create`` and the OpenAI Agents SDK send it, served by the chat pipeline.

A request becomes a chat request (:mod:`.responses_request`). Its output comes back as Response output items: ``reasoning``
(a ``<think>`` template's), a ``message`` of ``output_text``, and one ``function_call``
per call; streamed, as the API's typed events (``response.created`` ...
``response.completed``, each with its ``sequence_number``).

Nothing is stored (``store`` is answered false): ``previous_response_id``, ``conversation``,
``background`` and stored prompts are refused with a 400 that says to send the whole
conversation, as an agent loop does. Fields that change nothing here (``include``,
``reasoning``, ``truncation``, ``metadata`` (echoed back), ``service_tier``...) are
accepted; anything unknown is ignored with a warning, as on the other routes.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .. import errors
from ..client.handle import RequestHandle
from ..logs import log
from .disconnect import until_disconnect
from .errors import ClientNames, body_of, error_body
from .metrics import EngineMetrics
from .prompt_list import combined_result, merged_deltas
from .protocol import ChatCompletionRequest
from .responses import ResponseContext, usage
from .responses_request import ResponsesRequest, responses_names
from .wire import dumps



class ChatServer(Protocol):
    """What this route needs of the OpenAI server (``app.OpenAIServer``), so that it never
    imports the app that mounts it."""

    model_name: str
    metrics: EngineMetrics

    def check_model(self, model: str) -> JSONResponse | None: ...

    async def submit_chat(self, body: ChatCompletionRequest) -> tuple[RequestHandle, ResponseContext]: ...

    async def results(self, handles: list[RequestHandle]) -> list[Any]: ...

    def answerable(self, exc: errors.OmniAsyncError) -> errors.OmniAsyncError: ...

# ---------------------------------------------------------------- the response


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def response_usage(result: Any) -> dict[str, Any]:
    chat = usage(result)
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat["total_tokens"],
    }


def message_item(item_id: str, text: str, status: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def call_item(item_id: str, call: dict[str, Any], status: str = "completed", arguments: str | None = None) -> dict[str, Any]:
    function = call["function"]
    args = function["arguments"] if arguments is None else arguments
    return {"id": item_id, "type": "function_call", "call_id": call["id"], "name": function["name"], "arguments": args, "status": status}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}], "status": status}


class ResponseShape:
    """One response's envelope (id, time, the request's settings echoed) and its output."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.body = body
        self.model = model
        self.id = _id("resp")
        self.created = int(time.time())

    def envelope(self, status: str, output: list[dict[str, Any]], usage_: dict[str, Any] | None = None, *,
                 incomplete: bool = False, error: dict[str, Any] | None = None) -> dict[str, Any]:
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": output, "usage": usage_, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "metadata": b.metadata or {},
            "parallel_tool_calls": True if b.parallel_tool_calls is None else b.parallel_tool_calls,
            "temperature": b.temperature, "top_p": b.top_p, "top_logprobs": b.top_logprobs,
            "tool_choice": b.tool_choice or "auto", "tools": b.tools or [],
            "text": b.text or {"format": {"type": "text"}}, "previous_response_id": None, "reasoning": b.reasoning,
            "store": False, "truncation": "disabled", "user": b.user, "background": False,
        }

    def whole(self, choice: dict[str, Any], result: Any) -> dict[str, Any]:
        """The response of a finished chat choice."""
        incomplete = choice["finish_reason"] == "length"
        status = "incomplete" if incomplete else "completed"
        message = choice["message"]
        output = []
        if message.get("reasoning_content"):
            output.append(reasoning_item(_id("rs"), message["reasoning_content"], status))
        if message.get("content"):
            logprobs = (choice.get("logprobs") or {}).get("content")
            output.append(message_item(_id("msg"), message["content"], status, logprobs))
        output += [call_item(_id("fc"), call) for call in message.get("tool_calls") or []]
        return self.envelope(status, output, response_usage(result), incomplete=incomplete)


class ResponseEvents:
    """A streamed response's events, from the chat deltas of its choice: each output item
    opened when its first text (or call) arrives and closed when another kind follows or
    the response ends."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item taking text now: {"kind", "index", "id", "text", "logprobs"}

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps(data) + b"\n\n"

    def start(self) -> list[bytes]:
        head = self.shape.envelope("in_progress", [])
        return [self.event("response.created", response=head), self.event("response.in_progress", response=head)]

    def delta(self, body: dict[str, Any], logprobs: Any) -> list[bytes]:
        """The events of one chat delta's ``reasoning_content``, ``content`` and ``tool_calls``."""
        out: list[bytes] = []
        if body.get("reasoning_content"):
            out += self._text("reasoning", body["reasoning_content"], None)
        if body.get("content"):
            out += self._text("message", body["content"], (logprobs or {}).get("content"))
        for call in body.get("tool_calls") or []:
            out += self._close("completed") + self._call(call)
        return out

    def _text(self, kind: str, text: str, logprobs: list[Any] | None) -> list[bytes]:
        out: list[bytes] = []
        if self.open is not None and self.open["kind"] != kind:
            out += self._close("completed")
        if self.open is None:
            out += self._open(kind)
        item = self.open
        assert item is not None
        item["text"] += text
        item["logprobs"] += logprobs or []
        where = {"item_id": item["id"], "output_index": item["index"], "content_index": 0}
        if kind == "message":
            out.append(self.event("response.output_text.delta", **where, delta=text, logprobs=logprobs or []))
        else:
            out.append(self.event("response.reasoning_text.delta", **where, delta=text))
        return out

    def _open(self, kind: str) -> list[bytes]:
        index, item_id = len(self.output), _id("msg" if kind == "message" else "rs")
        self.open = {"kind": kind, "index": index, "id": item_id, "text": "", "logprobs": []}
        shell = self._item("in_progress")
        shell["content"] = []
        self.output.append(shell)
        part = {"type": "output_text", "text": "", "annotations": []} if kind == "message" else {"type": "reasoning_text", "text": ""}
        return [
            self.event("response.output_item.added", output_index=index, item=shell),
            self.event("response.content_part.added", item_id=item_id, output_index=index, content_index=0, part=part),
        ]

    def _item(self, status: str) -> dict[str, Any]:
        item = self.open
        assert item is not None
        if item["kind"] == "message":
            return message_item(item["id"], item["text"], status, item["logprobs"])
        return reasoning_item(item["id"], item["text"], status)

    def _close(self, status: str) -> list[bytes]:
        item = self.open
        if item is None:
            return []
        done = self._item(status)
        self.output[item["index"]] = done
        where = {"item_id": item["id"], "output_index": item["index"], "content_index": 0}
        if item["kind"] == "message":
            text_done = self.event("response.output_text.done", **where, text=item["text"], logprobs=item["logprobs"])
        else:
            text_done = self.event("response.reasoning_text.done", **where, text=item["text"])
        self.open = None
        return [
            text_done,
            self.event("response.content_part.done", **where, part=done["content"][0]),
            self.event("response.output_item.done", output_index=item["index"], item=done),
        ]

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        index, item_id = len(self.output), _id("fc")
        done = call_item(item_id, call)
        self.output.append(done)
        args = done["arguments"]
        return [
            self.event("response.output_item.added", output_index=index, item=call_item(item_id, call, "in_progress", "")),
            self.event("response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=args),
            self.event("response.function_call_arguments.done", item_id=item_id, output_index=index, name=done["name"], arguments=args),
            self.event("response.output_item.done", output_index=index, item=done),
        ]

    def finish(self, finish_reason: str | None, result: Any) -> list[bytes]:
        incomplete = finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        out = self._close(status)
        whole = self.shape.envelope(status, self.output, response_usage(result), incomplete=incomplete)
        return [*out, self.event("response.incomplete" if incomplete else "response.completed", response=whole)]

    def failed(self, status: int, body: dict[str, Any]) -> list[bytes]:
        """An error after the stream started: the ``error`` event, then ``response.failed``."""
        err = body["error"]
        code = err.get("code") or ("server_error" if status >= 500 else "invalid_request_error")
        out = self._close("incomplete")
        failed = self.shape.envelope("failed", self.output, error={"code": code, "message": err["message"]})
        return [*out, self.event("error", code=code, message=err["message"], param=err.get("param")),
                self.event("response.failed", response=failed)]


# ---------------------------------------------------------------- the route


def add_responses_route(app: FastAPI, server: ChatServer) -> None:
    """``POST /v1/responses`` on ``app``, served by ``server``'s chat pipeline."""

    async def create(body: ResponsesRequest, request: Request) -> Response:
        request.state.client_names = names = responses_names()
        wrong = server.check_model(body.model)
        if wrong is not None:
            return wrong
        handle, ctx = await server.submit_chat(body.chat_request())
        shape = ResponseShape(body, server.model_name)
        if not body.stream:
            completed, results = await until_disconnect(request, server.results([handle]))
            if not completed:
                return Response(status_code=499)
            result = combined_result(results, 1)
            return JSONResponse(shape.whole(ctx.response(result)["choices"][0], result))
        deltas = merged_deltas([server.metrics.observe(handle)], 1)
        try:
            first = await deltas.__anext__()
        except StopAsyncIteration:
            first = None
        except BaseException:
            await deltas.aclose()
            raise
        return StreamingResponse(_events(server, handle, ctx, ResponseEvents(shape), deltas, first, names), media_type="text/event-stream")

    app.post("/v1/responses", response_model=None)(create)


async def _events(
    server: ChatServer, handle: Any, ctx: ResponseContext, events: ResponseEvents, deltas: AsyncIterator[Any], first: Any,
    names: ClientNames,
) -> AsyncIterator[bytes]:
    """The stream: created, the output's events as the deltas come, completed (or failed)."""
    try:
        for frame in events.start():
            yield frame
        finished, delta = False, first
        while delta is not None:
            finished = finished or delta.finished
            choice = ctx.delta_choice(delta)
            if choice is not None:
                for frame in events.delta(choice["delta"], choice.get("logprobs")):
                    yield frame
            delta = await anext(deltas, None)
        result = combined_result([await handle.result()], 1)
        reason = result.outputs[0].finish_reason if result.outputs else result.finish_reason
        if not finished:
            for frame in events.delta(ctx.final_choice(0, reason)["delta"], None):
                yield frame
        for frame in events.finish(reason, result):
            yield frame
    except errors.OmniAsyncError as exc:  # after the headers: reported in the stream
        for frame in events.failed(*body_of(server.answerable(exc), names)):
            yield frame
    except Exception as exc:  # a bug still ends the stream with its events
        log.error("server_stream_failed", error=repr(exc))
        for frame in events.failed(500, error_body(f"internal server error: {type(exc).__name__}", 500)):
            yield frame
    finally:
        await deltas.aclose()
