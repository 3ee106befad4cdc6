"""Grammars through llguidance and xgrammar: compile once per grammar, one matcher per request.

llguidance takes every grammar (EBNF/Lark, regexes, JSON schemas with its ``x-guidance`` options) and compiles in
about a millisecond; xgrammar, the default where installed (:func:`.xgrammar_backend.chosen`), takes JSON schemas and
regexes, whose masks it computes at under half llguidance's host time a token (:mod:`.xgrammar_backend`).

A compiled grammar is kept as a *template* matcher, validated once; each request takes a copy of it. Compiling (and,
the first time, building the library's view of the tokenizer, about a second for a 49k vocabulary) runs on this
compiler's own thread, never on the event loop: :class:`~omni_async.structured.gate.GrammarGate` holds a request back
until its grammar is ready."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable

from ..errors import InvalidRequestError
from .optimistic import FIRST_SCORE, LOW_SCORE, NEVER, guessed_forwards, masked_run, optimistic_score
from .library import TokenizerView, first_line, grammar_text, is_library_panic, panic_error, parser_limits
from . import xgrammar_backend
from .prefetch import MaskTicket, MaskWorker
from .vocab import TokenVocab, token_vocab

CACHE_SIZE = 256


class GrammarMatcher:
    """One request's position in its grammar. ``accept`` advances it by a sampled token; ``complete`` says the grammar
    admits nothing more (the request then ends, "stop").

    With a :class:`~omni_async.structured.prefetch.MaskWorker`, each position's mask is computed ahead on the worker
    (queued by :func:`prefetch_all` for a processed step's rows, by ``accept`` or ``prefetch`` alone) and the step's
    fill takes it from :meth:`next_mask`. The library's matcher is never touched by two threads at once: every method
    here first waits for a computation in flight.

    Where the grammar forces a run of tokens (the worker asks the library for them, :func:`.prefetch.compute_slice`),
    the matcher keeps the rest of the run (``_forced``): the masks of the run's next positions are one bit each, known
    without the library or the worker, as long as the tokens accepted are the run's."""

    __slots__ = ("_m", "_on_fail", "_worker", "_ticket", "_row", "_buf", "_valid", "_forced", "_counted",
                 "masked_until", "_score", "_low_refusals")

    def __init__(self, matcher: Any, on_fail: Callable[[str], None] | None = None, worker: Any = None) -> None:
        self._m = matcher
        self._on_fail = on_fail  # told once, when the grammar fails
        self._worker = worker
        self._ticket: MaskTicket | None = None  # the worker's computation of this position's mask
        self._row = 0  # this matcher's row in it
        self._buf: Any = None  # a mask computed on this thread (mask_now), while _valid
        self._valid = False
        self._forced: tuple[int, ...] = ()  # tokens the grammar forces from this position on (known so far)
        self._counted = False  # this position's forced mask counted in the worker's forced_known
        # Generation indices from here on sample first and are checked after
        # (:mod:`.optimistic`); below it, under the mask. NEVER: every one masked.
        self.masked_until = NEVER
        self._score = FIRST_SCORE  # the share of recent guesses admitted (.optimistic.scored)
        self._low_refusals = 0  # refusals since the score fell below LOW_SCORE

    def accept(self, token: int, prefetch: bool = True, later: list["GrammarMatcher"] | None = None,
               index: int | None = None) -> bool:
        """Advance by ``token``; True when the grammar has ended: complete, or failed (:attr:`failed` then says why, and
        the request ends with an error). A token the grammar refuses (it can only come from outside the mask) also
        ends the grammar. Otherwise the next mask is queued on the worker: now, or, given ``later``, by the caller
        with the rest of its step (this matcher appended; :func:`prefetch_all`); not at all when ``prefetch`` is False
        (the caller computes it, :meth:`mask_now`) or when the token is generation ``index`` and the next one samples
        first, or when ``token`` was the first of a forced run (the next mask is the run's next token)."""
        self._settle()
        run = self._forced or (self._ticket.run(self._row) if self._ticket is not None else None)
        self._ticket = None
        self._valid = self._counted = False
        self._forced = ()
        ok = self._m.consume_token(int(token))
        if self._m.is_error():
            self._tell_failure()
            return True
        if not ok or self._m.is_stopped():
            return True
        if run and len(run) > 1 and run[0] == token:
            self._forced = tuple(run[1:])
            return False  # the next mask is known (:meth:`next_mask`)
        if index is not None and index + 1 >= self.masked_until:
            return False  # the next token samples first: no mask needed
        if later is not None:
            later.append(self)
        elif prefetch:
            self.prefetch()
        return False

    def take(self, tokens: list[int]) -> int:
        """Advance by the longest prefix of ``tokens`` (sampled before their masks, :mod:`.optimistic`) that the grammar
        admits, in one library call: how many it took (fewer than all: the next one was refused, and the matcher
        stands after the ones taken). The admission score and ``info()``'s counters follow."""
        self._settle()
        self._ticket = None
        self._valid = self._counted = False
        self._forced = ()
        n = self._m.try_consume_tokens(tokens)
        if self._m.is_error():  # (the library's lazy work failed: the caller meets ``failed``)
            self._tell_failure()
            return n
        refused = n < len(tokens) and not self._m.is_stopped()  # (tokens after a completed grammar are the caller's)
        # Token by token, whatever the step's size: the score rises with each admitted
        # guess (a run back above LOW_SCORE ends the low refusals' count), then falls at
        # the refused one. Checking only after both made a step of several forwards
        # mask other positions than one forward a step, and so draw other tokens.
        self._score = optimistic_score(self._score, n, False)
        if self._score >= LOW_SCORE:
            self._low_refusals = 0
        if refused:
            self._score = optimistic_score(self._score, 0, True)
            if self._score >= LOW_SCORE:
                self._low_refusals = 0
        if self._worker is not None:
            self._worker.guessed += n
            self._worker.refused += refused
        return n

    def _tell_failure(self) -> None:
        """Tell the compiler, once, that this grammar failed in use (it then refuses it at admission)."""
        if self._on_fail is not None:
            self._on_fail(self.failed or "the grammar failed")
            self._on_fail = None

    def refused_at(self, index: int) -> None:
        """The guess at generation ``index`` was refused and the request rewound to the token
        before it: mask first from there (:func:`.optimistic.masked_run`), its mask queued now."""
        if self._score < LOW_SCORE:
            self._low_refusals += 1
        self.masked_until = index + masked_run(self._score, self._low_refusals)
        self.prefetch()

    def guess_forwards(self, most: int) -> int:
        """Forwards to run sampling first in a launch of ``most`` (:func:`.optimistic.guessed_forwards`)."""
        return guessed_forwards(self._score, most)

    def mask_first(self, index: int) -> None:
        """Generation ``index`` samples under the mask (a prefill's token, see :mod:`.optimistic`)."""
        if self.masked_until <= index:
            self.masked_until = index + 1

    def prefetch(self) -> None:
        """Queue the mask of the current position on the worker (nothing without one)."""
        prefetch_all([self])

    def _settle(self) -> None:
        if (ticket := self._ticket) is not None and not ticket.done.is_set():
            ticket.done.wait()

    def _ahead(self) -> Any:
        """The worker's mask of this position (after waiting for it), else None."""
        ticket = self._ticket
        return ticket.mask(self._row) if ticket is not None else None

    def mask_now(self) -> Any:
        """The current position's mask, computed on this thread unless the worker has it
        (a jump-forward reads position after position: a round trip through the worker
        for each would cost more than the computation); None without a worker."""
        worker = self._worker
        if worker is None:
            return None
        ahead = self._ahead()
        if ahead is not None:
            return ahead
        if self._valid:
            return self._buf
        try:  # a forced run first (one query for the whole run), else the mask
            if not self._forced:
                self._forced = tuple(self._m.compute_ff_tokens())
            if self._forced:
                return self._one_bit()
            buf = self._new_buf()
            self._m.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
        except Exception:  # the step's fill computes it again and meets the error there
            return None
        self._valid = True
        worker.count_inline(buf)
        return buf

    def _new_buf(self) -> Any:
        if self._buf is None:
            import numpy as np

            self._buf = np.empty(self._worker.words, dtype=np.int32)
        return self._buf

    def _one_bit(self) -> Any:
        """The current position's mask when the grammar forces ``_forced``: its first token alone."""
        if not self._valid:
            buf = self._new_buf()
            t = self.one_token()
            buf.fill(0)
            buf.view("uint32")[t >> 5] = 1 << (t & 31)
            self._valid = True
        return self._buf

    def one_token(self) -> int | None:
        """The one admissible token where a run known here forces it (:meth:`next_mask` is then its bit alone; no
        mask queued), else None: a fill writes many such rows' bits at once (:func:`.batch_mask.fill_rows`)."""
        if not self._forced or self._ticket is not None or self._worker is None:
            return None
        if not self._counted:
            self._counted, self._worker.forced_known = True, self._worker.forced_known + 1
        return self._forced[0]

    def forced(self) -> tuple[int, ...]:
        """The tokens the grammar forces from the current position (empty: none, or the
        library failed): the rest of a run known already, the worker's run for this
        position, else the library's forced-token query (``compute_ff_tokens``, from the
        parser state, no mask) on this thread. Call it with no mask of this position queued."""
        if not self._forced:
            ticket = self._ticket
            if ticket is not None:  # the worker's run, or its mask's one token (llguidance's pool finds no runs)
                from .jump import single_token

                mask = ticket.mask(self._row)  # (waits for it)
                one = single_token(mask) if mask is not None else None
                self._forced = tuple(ticket.run(self._row) or (() if one is None else (one,)))
            else:
                try:
                    self._forced = tuple(self._m.compute_ff_tokens())
                except Exception:  # the step's fill computes the mask and meets the error there
                    return ()
        return self._forced

    def count_jump(self, tokens: int) -> None:
        """Count a jump-forward of ``tokens`` forced tokens (:mod:`.jump`) in ``info()``."""
        if self._worker is not None:
            self._worker.count_jump(tokens)

    def next_mask(self) -> Any:
        """The current position's mask from the worker (waiting for it while in flight),
        or one :meth:`mask_now` computed; None: not computed ahead (the caller computes it
        through :attr:`handle`)."""
        ahead = self._ahead()
        if ahead is not None:
            return ahead
        if self._forced and self._worker is not None:
            return self._one_bit()
        return self._buf if self._valid else None

    @property
    def complete(self) -> bool:
        self._settle()
        return self._m.is_stopped()

    @property
    def failed(self) -> str | None:
        """The library's error once the grammar failed (llguidance compiles lazily: a
        grammar can fail at any token, e.g. too many states); None while it is sound."""
        self._settle()
        return first_line(self._m.get_error()) if self._m.is_error() else None

    @property
    def handle(self) -> Any:
        """The library's matcher (for the batch mask fill), once no computation is in flight."""
        self._settle()
        return self._m


def prefetch_all(matchers: list[GrammarMatcher]) -> None:
    """Queue the current position's mask of each of ``matchers`` (one processed step's
    rows) on their worker as one ticket: the worker computes them in one call (see
    :mod:`.prefetch` for why not row by row). Matchers without a worker, or whose mask
    is already there or queued, are left out."""
    worker = None
    todo: list[GrammarMatcher] = []
    for m in matchers:
        if m._worker is None or m._ticket is not None or m._valid or m._forced:
            continue
        if worker is not None and m._worker is not worker:  # another compiler's worker: its own ticket
            prefetch_all([m])
            continue
        worker = m._worker
        todo.append(m)
    if worker is None:
        return
    ticket = worker.submit([m._m for m in todo])
    if ticket is None:  # closed: the fill computes them
        return
    for j, m in enumerate(todo):
        m._ticket, m._row = ticket, j


class GrammarCompiler:
    """Compiles ``SamplingParams.grammar`` keys for one tokenizer; an LRU cache of
    ``CACHE_SIZE`` templates (and of errors, so a bad grammar is refused at once)."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, cache_size: int = CACHE_SIZE,
                 backend: str | None = None) -> None:
        """``backend``: ``"xgrammar"`` compiles JSON schemas and regexes with xgrammar where
        it takes them (:mod:`.xgrammar_backend`), llguidance the rest; ``"llguidance"``
        everything; None: as ``OMNI_ASYNC_GRAMMAR_BACKEND`` says, xgrammar where installed."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self._lltok: Any = None
        self._vocab: TokenVocab | None = None
        self.backend = xgrammar_backend.chosen(backend)  # (an unknown name: ConfigError, at the engine's build)
        self._xgr: Any = None  # xgrammar's view of the tokenizer (built on first use)
        self.compiles = 0
        self.xgrammar_templates = 0  # grammars xgrammar compiled (the others: llguidance)
        # Computes the matchers' next masks ahead, off the loop (started on first use).
        self.masks = MaskWorker((vocab_size + 31) // 32)

    def _ll_tokenizer(self) -> Any:
        if self._lltok is None:
            import llguidance

            vocab = self._token_vocab()
            self._lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(TokenizerView(vocab)), n_vocab=vocab.size)
        return self._lltok

    def _token_vocab(self) -> TokenVocab:
        self._vocab = self._vocab or token_vocab(self._tokenizer, self.vocab_size)
        return self._vocab

    def cached(self, key: tuple[str, str]) -> bool:
        with self._lock:
            return key in self._cache

    def compile(self, key: tuple[str, str]) -> None:
        """Compile ``key`` into the cache (blocking; call it off the loop). Errors are
        cached too and raised by :meth:`matcher`."""
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return
        try:
            entry: Any = self._template(key)
        except InvalidRequestError as err:
            entry = err.with_traceback(None)  # its frames hold this compiler: no cycle through the cache
        except Exception as exc:  # the library refused it some other way: still this request's error
            entry = InvalidRequestError(f"invalid {key[0]}: {exc}")
        except BaseException as exc:
            if not is_library_panic(exc):
                raise
            entry = panic_error(key, exc)
        self._store(key, entry)

    def refuse(self, key: tuple[str, str], error: InvalidRequestError) -> None:
        """Cache ``error`` as ``key``'s outcome unless the key compiled: the gate's last
        word when a compile ended without one, so the key is never submitted again."""
        with self._lock:
            if key in self._cache:
                return
        self._store(key, error)

    def _store(self, key: tuple[str, str], entry: Any) -> None:
        with self._lock:
            self.compiles += 1
            self._cache[key] = entry
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    def matcher(self, key: tuple[str, str]) -> GrammarMatcher:
        """A fresh matcher for ``key``; compiles here if the key is not cached."""
        with self._lock:
            entry = self._cache.get(key)
        if entry is None:
            self.compile(key)
            with self._lock:
                entry = self._cache.get(key)
            if entry is None:  # evicted at once by a tiny cache
                entry = self._template(key)
        if isinstance(entry, InvalidRequestError):
            raise InvalidRequestError(str(entry))
        matcher = GrammarMatcher(entry.deep_copy(), lambda why: self._failed_late(key, why), self.masks)
        matcher.prefetch()  # its first mask, while the request waits for its prefill
        return matcher

    def close(self) -> None:
        """Stop the mask worker (what it has queued still completes)."""
        self.masks.close()

    def _failed_late(self, key: tuple[str, str], why: str) -> None:
        """A grammar that compiled but failed while a request used it (the library's lazy
        work): cached as the failure from now on, so the next request with it is refused at
        admission instead of failing at its first tokens."""
        with self._lock:
            if key in self._cache:
                self._cache[key] = InvalidRequestError(f"invalid {key[0]}: {why}")

    def _template(self, key: tuple[str, str]) -> Any:
        kind, text = key
        if self.backend == "xgrammar" and xgrammar_backend.serves(kind, text):
            template = self._xgrammar_template(kind, text)
            if template is not None:
                return template
        import llguidance

        try:
            grammar = grammar_text(llguidance, kind, text)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"invalid {kind}: {exc}") from None
        matcher = llguidance.LLMatcher(self._ll_tokenizer(), grammar, log_level=0, limits=parser_limits(llguidance))
        if not matcher.is_error():
            # The library compiles lazily: the first mask does the work that can still
            # fail (``a{1000000}``), so it is computed here, off the loop, and a grammar
            # that fails now is refused before the request's first token.
            matcher.compute_bitmask()
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {kind}: {first_line(matcher.get_error())}")
        return matcher

    def _xgrammar_template(self, kind: str, text: str) -> Any:
        """xgrammar's template matcher, or None where it refuses the grammar (llguidance then compiles it, and
        refuses it with its own message) or does not import (llguidance then takes every grammar; ``info()`` says so)."""
        try:
            self._xgr = self._xgr or xgrammar_backend.XGrammarLibrary(self._token_vocab())
            template = self._xgr.compile(kind, text)
        except InvalidRequestError:
            raise  # the tokenizer cannot be read: no library can take it
        except Exception:
            self.backend = "llguidance" if xgrammar_backend.loaded() is None else self.backend
            return None
        self.xgrammar_templates += 1
        return template
