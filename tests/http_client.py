"""A plain GET against a real server on 127.0.0.1, from async tests: the status and body,
HTTP errors included (the metrics, health and error-body checks read both)."""

from __future__ import annotations

import urllib.error
import urllib.request

import anyio


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def http_get(url: str) -> tuple[int, str]:
    """:func:`get` in a worker thread (the server runs in the test's event loop)."""
    return await anyio.to_thread.run_sync(get, url)
