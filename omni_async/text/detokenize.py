"""Incremental detokenisation: one decoder per completion, fed one token at a time.

Decoding each delta on its own is wrong for real tokenizers: a Metaspace tokenizer drops
the space a token starts with, and a ByteLevel one splits multi-byte characters across
tokens. A streaming decoder keeps the context it needs and returns text only once it is
complete, so the joined chunks equal the decode of the whole sequence; the final flush
(``finish_text``) reconciles against that full decode, which is also the result's text.
"""

from __future__ import annotations

import codecs
from typing import Callable, Protocol

from ..logs import log

REPLACEMENT = "\ufffd"
# The most two-token windows a tokenizer's decoders keep decoded (WindowDecoder; ~100 B each).
PAIRS_KEPT = 1 << 17


class IncrementalDecoder(Protocol):
    def step(self, token_id: int) -> str:
        """The text this token completes ('' while a character is still partial)."""
        ...


class ByteStreamDecoder:
    """For :class:`~omni_async.text.tokenizer.ByteTokenizer`: ids 0..255 are UTF-8 bytes,
    anything else is special and has no text. Python's incremental UTF-8 decoder gives
    exactly what a one-shot ``bytes.decode(errors="replace")`` gives."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id: int) -> str:
        if 0 <= token_id < 256:
            return self._utf8.decode(bytes((token_id,)))
        return ""


class WindowDecoder:
    """Streaming decode for any tokenizer with a ``decode(ids, skip_special_tokens)``.

    A token is *clean* when it decodes on its own without U+FFFD: it starts on a
    character boundary and ends on one. Text is emitted only when a clean token arrives:
    the window from the previous clean token (whose text is the context that
    context-dependent decoders need, such as Metaspace's leading space) to this one is
    decoded, and what it adds beyond the context is emitted. Tokens in between (partial
    UTF-8 characters, byte-fallback ``<0xNN>`` runs, which a later byte can still turn
    into replacement characters) are held until then, and the end-of-request flush
    gives whatever is still held. The emitted text is therefore always a prefix of the
    decode of the whole sequence (tests check it on random token sequences).

    (``tokenizers.decoders.DecodeStream`` raises on byte sequences that are not valid
    UTF-8, which random-weight models produce, hence this decoder.)
    """

    def __init__(self, tokenizer: object, skip_special_tokens: bool, clean: Callable[[int], str | None],
                 pairs: dict[int, str] | None = None) -> None:
        self._decode = tokenizer.decode  # type: ignore[attr-defined]
        self._skip = skip_special_tokens
        self._clean = clean
        self._ids: list[int] = []
        self._start = 0  # the window is ids[start:]
        self._context = ""  # the text of ids[start] alone, already emitted
        # Windows of two tokens (a clean token after a clean token: most of them) decoded
        # before, shared by the tokenizer's decoders: a dict look-up instead of a decode
        # call (~1 us a token; the decode of given ids is always the same text).
        self._pairs = pairs

    def step(self, token_id: int) -> str:
        token_id = int(token_id)
        ids = self._ids
        ids.append(token_id)
        alone = self._clean(token_id)  # the token's own text when it is clean, else None
        if alone is None:
            return ""
        pairs = self._pairs
        if pairs is not None and len(ids) - self._start == 2:
            key = (ids[-2] << 32) + (token_id & 0xFFFFFFFF)  # an int: a tuple key would be an object for the GC
            window = pairs.get(key)
            if window is None:
                window = self._decode(ids[-2:], skip_special_tokens=self._skip)
                if len(pairs) >= PAIRS_KEPT:
                    pairs.clear()
                pairs[key] = window
        else:
            window = self._decode(ids[self._start:], skip_special_tokens=self._skip)
        out = window[len(self._context):] if window.startswith(self._context) else ""
        self._start = len(self._ids) - 1
        self._context = alone
        return out


def finish_text(emitted: str, full: str, request_id: str) -> str:
    """What is left to emit once the sequence is complete: the part of the full decode
    after what was already streamed (a partial character at the very end, say)."""
    if full.startswith(emitted):
        return full[len(emitted):]
    # A decoder whose incremental output is not a prefix of its full decode: the stream
    # cannot take text back, so say so; the result still carries the full decode.
    log.warning("detokenize_mismatch", request_id=request_id, emitted=emitted[-40:], full=full[-40:])
    return ""
