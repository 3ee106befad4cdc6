"""Ctrl-C and SIGTERM noted while ``omni-async serve`` loads its model, to be acted on once
the load is done: the load runs in a thread, and asyncio's own Ctrl-C handling would
cancel the task that waits for it, a cancellation that is then lost."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Iterator

__all__ = ["signals_noted"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_noted() -> Iterator[asyncio.Event]:
    """SIGINT and SIGTERM set the event instead of interrupting, on the running loop."""
    loop = asyncio.get_running_loop()
    noted = asyncio.Event()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, noted.set)
    try:
        yield noted
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
