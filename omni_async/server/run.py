"""Run the app on uvicorn: for the command line (:func:`serve`) and for tests or
applications that want a server for the length of a block (:func:`running_server`).

:func:`serve` stops as an operator expects on SIGINT or SIGTERM (Ctrl-C, docker,
systemd): it closes the engine at once, which ends every open request with a terminal
message (a stream's error event and ``[DONE]``, a whole response's 503 body), so the
connections close and the process exits within seconds. uvicorn alone would wait for
every stream to run to its end, and its second Ctrl-C cancels tasks mid-flight (tracebacks,
streams cut without ``[DONE]``); here any later signal is absorbed by the stop already under
way.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import signal
import socket
import threading
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterator, Union

import uvicorn

from ..engine import Engine
from ..logs import log
from ..serving.listen import base_url, listening_socket
from ..speech import SpeechPipeline
from .app import create_app
from .speech import create_speech_app

if TYPE_CHECKING:
    from ..speech.omni_pipeline import OmniPipeline

# How long the stop waits for the engine to close before it gives up on a clean close,
# and how long uvicorn then waits for connections (a client that reads nothing) to end.
STOP_ENGINE_S = 3.0
STOP_CONNECTIONS_S = 1.5


def http_protocol() -> str:
    """uvicorn's HTTP implementation: httptools (C; the serve extra installs it) when it
    imports, h11 (pure Python) otherwise. Every streamed chunk and every request body
    passes through it on the loop the engine shares, so the choice is made here, in one
    place, rather than left to whatever happens to be installed."""
    return "httptools" if importlib.util.find_spec("httptools") is not None else "h11"


Served = Union[Engine, SpeechPipeline, "OmniPipeline"]


def _app(served: Served, **app_kw: Any) -> Any:
    """The app for what is served: the speech app for a Qwen3-TTS pipeline; the OpenAI
    app for an engine, or for a Qwen3-Omni pipeline's thinker with audio out."""
    if isinstance(served, SpeechPipeline):
        return create_speech_app(served, **app_kw)
    if isinstance(served, Engine):
        return create_app(served, **app_kw)
    return create_app(served.thinker, omni=served, **app_kw)


def _engine(served: Served) -> Engine:
    """The engine a signal's stop counts open requests of and closes first."""
    if isinstance(served, SpeechPipeline):
        return served.engine
    return served if isinstance(served, Engine) else served.thinker


def _config(engine: Served, *, host: str, port: int, log_level: str, quiet: bool, **app_kw: Any) -> uvicorn.Config:
    app = _app(engine, **app_kw)
    kw: dict[str, Any] = {"log_config": None} if quiet else {}
    return uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(), lifespan="on", http=http_protocol(), **kw)


class StoppingServer(uvicorn.Server):
    """uvicorn's server with the stop :func:`serve` promises: the first SIGINT or SIGTERM
    marks the app as stopping, counts the engine's open requests and closes the engine,
    then lets uvicorn shut down; later signals change nothing. Signals are not raised again
    after the stop (uvicorn's does, which turns a clean stop into a KeyboardInterrupt)."""

    def __init__(self, config: uvicorn.Config, engine: Engine, on_ready: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.engine = engine
        self.on_ready = on_ready
        self.aborted = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)
        if self._stop is not None:
            await self._stop

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit and self.on_ready is not None:
            self.on_ready()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        """A signal handler: hand the stop to the loop (it runs between the loop's callbacks)."""
        if self._loop is None:
            self.should_exit = True
        else:
            self._loop.call_soon_threadsafe(self._begin_stop, sig)

    def _begin_stop(self, sig: int) -> None:
        if self._stop is not None:
            return  # already stopping
        log.info("server_signal", signal=signal.Signals(sig).name)
        if not self.started:  # still starting: uvicorn shuts down once startup returns
            self.should_exit = True
            return
        self._stop = asyncio.get_running_loop().create_task(self._stop_serving(), name="omni-async-stop")

    async def _stop_serving(self) -> None:
        server = getattr(self.config.app.state, "server", None)  # type: ignore[union-attr]
        if server is not None:  # the OpenAI app: a request the stop aborted says so
            server.stopping = True
        self.aborted = len(self.engine.open_requests)
        try:
            await asyncio.wait_for(self.engine.aclose(), STOP_ENGINE_S)
        except Exception as exc:  # a close that fails or hangs must not keep the process up
            log.error("server_stop_close_failed", error=repr(exc))
            self.force_exit = True
        self.should_exit = True


async def serve(
    engine: Served, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
    sock: socket.socket | None = None, on_ready: Callable[[str, str], None] | None = None, **app_kw: Any,
) -> int:
    """Serve until SIGINT or SIGTERM, then stop (the module's docstring) and return how many
    open requests the stop aborted. A :class:`~omni_async.speech.SpeechPipeline` is served
    by the speech app (the stop closes its talker's engine first), a Qwen3-Omni
    :class:`~omni_async.speech.omni_pipeline.OmniPipeline` by the OpenAI app with audio out
    (the stop closes its thinker first, the app's shutdown the rest). ``sock``: a socket
    already bound (``listening_socket``), in place of ``host``/``port``;
    ``on_ready(url, model_name)`` is called once the server accepts requests."""
    sock = sock if sock is not None else listening_socket(host, port)
    config = _config(engine, host=host, port=sock.getsockname()[1], log_level=log_level, quiet=False, **app_kw)
    config.timeout_graceful_shutdown = STOP_CONNECTIONS_S
    app = config.app

    def ready() -> None:
        if on_ready is not None:
            on_ready(base_url(sock), app.state.model_name)  # type: ignore[union-attr]

    server = StoppingServer(config, _engine(engine), ready)
    try:
        await server.serve(sockets=[sock])
    finally:
        sock.close()
    return server.aborted


@contextlib.asynccontextmanager
async def running_server(engine: Served, *, host: str = "127.0.0.1", port: int = 0, **app_kw: Any) -> AsyncIterator[str]:
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
