"""Tokenizers: the built-in byte-level one, and a folder's own ``tokenizer.json``.

Besides encode/decode, a tokenizer carries what text serving needs: a streaming decoder
per completion (``decode_stream``), the checkpoint's chat template and the special-token
strings that template refers to (``bos_token``, ``eos_token``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .detokenize import REPLACEMENT, ByteStreamDecoder, IncrementalDecoder, WindowDecoder

if TYPE_CHECKING:
    import tokenizers

    from ..models.config import ModelConfig

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# The built-in model's template: plain role markers, so chat works out of the box.
BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def decode_stream(self, skip_special_tokens: bool = True) -> IncrementalDecoder: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS and EOS; the vocabulary is padded to 320.
    BOS and EOS have no text form, so ``skip_special_tokens`` changes nothing."""

    BOS = 256
    EOS = 257
    VOCAB_SIZE = 320

    vocab_size = VOCAB_SIZE
    eos_token_ids = (EOS,)
    chat_template: str | None = BYTE_CHAT_TEMPLATE
    bos_token: str | None = None
    eos_token: str | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        body = list(text.encode("utf-8"))
        return [self.BOS, *body] if add_special_tokens else body

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def decode_stream(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return ByteStreamDecoder()


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (from a folder's ``tokenizer.json``, or built by a
    loader from other metadata through :meth:`from_object`)."""

    def __init__(self, path: Path, eos_token_ids: tuple[int, ...], vocab_size: int) -> None:
        from tokenizers import Tokenizer as _Tok

        self._init(_Tok.from_file(str(path)), eos_token_ids, vocab_size, None, None, None)

    @classmethod
    def from_object(
        cls,
        tokenizer: "tokenizers.Tokenizer",
        *,
        eos_token_ids: tuple[int, ...] | list[int],
        vocab_size: int,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> "HFTokenizer":
        """Wrap a tokenizer built in memory (a stable constructor for other loaders)."""
        self = cls.__new__(cls)
        self._init(tokenizer, tuple(eos_token_ids), vocab_size, chat_template, bos_token, eos_token)
        return self

    def _init(self, tok: Any, eos_ids: tuple[int, ...], vocab_size: int, template: str | None, bos: str | None, eos: str | None) -> None:
        self._tok = tok
        self.eos_token_ids = tuple(eos_ids)
        self.vocab_size = vocab_size
        self.chat_template = template
        self.bos_token = bos
        self.eos_token = eos
        self.special_tokens: dict[str, str] = {}  # other names a template may use (unk_token, pad_token)
        self._clean: dict[bool, dict[int, str | None]] = {True: {}, False: {}}
        self._pairs: dict[bool, dict[int, str]] = {True: {}, False: {}}  # (WindowDecoder)

    @property
    def backend(self) -> "tokenizers.Tokenizer":
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        cache = self._clean[bool(skip_special_tokens)]

        def clean(token_id: int) -> str | None:
            """The token's text alone when it is a clean boundary, else None (cached). A
            skipped special token (no text) is not a boundary, nor is a byte-fallback
            token: a later byte of its run can still make it invalid."""
            if token_id in cache:
                return cache[token_id]
            text = self._tok.decode([token_id], skip_special_tokens=skip_special_tokens)
            piece = self._tok.id_to_token(token_id) or ""
            ok = bool(text) and REPLACEMENT not in text and not _BYTE_PIECE.fullmatch(piece)
            cache[token_id] = text if ok else None
            return cache[token_id]

        return WindowDecoder(self, skip_special_tokens, clean, self._pairs[bool(skip_special_tokens)])


def load_tokenizer(folder: Path, cfg: "ModelConfig") -> Tokenizer | None:
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    tok = HFTokenizer(path, cfg.eos_token_ids, cfg.vocab_size)
    config = _read_json(Path(folder) / "tokenizer_config.json")
    tok.chat_template = _chat_template(Path(folder), config)
    tok.bos_token = _token_str(config.get("bos_token"))
    tok.eos_token = _token_str(config.get("eos_token"))
    for name in ("unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
        value = _token_str(config.get(name))
        if value is not None:
            tok.special_tokens[name] = value
    return tok


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """``chat_template.jinja`` wins over ``tokenizer_config.json`` (as transformers reads
    them); a list of named templates gives its ``default``."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_str(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
