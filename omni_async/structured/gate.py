"""Admission's side of constrained decoding: compile a request's grammar off the loop first.

A request with a grammar is held back (deferred, like a request whose stream input is not
ready) until its grammar has compiled on the gate's worker thread; the build then takes a
cached template, so neither the default inline build nor a pool build compiles, and the
loop never does. A grammar that does not compile fails its request alone, with an
:class:`~omni_async.errors.InvalidRequestError`, at admission.
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from typing import Any, Callable

from ..errors import InvalidRequestError
from .grammar import GrammarCompiler
from .optimistic import eligible

NO_TOKENIZER = (
    "constrained decoding (json_schema, regex, ebnf) needs the model's tokenizer, and this "
    "engine has none"
)


def grammar_key(payload: Any) -> tuple[str, str] | None:
    sampling = getattr(payload, "sampling", None)
    return getattr(sampling, "grammar", None)


class GrammarGate:
    """Readiness for admission, and the matcher a built request gets."""

    def __init__(self, compiler: GrammarCompiler | None, wake: Callable[[], None] | None,
                 optimistic: bool = False) -> None:
        """``optimistic``: eligible requests sample before their mask (:mod:`.optimistic`)."""
        self.compiler = compiler
        self.optimistic = optimistic
        self._wake = wake
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._compiling: dict[tuple[str, str], list[str]] = {}  # key -> waiting request ids (loop thread)
        self._done: deque[tuple[str, str]] = deque()  # keys compiled since the loop last looked

    def ready(self, payload: Any) -> bool:
        """True when ``payload`` needs no grammar, or its grammar is compiled (or cannot
        be: the build then fails it); else starts the compile and answers False."""
        key = grammar_key(payload)
        if key is None or self.compiler is None or self.compiler.cached(key):
            return True
        waiting = self._compiling.get(key)
        if waiting is None:
            waiting = self._compiling[key] = []
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-grammar")
            self._pool.submit(self._compile, key)
        waiting.append(payload.request_id)
        return False

    def _compile(self, key: tuple[str, str]) -> None:
        """On the gate's thread. However the compile ends, the key leaves it with a cached
        outcome: a key reported done but not cached would be submitted again by the next
        look at its waiting requests, for ever."""
        assert self.compiler is not None
        try:
            self.compiler.compile(key)
        except BaseException as exc:
            self.compiler.refuse(key, InvalidRequestError(f"invalid {key[0]}: it could not be compiled ({type(exc).__name__})"))
            raise
        finally:
            self._done.append(key)
            if self._wake is not None:
                self._wake()

    def take_ready(self) -> list[str]:
        """Ids of held-back requests whose grammar finished compiling (loop thread)."""
        rids: list[str] = []
        while self._done:
            rids.extend(self._compiling.pop(self._done.popleft(), ()))
        return rids

    def attach(self, req: Any) -> None:
        """Give a built request its matcher (compiled already when it was held back)."""
        key = req.sampling.grammar
        if key is None:
            req.matcher = None
            return
        if self.compiler is None:
            raise InvalidRequestError(NO_TOKENIZER)
        req.matcher = self.compiler.matcher(key)
        if self.optimistic and eligible(req.sampling, req.conditioning):
            req.matcher.masked_until = 0  # a prefill's token still masks first (NativeBatchCore._build_extend)

    def stats(self) -> dict[str, Any]:
        """For ``info()``: the grammar library asked for, grammars compiled (errors
        included) and those xgrammar compiled (:mod:`.xgrammar_backend`; llguidance the rest)."""
        c = self.compiler
        return {"grammar_backend": c.backend if c is not None else None,
                "grammar_compiles": c.compiles if c is not None else 0,
                "grammar_xgrammar_compiles": c.xgrammar_templates if c is not None else 0}

    def shutdown(self) -> None:
        if self.compiler is not None:
            self.compiler.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
