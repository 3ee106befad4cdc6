"""Emission: the live table, step outputs turned into messages, and exactly one
terminal message per request.

Messages are delivered through an output sink: by default each goes into the stage's
``outbox`` stream; an embedding layer (the :class:`~omni_async.engine.Engine`) can
install its own sink and receive a whole step's messages in one call, so a step costs
one delivery, not one channel hop per token.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Sequence

from .. import errors
from ..core.protocol import BatchCore, StepOutcomes
from ..core.request import Request, RequestData
from ..logs import debug_enabled, log
from ..messages import OutgoingMessage, StepTokens, StreamDelta
from ..core.runner_io import ModelRunnerOutput, RequestOutput
from .outputs import HiddenRows, default_result_adapter, default_stream_output_builder, plain_columns, stream_message
from .state import IdWindow, StageState, call_user

OutputSink = Callable[[list[OutgoingMessage]], None]


def _no_tokens() -> StepTokens:
    return StepTokens([], [], [], [])


# (a step's columns, then the messages sent with it): one call per delivery.
ColumnsSink = Callable[[StepTokens, list[OutgoingMessage]], None]
ResultAdapter = Callable[[RequestData], Any]
StreamOutputBuilder = Callable[[str, RequestData, RequestOutput], Iterable[OutgoingMessage]]


class Emission:
    def __init__(
        self,
        core: BatchCore,
        sink: OutputSink,
        *,
        result_adapter: ResultAdapter | None = None,
        stream_output_builder: StreamOutputBuilder | None = None,
        state: StageState | None = None,
        ended_cap: int = 10_000,
        ended_keep: int = 5_000,
        stats: Any = None,
        stream_interval: int = 1,
    ) -> None:
        self.core = core
        self.sink = sink
        self.result_adapter = result_adapter or default_result_adapter
        self.stream_output_builder = stream_output_builder or default_stream_output_builder
        self.state = state or StageState()
        self.live: dict[str, RequestData] = {}
        # Recently terminated ids: stream input for them is dropped, an abort of one is
        # a no-op. Bounded; a new request with the same id leaves the window.
        self.ended: IdWindow[None] = IdWindow(ended_cap, ended_keep)
        self.stats = stats
        self._pending: list[OutgoingMessage] = []
        # With a columns sink (the engine's router), plain stream rows gather here and
        # go before the messages of the same delivery (a request's result comes after
        # its last tokens either way).
        self.columns_sink: ColumnsSink | None = None
        self._tokens = _no_tokens()
        self._coalescing = 0
        # True from a synchronous step's processing until the next step is launched
        # (``defer`` / ``deliver``): its messages wait in ``_pending`` meanwhile.
        self._deferred = False
        self._first_emitted: set[str] = set()
        # SchedulerConfig.stream_interval: above 1, a request's plain deltas are held
        # here (tokens, logprobs) until it has that many unsent tokens or finishes.
        self.stream_interval = stream_interval
        self._held: dict[str, tuple[list[int], list[float] | None]] = {}
        # Called with the id of every request that ends (rejected, failed, finished):
        # whatever is still kept for it elsewhere (buffered stream input) is released.
        self.end_listeners: list[Callable[[str], None]] = []

    # ------------------------------------------------------------ delivery

    @contextmanager
    def coalesced(self) -> Iterator[None]:
        """Deliver what is sent inside the block in one sink call at its end."""
        self._coalescing += 1
        try:
            yield
        finally:
            self._coalescing -= 1
            if not self._coalescing and not self._deferred:
                self.flush()

    def send(self, msg: OutgoingMessage) -> None:
        self._pending.append(msg)
        if not self._coalescing and not self._deferred:
            self.flush()

    def defer(self) -> None:
        """Hold every delivery until ``deliver``. The stepper defers a synchronous step's
        messages until the next step is launched, so that handing them to the readers
        (and the readers' own work, which runs at the loop's next await) overlaps the
        device instead of delaying the launch: in the normal loop that was a third of the
        host's work between two steps. Order is kept: later messages queue behind."""
        self._deferred = True

    @property
    def deferred(self) -> bool:
        return self._deferred

    def deliver(self) -> None:
        """End a ``defer``: what is held goes now (at the end of an enclosing block)."""
        self._deferred = False
        if not self._coalescing:
            self.flush()

    def flush(self) -> None:
        tokens = self._tokens
        if not self._pending and not tokens.request_ids:
            return
        batch, self._pending = self._pending, []
        try:
            if self.columns_sink is not None:
                self._tokens = _no_tokens()
                self.columns_sink(tokens, batch)
            else:
                self.sink(batch)
        except Exception as exc:  # a sink must not take the loop down
            log.error("scheduler_output_sink_failed", error=repr(exc), messages=len(batch) + len(tokens))

    # ------------------------------------------------------------ the live table

    def admit(self, data: RequestData) -> None:
        rid = data.req.rid
        self.ended.pop(rid)
        self.live[rid] = data

    def is_live(self, rid: str) -> bool:
        return rid in self.live

    def reject(self, rid: str, err: Exception) -> None:
        """The one terminal message of a request that never became live."""
        self.ended.put(rid, None)
        self._ended(rid)
        self.send(OutgoingMessage(rid, "error", err))

    def send_error(self, rid: str, err: Exception) -> None:
        """An error for a message that does not end the request with that id (a
        duplicate id: the active request keeps it)."""
        self.send(OutgoingMessage(rid, "error", err))

    def fail(self, rid: str, err: Exception) -> None:
        """End a live request with an error (no-op when it already ended)."""
        data = self.live.pop(rid, None)
        if data is None:
            return
        _unlink(data)
        self._forget(rid)
        self.send(OutgoingMessage(rid, "error", err))

    def fail_request(self, req: Request, err: Exception) -> None:
        self.core.fail_requests([req])  # releases KV unless the request already finished
        self.fail(req.rid, err)

    def finish(self, req: Request) -> None:
        """The terminal message of a request the core finished: its result (through the
        result adapter), or an aborted error."""
        rid = req.rid
        data = self.live.get(rid)
        if data is None:
            return
        if debug_enabled():
            log.debug("scheduler_finish", request_id=rid, finish_reason=req.finish_reason, output_tokens=len(req.output_ids))
        if req.finish_reason == "abort":
            self.fail(rid, errors.RequestAbortedError("request aborted", output_ids=req.output_ids))
            return
        if req.finish_reason == "error":  # its grammar failed during generation
            why = req.matcher.failed if req.matcher is not None else None
            self.fail(rid, errors.InvalidRequestError(f"the request's grammar failed during generation: {why}"))
            return
        held = self._held.pop(rid, None)
        if held is not None:  # stream_interval: tokens held when it ended without a new one
            self._pending.append(OutgoingMessage(rid, "stream", StreamDelta(rid, held[0], held[1], False, None)))
        data.output_ids = list(req.output_ids)
        data.finish_reason = req.finish_reason
        data.weight_version = self.state.weight_version
        try:
            result = call_user("result adapter", self.result_adapter, data)
        except errors.OmniAsyncError as err:
            self.fail(rid, err)
            return
        finally:
            data.input_embeds = data.decode_input_embeds = None
        self.live.pop(rid, None)
        _unlink(data)
        self._forget(rid)
        self.send(OutgoingMessage(rid, "result", result))

    def end_all(self, reqs: Sequence[Request], make_error: Callable[[Request], Exception]) -> None:
        for req in reqs:
            self.fail(req.rid, make_error(req))

    def _forget(self, rid: str) -> None:
        self.ended.put(rid, None)
        self._first_emitted.discard(rid)
        self._held.pop(rid, None)
        self._ended(rid)

    def _ended(self, rid: str) -> None:
        for listener in self.end_listeners:
            listener(rid)

    # ------------------------------------------------------------ step outputs

    def on_step_output(self, batch: Any, out: ModelRunnerOutput) -> None:
        """Process one step: rows the runner could not sample fail alone, then the core
        appends tokens and checks finishes, then each row's stream message is built.
        With the default stream builder the message is built inline (no callback guard,
        no per-row list): this runs for every running request on every step."""
        with self.coalesced():
            if self.columns_sink is not None and (self._pending or self._tokens.request_ids):
                # An enclosing block's output goes first, so that a request whose rows
                # change form between steps (columns, messages) keeps its deltas in order.
                self.flush()
            for row, message in (out.row_errors or {}).items():
                req = batch.reqs[row]
                if batch.row_is_live(row):
                    self.fail_request(req, errors.RequestFailedError(f"sampling failed for this request: {message}"))
            outcomes = self.core.process_result(batch, out.token_ids, out.logprobs)
            outputs = out.built_outputs  # None on a plain step
            inline = self.stream_output_builder is default_stream_output_builder and not debug_enabled()
            pending = self._pending
            interval = self.stream_interval
            columns = self._tokens if self.columns_sink is not None and interval == 1 else None
            if columns is not None:
                col_ids, col_toks, col_lps, col_ends = (
                    columns.request_ids, columns.token_ids, columns.logprobs, columns.finish_reasons)
            emitted = 0
            hidden = HiddenRows(batch, out) if out.hidden_states is not None or out.prompt_hidden is not None else None
            if columns is not None and inline and hidden is None and not outputs and type(outcomes) is StepOutcomes:
                emitted += plain_columns(outcomes, columns)  # the plain rows' columns, as they are
                outcomes = outcomes.rest
            for oc in outcomes:
                req = oc.req
                token = oc.token
                if hidden is not None and hidden.take(oc):
                    self._emit_with_hidden(req, oc, hidden, outputs)
                    if oc.finished:
                        self.finish(req)
                    continue
                if token is not None:
                    tokens = oc.tokens  # a multi-step row: all its tokens; else None
                    logprob = oc.logprob
                    want_lp = logprob is not None and req.sampling.return_logprob
                    if tokens is None:
                        emitted += 1
                        if want_lp:
                            req.data.output_token_logprobs.append((logprob, token))
                    else:
                        emitted += len(tokens)
                        if want_lp:
                            req.data.output_token_logprobs.extend(zip(oc.logprobs or (), tokens))
                    req_output = outputs.get(req.rid) if outputs else None
                    if req_output is None and inline:  # the common step: the message, directly
                        rid, fin = req.rid, oc.finished
                        lps = ([logprob] if tokens is None else oc.logprobs) if want_lp else None
                        toks = [token] if tokens is None else tokens
                        if columns is not None:  # the engine's router: one row of the step's columns
                            col_ids.append(rid)
                            col_toks.append(toks)
                            col_lps.append(lps)
                            col_ends.append(req.finish_reason if fin else None)
                            if fin:
                                self.finish(req)
                            continue
                        if interval > 1:
                            toks, lps = self._interval(req, toks, lps, fin)
                            if toks is None:
                                continue  # held: the request neither finished nor sends yet
                        pending.append(OutgoingMessage(rid, "stream", StreamDelta(
                            rid, toks, lps, fin, req.finish_reason if fin else None)))
                    elif not self._emit_outputs(req, oc, req_output, inline):
                        continue
                if oc.finished:
                    self.finish(req)
            if self.stats is not None:
                self.stats.tokens_out += emitted

    def _interval(self, req: Request, toks: list[int], lps: list[float] | None,
                  fin: bool) -> tuple[list[int] | None, list[float] | None]:
        """``stream_interval``: the tokens to send now (held ones first), or None while
        they are held. A request's first token goes at once (time to first token is
        not delayed); after it, a delta when ``stream_interval`` tokens are unsent, and
        at the finish."""
        rid = req.rid
        held = self._held.pop(rid, None)
        if held is not None:
            toks = held[0] + toks
            lps = None if lps is None or held[1] is None else held[1] + lps
        if fin or len(toks) >= self.stream_interval or len(req.output_ids) == len(toks):
            return toks, lps
        self._held[rid] = (toks, lps)
        return None, None

    def on_step_failed(self, batch: Any, exc: BaseException) -> None:
        """A step raised. Which row caused it is not known: with several live requests
        in it, each is retried once (retracted, KV freed, prefilled again in a step of
        its own); a request alone in a failed step, or failing a second time, ends with
        an error. Rows of the failed requests in a step still in flight are skipped."""
        self.core.invalidate_cache()  # the step's KV writes may be incomplete
        live = [batch.reqs[i] for i in range(batch.size) if batch.row_is_live(i)]
        log.error("scheduler_batch_failed", request_ids=[r.rid for r in live], error=repr(exc))
        first_time = [r for r in live if r.step_failures == 0] if len(live) > 1 else []
        for req in live:
            req.step_failures += 1
        retried = {id(r) for r in self.core.retract_requests(first_time)} if first_time else set()
        if isinstance(exc, errors.DeviceError):  # a timeout, a dead rank: keep the type
            make: Callable[[], Exception] = lambda: type(exc)(str(exc))
        else:
            make = lambda: errors.RequestFailedError(f"model step failed: {exc!r}")
        with self.coalesced():
            for req in self.core.fail_requests([r for r in live if id(r) not in retried]):
                err = make()
                err.__cause__ = exc
                self.fail(req.rid, err)

    def _emit_with_hidden(self, req: Request, oc: Any, hidden: "HiddenRows", outputs: dict[str, RequestOutput] | None) -> None:
        """A row whose tokens go out with their hidden states: one delta for the step's
        tokens (a multi-step row's together), or none for a prefill chunk that sampled
        nothing. Logprobs and top logprobs go as on the plain path."""
        if oc.token is None:
            return
        tokens = [oc.token] if oc.tokens is None else oc.tokens
        lps = ([oc.logprob] if oc.tokens is None else oc.logprobs) if req.sampling.return_logprob else None
        if lps is not None and lps[0] is not None:
            req.data.output_token_logprobs.extend(zip(lps, tokens))
        else:
            lps = None
        if self.stats is not None:
            self.stats.tokens_out += len(tokens)
        fin = oc.finished
        delta = StreamDelta(req.rid, list(tokens), lps, fin, req.finish_reason if fin else None,
                            hidden_states=hidden.rows, prompt_hidden_states=hidden.prompt)
        if hidden.prompt_logprobs is not None:
            delta.prompt_logprobs, delta.prompt_logprob_ranks = hidden.prompt_logprobs
        req_output = outputs.get(req.rid) if outputs else None
        if req_output is not None and req_output.extra:  # top logprobs (one forward: one token)
            delta.extra = dict(req_output.extra)
        if self.stream_output_builder is default_stream_output_builder:
            self._pending.append(OutgoingMessage(req.rid, "stream", delta))
            return
        for j, token in enumerate(tokens):  # a custom builder sees one RequestOutput per token
            last = j == len(tokens) - 1
            out = RequestOutput(req.rid, token, logprob=None if lps is None else lps[j], finished=fin and last)
            if hidden.rows is not None:
                out.extra["hidden_states"] = hidden.rows[j : j + 1]
            if not self._emit_stream(req, out):
                return

    def _emit_outputs(self, req: Request, oc: Any, req_output: RequestOutput | None, inline: bool) -> bool:
        """A row's token(s) through ``RequestOutput``s: the runner's (extra outputs), or a
        custom stream builder's. A multi-step row's earlier tokens go first, one each;
        the runner's output carries the last. False when the request failed."""
        earlier = oc.tokens[:-1] if oc.tokens is not None else []
        lps = oc.logprobs or [None] * len(earlier)
        outs = [RequestOutput(req.rid, t, logprob=lp) for t, lp in zip(earlier, lps)]
        if req_output is None:
            req_output = RequestOutput(req.rid, oc.token, logprob=oc.logprob)
        req_output.finished = oc.finished
        outs.append(req_output)
        for out in outs:
            if inline:
                if out.data is not None:
                    self._pending.append(stream_message(req, out))
            elif not self._emit_stream(req, out):
                return False
        return True

    def _emit_stream(self, req: Request, req_output: RequestOutput) -> bool:
        rid = req.rid
        try:
            msgs = call_user("stream output builder", self.stream_output_builder, rid, req.data, req_output)
            msgs = list(msgs)
        except errors.OmniAsyncError as err:
            self.fail_request(req, err)
            return False
        if msgs and debug_enabled() and rid not in self._first_emitted:
            self._first_emitted.add(rid)
            log.debug("scheduler_first_emit", request_id=rid)
        for msg in msgs:
            self.send(msg)
        return True


def _unlink(data: RequestData) -> None:
    """Cut the request's link back to its data when it ends, so that the two are freed
    by reference counting, not left as a cycle for the cyclic GC (whose full passes
    stalled the loop for hundreds of ms under a burst). Safe: the core holds no ended
    request, and a step still in flight reaches the data through its own rows
    (``SchedulerRequest.data``); ``data.req`` stays for the result and the caller."""
    data.req.data = None
    data.req.sched_entry = None  # it holds ``data`` too
