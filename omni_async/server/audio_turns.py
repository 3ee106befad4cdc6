"""Spoken replies kept for a conversation's next turn (OpenAI's multi-turn audio chat).

A spoken reply's ``message.audio`` has an ``id`` and an ``expires_at``; a client continues
the conversation by sending the assistant's turn back as ``{"role": "assistant", "audio":
{"id": ...}}`` in place of its content. The model never hears its own audio again: what
the thinker reads of an earlier turn of its own is that turn's text, as Qwen3-Omni's
reference renders a conversation (an assistant turn is its text in the chat template).
So the server keeps, per reply, its transcript, and a turn that refers to it by id is
rendered with the transcript as its content: the prompt is the one the same conversation
written out in text gives.

The store is bounded twice: a reply is forgotten at its ``expires_at`` (the time the
reply said, ``ttl_s`` after it ended) and, past ``max_turns`` replies, the oldest first. A
turn that names an id the store does not hold (never given, expired or pushed out) is the
client's mistake: a 400 on that request, naming the message.
"""

from __future__ import annotations

import collections
import time
from typing import Callable

from .chat_messages import ChatMessage
from .errors import invalid

__all__ = ["AudioTurns", "DEFAULT_MAX_TURNS", "DEFAULT_TTL_S"]

DEFAULT_TTL_S = 3600  # an hour, as OpenAI keeps a reply's audio
DEFAULT_MAX_TURNS = 4096


class AudioTurns:
    """The transcripts of the spoken replies a server gave, by audio id. ``clock``: the
    wall clock in seconds (``expires_at`` is a Unix time); tests pass their own."""

    def __init__(self, *, max_turns: int = DEFAULT_MAX_TURNS, ttl_s: int = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.time) -> None:
        if max_turns < 1 or ttl_s < 1:
            raise ValueError("AudioTurns needs max_turns >= 1 and ttl_s >= 1")
        self.max_turns, self.ttl_s, self.clock = max_turns, ttl_s, clock
        # audio id -> (transcript, expires_at), oldest first: with one ttl_s, the order
        # kept is also the order of expiry.
        self._turns: collections.OrderedDict[str, tuple[str, int]] = collections.OrderedDict()

    def __len__(self) -> int:
        self._forget_expired()
        return len(self._turns)

    def keep(self, audio_id: str, transcript: str) -> int:
        """Keep a reply that has just ended; its ``expires_at`` (what the reply says)."""
        expires_at = int(self.clock()) + self.ttl_s
        self._forget_expired()
        self._turns[audio_id] = (transcript, expires_at)
        self._turns.move_to_end(audio_id)
        while len(self._turns) > self.max_turns:
            self._turns.popitem(last=False)
        return expires_at

    def transcript(self, audio_id: str) -> str | None:
        """The kept reply's transcript, or None (never given, expired, or pushed out)."""
        self._forget_expired()
        kept = self._turns.get(audio_id)
        return None if kept is None else kept[0]

    def _forget_expired(self) -> None:
        now = self.clock()
        while self._turns:
            audio_id, (_, expires_at) = next(iter(self._turns.items()))
            if now < expires_at:
                return
            del self._turns[audio_id]

    def resolve(self, messages: list[ChatMessage]) -> list[ChatMessage]:
        """The conversation with every assistant turn that refers to an earlier reply's
        audio written as that reply's transcript; InvalidRequestError (400) names a turn
        whose id is not kept, or one that gives content as well. Other messages pass
        unchanged (a user message with ``audio`` is refused later, as on any server)."""
        return [self._resolved(i, m) if m.audio is not None and m.role == "assistant" else m for i, m in enumerate(messages)]

    def _resolved(self, i: int, message: ChatMessage) -> ChatMessage:
        where = f"messages[{i}].audio"
        audio_id = (message.audio or {}).get("id")
        if not isinstance(audio_id, str) or not audio_id:
            raise invalid(f"{where}.id: an assistant turn's audio names the earlier reply by its id (a string)", f"{where}.id")
        if message.content:
            raise invalid(f"messages[{i}]: an assistant turn is its content or an earlier reply's audio, not both", f"messages[{i}].content")
        transcript = self.transcript(audio_id)
        if transcript is None:
            raise invalid(f"{where}.id: no spoken reply {audio_id!r} is kept here (unknown, expired at its expires_at, or one of more "
                          f"than the {self.max_turns} latest); send its transcript as content", f"{where}.id")
        return message.model_copy(update={"content": transcript, "audio": None})
