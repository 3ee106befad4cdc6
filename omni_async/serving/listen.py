"""The server's listening socket, made before anything loads: ``omni-async serve`` and
``serve-ray`` refuse a port in use at once, as a ConfigError, instead of after the model
has loaded (which is where uvicorn and Ray's proxy would find it). No FastAPI, uvicorn or
Ray import here, so the check runs whatever extra is installed."""

from __future__ import annotations

import socket

from .. import errors

__all__ = ["base_url", "listening_socket"]


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``, made before anything loads so that a port in use
    is a ConfigError at once (uvicorn would find it only after the model loaded)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)
        raise errors.ConfigError(f"cannot listen on {host}:{port}: {reason} (another process has the port? choose one with --port)") from None
    return sock


def base_url(sock: socket.socket) -> str:
    """``http://HOST:PORT`` of a bound socket."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
