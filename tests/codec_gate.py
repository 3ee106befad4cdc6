"""A real codec decoder whose calls a test can hold: the Qwen3-TTS decoder (any config), whose
next forward matching a hold waits on the calling thread (a codec lane's worker) until the
test lets it go. Tests of the codec stage's lanes use it to act while a call is in flight,
deterministically, without measuring time."""

from __future__ import annotations

import asyncio
import threading
from typing import Callable

import torch

from omni_async.speech.codec import CodecDecoder
from omni_async.speech.codec_config import CodecConfig

WAIT_S = 20.0  # a bound on waits for what the stage should do at once (never reached when it works)


async def eventually(check: Callable[[], bool]) -> None:
    """Until ``check()`` holds, looking every 10 ms, at most ``WAIT_S`` (the caller then
    asserts what it waited for)."""
    for _ in range(int(WAIT_S / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)


class Hold:
    """One held decoder call: ``entered`` once the call waits, ``release()`` lets it run."""

    def __init__(self, when: Callable[[torch.Tensor], bool]) -> None:
        self.when = when
        self.entered = threading.Event()
        self.opened = threading.Event()

    def release(self) -> None:
        self.opened.set()

    async def wait_entered(self) -> bool:
        return await asyncio.to_thread(self.entered.wait, WAIT_S)


class GatedDecoder(CodecDecoder):
    """The codec decoder, whose next forward matching a hold waits (on the calling
    lane's thread) until the test releases it."""

    def __init__(self, config: CodecConfig) -> None:
        super().__init__(config)
        self._holds: list[Hold] = []
        self._lock = threading.Lock()

    def hold(self, when: Callable[[torch.Tensor], bool] = lambda codes: True) -> Hold:
        held = Hold(when)
        with self._lock:
            self._holds.append(held)
        return held

    def forward(self, codes: torch.Tensor, past: list[torch.Tensor], position: torch.Tensor):
        with self._lock:
            held = next((h for h in self._holds if h.when(codes)), None)
            if held is not None:
                self._holds.remove(held)
        if held is not None:
            held.entered.set()
            held.opened.wait(60)
        return super().forward(codes, past, position)
