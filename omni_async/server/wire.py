"""JSON on the wire, on the hot paths: request bodies in, SSE chunks out.

Request bodies (a prompt of a thousand token ids is a long JSON list) are parsed with
``orjson`` when it is installed, through the route class :class:`FastJsonRoute`.

Every chunk of one response shares its envelope (``id``, ``object``, ``created``,
``model``): it is serialised once per response and each chunk adds only its choices, so a
token costs one small serialisation instead of a whole object's. ``orjson`` serialises
when it is installed (the ``serve`` extra), the standard library otherwise; both write
UTF-8 as is and compact separators. (A non-finite float, which JSON cannot carry, is
``null`` with orjson.)
"""

from __future__ import annotations

import json
from typing import Any, Callable

from fastapi import Request
from fastapi.routing import APIRoute

try:
    import orjson

    dumps: Callable[[Any], bytes] = orjson.dumps
    loads: Callable[[bytes], Any] = orjson.loads  # its error is a json.JSONDecodeError
except ImportError:  # pragma: no cover - the serve extra installs it

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()

    loads = json.loads


class _FastJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads(await self.body())
        return self._json


class FastJsonRoute(APIRoute):
    """A route whose JSON body is parsed by :func:`loads` (FastAPI validates it as usual)."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Any:
            return await handler(_FastJsonRequest(request.scope, request.receive))

        return route


DONE = b"data: [DONE]\n\n"


def event(obj: Any) -> bytes:
    """One SSE event carrying ``obj``."""
    return b"data: " + dumps(obj) + b"\n\n"


class ChunkFrames:
    """The SSE events of one streamed response (``chat.completion.chunk`` or
    ``text_completion``), its envelope serialised once."""

    def __init__(self, id: str, object: str, created: int, model: str) -> None:
        envelope = dumps({"id": id, "object": object, "created": created, "model": model})
        self.head = b"data: " + envelope[:-1] + b',"choices":['

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        body = b",".join(map(dumps, choices))
        if usage is None:
            return self.head + body + b"]}\n\n"
        return self.head + body + b'],"usage":' + dumps(usage) + b"}\n\n"

    def text(self, index: int, text: str) -> bytes:
        """A completion's plain text delta (no logprobs, not finished): the hot path."""
        return self.head + b'{"index":%d,"text":%s,"finish_reason":null,"logprobs":null}]}\n\n' % (index, dumps(text))
