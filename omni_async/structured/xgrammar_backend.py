"""xgrammar as a second grammar library behind the same gate: its matcher seen through the
surface the engine uses of llguidance's (``consume_token``, ``unsafe_compute_mask_ptr``, ...).

Why: a step whose rows are all constrained waits for their masks. llguidance computes a
mask lazily at each new parser state (tens of us a row on a JSON schema); xgrammar
precomputes token masks per grammar state when it compiles, so a row's mask at batch is a
few us (``tools/grammar_libraries.py``: on the bench's schema, SmolLM2's vocabulary,
2.5 against 31-40 us a row on one thread of a 2-core VM; bench/RESULTS.md). What it costs
instead: a compile of tens to hundreds of ms that holds the GIL (llguidance's ~1 ms does
not), a wheel that requires Triton on Linux, and GBNF only (no Lark, no ``x-guidance``
options). Through the engine an all-constrained token's host time was 9.4 against 23 us on
that VM, and an H100's all-constrained batch reached 0.410 of free against llguidance's
0.247 in the same run (0.218 at best since; bench/RESULTS.md, issue 61). Hence the default where it is installed
(:func:`chosen`; ``OMNI_ASYNC_GRAMMAR_BACKEND=llguidance`` asks for llguidance alone), and
only for what it can serve the same way: JSON schemas (written with ", " and ": " and no other
whitespace, as llguidance writes them) and regexes; EBNF, schemas with their own
``x-guidance`` options or a string ``pattern`` / ``format`` (compiled by xgrammar's own
regex, which admits UTF-16 surrogates: see ``_JSON_STRING_CHAR``), and anything xgrammar
refuses to compile stay with llguidance.

Semantics kept equal to llguidance's, so every other part of the engine is unchanged:
- ``is_stopped``: the grammar admits nothing more but a stop token (a closed JSON object),
  or a stop token was taken; llguidance stops there, xgrammar would wait for the stop
  token first;
- a token the grammar refuses puts the matcher in error (``is_error``), as llguidance does;
- ``compute_ff_tokens`` answers no forced run: xgrammar's jump-forward tokens are a
  tokenisation of the forced text, not tokens each of which is its position's one
  admissible token (what the mask worker's forced runs need), so every position's mask is
  computed; at xgrammar's cost a row that is cheap.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.util
import os
import re
import threading
from typing import Any, Sequence

import numpy as np

from ..errors import ConfigError
from ..logs import log
from .library import JSON_DEFAULTS
from .vocab import TokenVocab

BACKEND_ENV = "OMNI_ASYNC_GRAMMAR_BACKEND"
BACKENDS = ("llguidance", "xgrammar")


def chosen(asked: str | None = None) -> str:
    """The grammar library of a compiler: ``asked`` (``GrammarCompiler(backend=)``) when
    given, else ``OMNI_ASYNC_GRAMMAR_BACKEND``; unset or empty, xgrammar where it is
    installed (its host time a constrained token is under half llguidance's: module
    docstring), else llguidance. Any other name is a :class:`~omni_async.errors.ConfigError`
    (the engine's build reads it): a misspelt name would otherwise quietly pick a library."""
    name = (os.environ.get(BACKEND_ENV, "") if asked is None else asked).strip().lower()
    if not name:
        return "xgrammar" if installed() else "llguidance"
    if name not in BACKENDS:
        source = "GrammarCompiler(backend=)" if asked is not None else BACKEND_ENV
        raise ConfigError(f"{source} must be one of {', '.join(BACKENDS)} (or empty: xgrammar where installed), got {name!r}")
    return name


@functools.cache
def installed() -> bool:
    """Whether xgrammar can be found, without importing it (its import takes ~1 s; an
    engine that never sees a grammar should not pay it). Asked once a process."""
    try:
        return importlib.util.find_spec("xgrammar") is not None
    except (ImportError, ValueError):  # a parent that fails, or a module entry set to None
        return False


@functools.cache
def loaded() -> Any:
    """The xgrammar module, imported once, on the first grammar it could take; None where
    the import fails (a broken wheel, a missing Triton): llguidance then takes every
    grammar, as if xgrammar were not installed, instead of each request failing."""
    try:
        return importlib.import_module("xgrammar")
    except Exception as exc:
        log.warning("xgrammar_import_failed", error=f"{type(exc).__name__}: {exc}", fallback="llguidance")
        return None


def serves(kind: str, text: str) -> bool:
    """Whether xgrammar can take this grammar the way llguidance would: a JSON schema
    without options of llguidance's own, or a regex."""
    if kind == "json_schema":
        return '"x-guidance"' not in text
    return kind == "regex"


class XGrammarLibrary:
    """xgrammar's view of one tokenizer (built once, on the compiling thread) and its
    compiles. ``compile`` raises what xgrammar raises for a grammar it refuses."""

    def __init__(self, vocab: TokenVocab) -> None:
        xgrammar = loaded()
        if xgrammar is None:
            raise ImportError("xgrammar could not be imported")
        self._xgr = xgrammar
        self.words = (vocab.size + 31) // 32
        self.stop_ids = tuple(vocab.eos_ids)
        info = xgrammar.TokenizerInfo(list(vocab.token_bytes), xgrammar.VocabType.RAW, vocab_size=vocab.size,
                                      stop_token_ids=list(vocab.eos_ids))
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, kind: str, text: str) -> "XGrammarHandle":
        """A template matcher at the grammar's start (each request takes a ``deep_copy``)."""
        if kind == "json_schema":
            ebnf = json_ebnf(self._xgr, "{}" if text == "true" else text)
            if "Regex(" in ebnf:  # a string's pattern or format, compiled by xgrammar itself: no UTF-8 hold there
                raise ValueError("a string pattern or format: llguidance takes the schema")
            compiled = self._compiler.compile_grammar(ebnf)
        elif kind == "regex":
            compiled = self._compiler.compile_grammar(regex_ebnf(self._xgr, text))
        else:
            raise ValueError(f"xgrammar does not take {kind!r} here")
        return XGrammarHandle(self._xgr.GrammarMatcher(compiled), self.words, self.stop_ids)


# xgrammar 0.2.9 writes the characters of a string with a length bound as any character but
# '"', '\\' and line ends: control characters too, which JSON refuses unescaped (its
# unbounded strings exclude them). Both classes are held to llguidance's: no control
# character, no DEL, and no UTF-16 surrogate (U+D800-DFFF): a negated class in xgrammar
# admits their three-byte encodings (0xED 0xA0-0xBF ..), which are not UTF-8 (on an H100, 3
# of 320 outputs of the constrained benchmark held one); llguidance refuses them.
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\x7f\"\\\r\n\ud800-\udfff]'


def json_ebnf(xgrammar: Any, schema: str) -> str:
    """The grammar xgrammar makes of ``schema`` (JSON written as llguidance writes it here,
    :data:`.library.JSON_DEFAULTS`), with its string characters held to JSON's."""
    grammar = xgrammar.Grammar.from_json_schema(
        schema, any_whitespace=JSON_DEFAULTS["whitespace_flexible"],
        separators=(JSON_DEFAULTS["item_separator"], JSON_DEFAULTS["key_separator"]))
    text = str(grammar).replace(_BOUNDED_STRING_CHAR, _STRING_CHAR)
    return text.replace(_STRING_CHAR, _JSON_STRING_CHAR)


# A string literal or a character class of xgrammar's EBNF (escapes kept whole; a literal
# is matched only to be left as it is), and what its regexes' ``.`` becomes.
_CLASS = re.compile(r'"(?:\\.|[^"\\])*"|\[(\^?)((?:\\.|[^\]\\])*)\]')
_ANY_CHAR = r"[\0-\U0010ffff]"
_NO_SURROGATE = r"\ud800-\udfff"


def regex_ebnf(xgrammar: Any, regex: str) -> str:
    """The grammar xgrammar makes of ``regex``, with no character admitting a UTF-16
    surrogate's encoding (see ``_JSON_STRING_CHAR``): ``.`` is every character but those,
    and a negated class leaves them out too. A positive class whose own range spans them
    (``[\u0000-\uffff]``) is left as written."""
    text = _CLASS.sub(lambda m: f"[^{m.group(2)}{_NO_SURROGATE}]" if m.group(1) else m.group(0),
                      str(xgrammar.Grammar.from_regex(regex)))
    return text.replace(_ANY_CHAR, f"[^{_NO_SURROGATE}]")


class XGrammarHandle:
    """One xgrammar matcher with the methods the engine calls on llguidance's ``LLMatcher``.
    Used by one thread at a time (``grammar.GrammarMatcher`` waits for a computation in
    flight before touching it), like llguidance's."""

    __slots__ = ("_m", "_words", "_stop_ids", "_error", "_stopped")

    def __init__(self, matcher: Any, words: int, stop_ids: tuple[int, ...]) -> None:
        self._m = matcher
        self._words = words
        self._stop_ids = stop_ids
        self._error = ""
        self._stopped = False

    def deep_copy(self) -> "XGrammarHandle":
        copy = XGrammarHandle(self._m.fork(), self._words, self._stop_ids)
        copy._error, copy._stopped = self._error, self._stopped
        return copy

    def consume_token(self, token: int) -> bool:
        """Advance by ``token``; a token the grammar refuses (or one after it stopped) puts
        the matcher in error, as llguidance's does."""
        if self._error or self._stopped:
            self._error = self._error or f"token {token} after the grammar stopped"
            return False
        if not self._m.accept_token(int(token)):
            self._error = f"token {token} doesn't satisfy the grammar"
            return False
        self._stopped = self._ended(int(token))
        return True

    def try_consume_tokens(self, tokens: list[int]) -> int:
        """The longest prefix of ``tokens`` the grammar admits, consumed; its length. A
        refused token is not an error here (llguidance's ``try_consume_tokens``)."""
        n = 0
        for t in tokens:
            if self._error or self._stopped or not self._m.accept_token(int(t)):
                break
            n += 1
            self._stopped = self._ended(int(t))
        return n

    def compute_ff_tokens(self) -> list[int]:
        """No forced run (see the module's docstring)."""
        return []

    def unsafe_compute_mask_ptr(self, ptr: int, nbytes: int) -> None:
        """The current position's mask written as ``words`` int32 at ``ptr`` (``nbytes``
        long at least); nothing admitted once stopped or failed."""
        words = nbytes // 4 if nbytes // 4 < self._words else self._words
        row = np.frombuffer((ctypes.c_int32 * words).from_address(ptr), dtype=np.int32).reshape(1, words)
        if self._error or self._stopped:
            row.fill(0)
            return
        self._m.fill_next_token_bitmask(row)

    def is_error(self) -> bool:
        return bool(self._error)

    def get_error(self) -> str:
        return self._error

    def is_stopped(self) -> bool:
        return self._stopped

    def _ended(self, token: int) -> bool:
        """After ``token`` was accepted: a stop token ends the grammar, and so does a complete
        position that admits nothing but a stop token (one library call a token: the
        matcher's accept is on the loop thread)."""
        if token in self._stop_ids:
            return self._m.is_terminated()
        return self._m.is_completed() and self._only_stops()

    def _only_stops(self) -> bool:
        """Whether the mask here admits stop tokens alone (a complete grammar that cannot go
        on): computed only at a complete position."""
        row = np.empty((1, self._words), dtype=np.int32)
        self._m.fill_next_token_bitmask(row)
        bits = row.view(np.uint32)[0]
        for t in self._stop_ids:
            bits[t >> 5] &= ~np.uint32(1 << (t & 31))
        return not bits.any()


_BATCHES = threading.local()  # each thread's BatchGrammarMatcher per thread count


def all_xgrammar(handles: Sequence[Any]) -> bool:
    """Whether every handle is an :class:`XGrammarHandle` (then :func:`fill_masks` serves them)."""
    return bool(handles) and all(isinstance(h, XGrammarHandle) for h in handles)


def fill_masks(handles: Sequence[XGrammarHandle], masks: np.ndarray, rows: Sequence[int] | None = None,
               threads: int = 1) -> None:
    """Each handle's mask into row ``rows[j]`` (else ``j``) of ``masks`` (``[n, words]``
    int32, C-contiguous) in one xgrammar call over ``threads`` of its own: a call per row
    costs ~2.4x the library's time a row (4.5 against 1.8 us on the bench's schema,
    SmolLM2's vocabulary, this VM), Python and a GIL round trip each. A stopped or failed
    matcher admits nothing (as :meth:`XGrammarHandle.unsafe_compute_mask_ptr`)."""
    at = list(range(len(handles))) if rows is None else list(rows)
    live = [j for j, h in enumerate(handles) if not (h._error or h._stopped)]
    for j in range(len(handles)):
        if handles[j]._error or handles[j]._stopped:
            masks[at[j]] = 0
    if not live:
        return
    by_threads = getattr(_BATCHES, "by_threads", None)
    if by_threads is None:
        by_threads = _BATCHES.by_threads = {}
    batch = by_threads.get(threads)
    if batch is None:
        batch = by_threads[threads] = loaded().BatchGrammarMatcher(max_threads=max(1, threads))
    batch.batch_fill_next_token_bitmask([handles[j]._m for j in live], masks, [at[j] for j in live])
