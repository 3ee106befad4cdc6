"""Where the engine meets llguidance: the options it is called with, and its panics.

Kept apart from :mod:`.grammar` (which compiles and matches) because each of these is a
decision about the library itself: how a schema's text reaches it (so that it compiles
with the GIL released), how wide its parser may grow (so that OpenAI-size objects
compile), and what a Rust panic inside it means (a failure of that grammar alone).
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import InvalidRequestError
from .vocab import TokenVocab

# JSON comes out as ``json.dumps`` writes it (", " and ": ", no other whitespace) unless the
# schema's own "x-guidance" options say otherwise: free whitespace lets a model pad
# without end and never close the object.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The parser's row width: about four items per optional property of one object, for the
# 5,000 properties a schema may have (sampling_controls.MAX_SCHEMA_PROPERTIES), and room.
MAX_ROW_ITEMS = 22_000


def with_json_defaults(text: str) -> str:
    """The schema ``text`` (compact JSON) with :data:`JSON_DEFAULTS` as its top-level
    "x-guidance" options, under any the schema gives itself. A schema without any is
    spliced without being parsed (a large one is read once, by the library)."""
    if text == "true":
        text = "{}"
    if not text.startswith("{") or '"x-guidance"' in text:
        schema = json.loads(text)
        if not isinstance(schema, dict):
            return text
        own = schema.get("x-guidance")
        schema["x-guidance"] = {**JSON_DEFAULTS, **own} if isinstance(own, dict) else JSON_DEFAULTS
        return json.dumps(schema, separators=(",", ":"))
    head = '{"x-guidance":' + json.dumps(JSON_DEFAULTS, separators=(",", ":"))
    return head + ("}" if text == "{}" else "," + text[1:])


def parser_limits(llguidance: Any) -> Any:
    """The library's limits, but for the width of a parser row: an object's optional
    properties all open in one row (about four items each), so the default 2,000 refuses a
    flat object of 500 optional properties at its first token. Wide enough for
    MAX_SCHEMA_PROPERTIES; a step's work stays bounded by the library's items per step."""
    return llguidance.LLParserLimits(max_items_in_row=MAX_ROW_ITEMS)


def is_library_panic(exc: BaseException) -> bool:
    """Whether ``exc`` is a Rust panic inside the grammar library: pyo3 raises it as
    ``pyo3_runtime.PanicException``, a BaseException (so that ``except Exception`` does not
    take it), which the library does not export. It fails the grammar it was given, like
    any error of the library's; interrupts and exits are not panics."""
    return type(exc).__name__ == "PanicException"


def panic_error(key: tuple[str, str], exc: BaseException) -> InvalidRequestError:
    return InvalidRequestError(f"invalid {key[0]}: the grammar library failed on it ({type(exc).__name__}: {first_line(str(exc))})")


def first_line(message: str) -> str:
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return " ".join(lines[:4]) if lines else "the grammar does not compile"


def grammar_text(llguidance: Any, kind: str, text: str) -> str:
    """What llguidance's matcher reads for a ``SamplingParams.grammar`` key."""
    if kind == "json_schema":
        # The schema goes in as text, to be read by the matcher's constructor, which runs
        # with the GIL released: ``grammar_from_json_schema`` reads a Python dict holding
        # the GIL (~170 ms for 5,000 properties with an object each, every one of them a
        # stall of the event loop).
        return llguidance.grammar_from("json_schema", with_json_defaults(text))
    if kind == "regex":
        return llguidance.grammar_from("regex", text)
    if kind == "ebnf":
        return llguidance.grammar_from("ebnf", text)  # GBNF (``root ::= ...``) or Lark
    raise InvalidRequestError(f"unknown grammar kind {kind!r}")


class TokenizerView:
    """What ``llguidance.TokenizerWrapper`` reads off a tokenizer, from our byte vocabulary."""

    def __init__(self, vocab: TokenVocab) -> None:
        self.eos_token_id = vocab.eos_ids[0] if vocab.eos_ids else None
        self.bos_token_id = None
        self.tokens = list(vocab.token_bytes)
        self.special_token_ids = sorted(vocab.special_ids)
        self._encode = vocab.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text)
