"""Tokenizers: the built-in byte-level one, and a folder's own ``tokenizer.json``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .models.config import ModelConfig


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS and EOS; the vocabulary is padded to 320."""

    BOS = 256
    EOS = 257
    VOCAB_SIZE = 320

    vocab_size = VOCAB_SIZE
    eos_token_ids = (EOS,)

    def encode(self, text: str) -> list[int]:
        return [self.BOS, *text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` package."""

    def __init__(self, path: Path, eos_token_ids: tuple[int, ...], vocab_size: int) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(folder: Path, cfg: "ModelConfig") -> Tokenizer | None:
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    return HFTokenizer(path, cfg.eos_token_ids, cfg.vocab_size)
