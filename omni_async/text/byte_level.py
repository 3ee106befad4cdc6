"""The byte-level BPE alphabet (GPT-2's): every byte as one printable character, so a
token's text in a byte-level vocabulary spells its bytes. Tokenizers built from GGUF
metadata, the grammar library's vocabulary and the test checkpoints all read it here."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """byte -> character: printable bytes stand for themselves, the others take code points
    from 256 up, in byte order."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


@lru_cache(maxsize=1)
def byte_of_char() -> dict[str, int]:
    """character -> byte: the inverse of :func:`byte_alphabet`."""
    return {c: b for b, c in byte_alphabet().items()}
