"""Run the app on uvicorn: for the command line (:func:`serve`) and for tests or
applications that want a server for the length of a block (:func:`running_server`)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import socket
from typing import Any, AsyncIterator

import uvicorn

from ..engine import Engine
from ..speech import SpeechPipeline
from .app import create_app
from .speech import create_speech_app


def http_protocol() -> str:
    """uvicorn's HTTP implementation: httptools (C; the serve extra installs it) when it
    imports, h11 (pure Python) otherwise. Every streamed chunk and every request body
    passes through it on the loop the engine shares, so the choice is made here, in one
    place, rather than left to whatever happens to be installed."""
    return "httptools" if importlib.util.find_spec("httptools") is not None else "h11"


def _config(engine: Engine | SpeechPipeline, *, host: str, port: int, log_level: str, quiet: bool, **app_kw: Any) -> uvicorn.Config:
    app = create_speech_app(engine, **app_kw) if isinstance(engine, SpeechPipeline) else create_app(engine, **app_kw)
    kw: dict[str, Any] = {"log_config": None} if quiet else {}
    return uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(), lifespan="on", http=http_protocol(), **kw)


async def serve(engine: Engine | SpeechPipeline, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", **app_kw: Any) -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM); the engine is closed at the end. A
    :class:`~omni_async.speech.SpeechPipeline` is served by the speech app."""
    server = uvicorn.Server(_config(engine, host=host, port=port, log_level=log_level, quiet=False, **app_kw))
    await server.serve()


@contextlib.asynccontextmanager
async def running_server(engine: Engine | SpeechPipeline, *, host: str = "127.0.0.1", port: int = 0, **app_kw: Any) -> AsyncIterator[str]:
    """Serve ``engine`` on ``host`` (a free port unless given) inside this block, in the
    current event loop; yields the base URL (``http://127.0.0.1:PORT``). The server shuts
    down at the end of the block (and closes the engine unless ``close_engine=False``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(_config(engine, host=host, port=sock.getsockname()[1], log_level="warning", quiet=True, **app_kw))
    task = asyncio.create_task(server.serve(sockets=[sock]), name="omni-async-http")
    try:
        while not server.started:
            if task.done():
                task.result()  # startup failed: raise why
                raise RuntimeError("the HTTP server stopped during startup")
            await asyncio.sleep(0.01)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()
