"""A one-forward step's results applied to its requests: tokens appended, finishes found.

Pure over the batch's requests: the rows that end are returned with their reason, and the
batch core finishes them (their KV is its to free). A multi-step decode's results go
through :func:`omni_async.core.multi_step.process_multi_step`, which returns the same pair.
At batch 256 each microsecond per row is a quarter millisecond of the loop per step, so
the pass is one flat loop with its lookups hoisted."""

from __future__ import annotations

from itertools import repeat
from typing import Any, Sequence

from .batch import ScheduledBatch
from .protocol import StepOutcome
from .request import Request, stop_index


def process_one_forward(
    batch: ScheduledBatch, tokens: Sequence[int], logprobs: Sequence[float] | None, context_length: int,
    accepted: list[Any] | None = None, rewound: list[Request] | None = None,
) -> tuple[list[StepOutcome], list[tuple[Request, str]]]:
    """Each live row's outcome, and the rows that end with this step and why. The
    matchers of constrained rows that run on are appended to ``accepted`` (their next
    masks are queued together once the step is processed), else each queues its own.
    A row whose grammar refuses the token it sampled before its mask keeps nothing and
    goes into ``rewound`` (the batch core takes it back a token, :func:`rewind`)."""
    outcomes: list[StepOutcome] = []
    finishes: list[tuple[Request, str]] = []
    add = outcomes.append
    ctx = context_length
    lps = logprobs if logprobs is not None else repeat(None)
    if len(tokens) and type(tokens[0]) is not int:  # a runner's own values: Python ints once per step
        tokens = [int(t) for t in tokens]
    for req, epoch, keep, token, logprob in zip(batch.reqs, batch.epochs, batch.samples_kept, tokens, lps):
        if req.finish_reason is not None or req.epoch != epoch:
            continue  # finished or retracted after this step was scheduled
        if not keep:
            add(StepOutcome(req, None))
            continue
        req.num_inflight -= 1
        if req.to_finish is not None:
            finishes.append((req, req.to_finish))
            add(StepOutcome(req, None, finished=True))
            continue
        out = req.output_ids
        matcher = req.matcher
        guessed = matcher is not None and len(out) >= matcher.masked_until  # sampled first (structured.optimistic)
        if guessed and not matcher.take([token]) and matcher.failed is None:  # refused
            if rewound is not None:
                rewound.append(req)
            add(StepOutcome(req, None))
            continue
        out.append(token)
        if logprob is not None:
            logprob = float(logprob)
            req.output_logprobs.append(logprob)
        n = len(out)
        sp = req.sampling
        stops = req._stop_ids  # computed once per request (``Request.stop_ids``)
        if stops is None:
            stops = req.stop_ids()
        reason = None
        if (token in stops and n > sp.min_new_tokens) or (matcher is not None and (
                (matcher.failed is not None or matcher.complete) if guessed else matcher.accept(token, later=accepted, index=n - 1))):
            reason = "stop"  # a stop token, or the grammar is complete
            if matcher is not None and matcher.failed:  # the grammar failed, not complete:
                finishes.append((req, "error"))  # no token; the stage ends it with an error
                add(StepOutcome(req, None, finished=True))
                continue
        elif n >= sp.max_new_tokens or n + req.num_inflight >= ctx - len(req.prompt_ids):
            reason = "length"  # Request.tokens_left(ctx, scheduling=False) <= 0, without the call
        if reason is not None:
            finishes.append((req, reason))
            add(StepOutcome(req, token, logprob, finished=True))
        else:
            add(StepOutcome(req, token, logprob))
    return outcomes, finishes


def end_unsampled(batch: ScheduledBatch, outcomes: list[StepOutcome], finishes: list[tuple[Request, str]]) -> None:
    """A request scoring its prompt with ``max_new_tokens=0`` ends when its last prefill
    chunk is processed ("length", or its abort), with no token: its row sampled nothing
    and it never decodes (no token is left to it)."""
    ending = {id(req) for req, epoch in batch.ends_unsampled if req.finish_reason is None and req.epoch == epoch}
    for oc in outcomes:
        if id(oc.req) in ending:
            oc.finished = True
            finishes.append((oc.req, oc.req.to_finish or "length"))


def rewind(req: Request) -> None:
    """Take ``req`` back to its last kept token after its grammar refused the token it
    sampled first (``structured.optimistic``): every token still in flight is dropped
    (a new epoch: the rows of steps launched since are skipped, and the runner gives the
    request a fresh slot), the last kept token is computed again by its next step (which
    samples the refused position, under the mask), and its draws move to a fresh seed
    (``runners.sampling.stream_seed``), so the redraw is independent of the refused one.
    Its pages stay: the positions past the kept tokens are written again before they are
    read. A prefill's token is masked first, so the position computed again is never in
    a page the prefix cache shares."""
    req.epoch += 1
    req.num_inflight = req.num_ahead = 0
    req.num_cached = req.seq_len - 1
    req.num_rewinds += 1
    req.matcher.refused_at(len(req.output_ids))


def take_guessed(req: Request, row: list[int], limit: int, stop_ids: frozenset[int]) -> tuple[list[int], str | None]:
    """A row that sampled before its mask (``structured.optimistic``): its grammar takes
    the admissible prefix of its tokens in one call, then what it keeps ends at the first
    of a stop id (past ``min_new_tokens``), the grammar's completion, its length limit
    (``limit``: tokens left before this step) and the refused token ("rewind": neither it
    nor its followers are kept), whichever comes first, as ``walk_row`` would
    find token by token ("error": the grammar failed; nothing kept). A multi-step row's."""
    matcher = req.matcher
    n = matcher.take(row)
    if matcher.failed:
        return [], "error"
    cut, reason = n, None
    if n and matcher.complete:
        reason = "stop"  # it completed at the last token it took
    elif n < len(row):
        reason = "rewind"
    j = stop_index(row[:cut], stop_ids, len(req.output_ids), req.sampling.min_new_tokens) if stop_ids else None
    if j is not None:
        cut, reason = j + 1, "stop"
    last = limit if limit > 1 else 1
    if last < cut or (last == cut and reason != "stop"):
        cut, reason = last, "length"
    kept = row[:cut] if cut < len(row) else row
    req.output_ids.extend(kept)
    return kept, reason


def walk_row(req: Request, row: Sequence[int], row_lps: Sequence[float] | None, ctx: int,
              accepted: list[Any] | None = None, ahead: tuple[int, bool] | None = None):
    """A row holding a stop id or under a grammar's mask, token by token: what it keeps,
    their logprobs, and why it ended (None: it runs on; "error": its grammar failed). The
    checks are those of a one-forward step (:func:`process_one_forward`), in the same order.
    ``ahead``: ``(taken, ended)``, the row's first ``taken`` tokens already accepted by its
    matcher during the step (masks between forwards), ``ended``: the last of them ended
    its grammar; the matcher accepts only the tokens after them here."""
    out, sp, stop_ids, matcher = req.output_ids, req.sampling, req.stop_ids(), req.matcher
    taken, ended = ahead or (0, False)
    kept: list[int] = []
    lps: list[float] | None = [] if row_lps is not None else None
    for j, t in enumerate(row):
        token = int(t)
        out.append(token)
        kept.append(token)
        if lps is not None:
            lp = float(row_lps[j])  # type: ignore[index]
            req.output_logprobs.append(lp)
            lps.append(lp)
        n = len(out)
        if (token in stop_ids and n > sp.min_new_tokens) or (matcher is not None and (
                (ended and j == taken - 1) if j < taken else matcher.accept(token, later=accepted, index=n - 1))):
            return kept, lps, "error" if matcher is not None and matcher.failed else "stop"
        if req.tokens_left(ctx, scheduling=False) <= 0:
            return kept, lps, "length"
    return kept, lps, None


def take_between(req: Request, row: list[int], limit: int, stop_ids: frozenset[int], ahead: tuple[int, bool],
                 ctx: int, accepted: list[Any] | None) -> tuple[list[int], str | None]:
    """:func:`walk_row` of a multi-step row that sampled every forward under masks computed between
    them, judged together where its matcher took the tokens during the step (``ahead``:
    how many, and whether the last ended its grammar): the first of a stop id (past
    ``min_new_tokens``), its grammar's end and its length ``limit`` (tokens left before
    this step) ends it there, in ``walk_row``'s order at one token; the tokens after
    those, usually the last, go through ``walk_row`` (the matcher accepts them and queues
    the next mask). A step of 8 forwards walked token by token cost the host ~3 us a
    row-token (the null device, tools/constrained_host.py --profile)."""
    taken, ended = ahead
    cut, reason = len(row), None
    if taken:
        end = taken - 1 if ended else None
        failed = ended and req.matcher.failed is not None  # (at its end: the runner's matcher took no token after it)
        j = stop_index(row[:taken], stop_ids, len(req.output_ids), req.sampling.min_new_tokens) if stop_ids else None
        if j is not None and (end is None or j < end):
            end, failed = j, False  # a stop id before the grammar's end: the walk never reaches that
        last = (limit if limit > 1 else 1) - 1  # the token at which the length ends it
        if end is not None:
            cut, reason = end + 1, "error" if failed else "stop"
        if last < taken and (end is None or last < end):
            cut, reason = last + 1, "length"
    if reason is not None or taken >= len(row):
        kept = row[:cut] if cut < len(row) else row
        req.output_ids.extend(kept)
        return kept, reason
    head = row[:taken]
    req.output_ids.extend(head)
    tail, _, reason = walk_row(req, row[taken:], None, ctx, accepted)
    return head + tail, reason
