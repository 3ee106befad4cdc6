"""The raw bytes of every token id: what a grammar library needs to know of our tokenizer.

A grammar constrains *text*; to turn it into a mask over token ids the library must know the
bytes each token stands for. Our tokenizers are the built-in byte-level one and
``tokenizers.Tokenizer`` objects (a folder's ``tokenizer.json``, or one rebuilt from GGUF
metadata), whose pieces are spelled in one of two ways: GPT-2's byte alphabet (a ByteLevel
decoder) or sentencepiece's ``▁``-for-space with ``<0xNN>`` byte-fallback pieces. Both are
undone here once per tokenizer, so every library sees the same plain byte vocabulary.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import InvalidRequestError
from ..text.byte_level import byte_of_char
from ..text.tokenizer import ByteTokenizer, HFTokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class TokenVocab:
    """Bytes per token id (``vocab_size`` entries; ids past the tokenizer's own are
    padding that no grammar admits), the special ids (never text), the end-of-sequence
    ids that end a complete grammar, and an encoder for text the grammar forces."""

    token_bytes: tuple[bytes, ...]
    special_ids: frozenset[int]
    eos_ids: tuple[int, ...]
    encode: Callable[[str], list[int]]

    @property
    def size(self) -> int:
        return len(self.token_bytes)


def token_vocab(tokenizer: Any, vocab_size: int) -> TokenVocab:
    """The vocabulary of ``tokenizer`` padded to the model's ``vocab_size``."""
    if tokenizer is None:
        raise InvalidRequestError("constrained decoding (json_schema, regex, ebnf) needs a tokenizer; this model has none")
    if isinstance(tokenizer, ByteTokenizer):
        return _byte_vocab(tokenizer, vocab_size)
    if isinstance(tokenizer, HFTokenizer):
        return _hf_vocab(tokenizer, vocab_size)
    raise InvalidRequestError(f"constrained decoding does not know the tokenizer type {type(tokenizer).__name__}")


def _byte_vocab(tok: ByteTokenizer, vocab_size: int) -> TokenVocab:
    pieces = [bytes([i]) for i in range(256)] + [b""] * (vocab_size - 256)
    special = frozenset(range(256, vocab_size))
    return TokenVocab(tuple(pieces[:vocab_size]), special, tuple(tok.eos_token_ids),
                      lambda text: tok.encode(text, add_special_tokens=False))


def _hf_vocab(tok: HFTokenizer, vocab_size: int) -> TokenVocab:
    backend = tok.backend
    spec = json.loads(backend.to_str())
    to_bytes = _byte_level_piece if _uses_byte_level(spec.get("decoder")) else _metaspace_piece
    added = spec.get("added_tokens", [])
    special = {int(t["id"]) for t in added if t.get("special")}
    plain = {int(t["id"]) for t in added if not t.get("special")}  # stored as plain text
    pieces: list[bytes] = []
    for i in range(vocab_size):
        piece = backend.id_to_token(i)
        if piece is None or i in special:
            special.add(i)
            pieces.append(b"")
            continue
        pieces.append(piece.encode("utf-8") if i in plain else to_bytes(piece))
    return TokenVocab(tuple(pieces), frozenset(special), tuple(tok.eos_token_ids),
                      lambda text: tok.encode(text, add_special_tokens=False))


def _uses_byte_level(decoder: Any) -> bool:
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_uses_byte_level(d) for d in decoder.get("decoders", []) or [])


_BYTE_OF = byte_of_char()


def _byte_level_piece(piece: str) -> bytes:
    try:
        return bytes(_BYTE_OF[ch] for ch in piece)
    except KeyError:  # a piece outside the alphabet is spelled in plain UTF-8
        return piece.encode("utf-8")


def _metaspace_piece(piece: str) -> bytes:
    m = _BYTE_PIECE.fullmatch(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    return piece.replace("▁", " ").encode("utf-8")
