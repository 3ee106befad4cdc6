"""Incremental detokenisation: one decoder per completion, fed one token at a time.

Decoding each delta on its own is wrong for real tokenizers: a Metaspace tokenizer drops
the space a token starts with, and a ByteLevel one splits multi-byte characters across
tokens. A streaming decoder keeps the context it needs and returns text only once it is
complete, so the joined chunks equal the decode of the whole sequence; the final flush
(``finish_text``) reconciles against that full decode, which is also the result's text.
"""

from __future__ import annotations

import codecs
from typing import Protocol

from .logs import log


class IncrementalDecoder(Protocol):
    def step(self, token_id: int) -> str:
        """The text this token completes ('' while a character is still partial)."""
        ...


class ByteStreamDecoder:
    """For :class:`~omni_async.tokenizer.ByteTokenizer`: ids 0..255 are UTF-8 bytes,
    anything else is special and has no text. Python's incremental UTF-8 decoder gives
    exactly what a one-shot ``bytes.decode(errors="replace")`` gives."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id: int) -> str:
        if 0 <= token_id < 256:
            return self._utf8.decode(bytes((token_id,)))
        return ""


class HFStreamDecoder:
    """The ``tokenizers`` library's own streaming decoder (``decoders.DecodeStream``)."""

    def __init__(self, tokenizer: object, skip_special_tokens: bool) -> None:
        from tokenizers.decoders import DecodeStream

        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tok, int(token_id)) or ""


def finish_text(emitted: str, full: str, request_id: str) -> str:
    """What is left to emit once the sequence is complete: the part of the full decode
    after what was already streamed (a partial character at the very end, say)."""
    if full.startswith(emitted):
        return full[len(emitted):]
    # A decoder whose incremental output is not a prefix of its full decode: the stream
    # cannot take text back, so say so; the result still carries the full decode.
    log.warning("detokenize_mismatch", request_id=request_id, emitted=emitted[-40:], full=full[-40:])
    return ""
