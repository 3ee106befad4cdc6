"""Multi-step decode in the batch core (``decode_steps`` = k > 1).

One scheduled decode step covers up to k forwards per row: the runner runs them back to
back on the device, each reading the tokens the one before sampled there, and the host
sees the k tokens of every row at once. What the host does per step (scheduling, the
launch, collecting, finish checks, emission, waking readers) then happens once per k
tokens instead of once per token.

Scheduling gives each row ``min(k, tokens left before its length limit)`` forwards and
the pages they write. Processing walks each row's tokens in order and stops at the first
that finishes it: later tokens of that row are dropped, as if they were never sampled,
so the tokens equal those of k = 1. Their KV writes land beyond the finished sequence
(positions no page index covers) and their pages are released with the request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from .conditioning import ready_positions
from .core_state import DecodeSteps
from .protocol import StepOutcome, StepOutcomes
from .request import Request, decode_limits, mask_ready, masked, stop_index

if TYPE_CHECKING:
    from .batch import ScheduledBatch
    from .core_state import CoreState


def decoding_rows(running: list[Request], context_length: int, late: bool = False, free: bool = False
                  ) -> tuple[list[Request], list[int]]:
    """The running requests that still need a decode step, and their ``decode_limits``:
    not once the tokens sampled (in flight too) reach the length limit, so a lookahead
    loop spends no step on them; not while a conditioned request's next position has no
    row yet (it waits in running; the stream chunk that brings the row wakes the loop);
    not while a constrained request's last token is in flight (its mask needs it), unless
    ``late`` (:func:`.request.mask_ready`). ``free``: every running request is
    :func:`.request.all_free` (the caller checked), so only the limits decide."""
    limits = decode_limits(running, context_length)  # (one pass: the step's forwards per row are cut to them)
    if free and (not limits or min(limits) > 0):
        return list(running), limits
    pairs = [(r, left) for r, left in zip(running, limits)
             if left > 0 and (r.conditioning is None or ready_positions(r, 1)) and (r.matcher is None or mask_ready(r, late))]
    return [r for r, _ in pairs], [left for _, left in pairs]


def steps_for(core: "CoreState", decoding: list[Request], limits: list[int] | None = None,
              free: bool = False) -> tuple[list[int] | None, list[int]]:
    """Forwards per row of the next decode step (None for one forward: a small batch
    under the automatic choice, or a runner that hands out per-step hidden states), and
    the rows under a grammar (they run one forward, beside the others). ``limits``: the
    rows' ``decode_limits`` when the caller has them; ``free``: as in :func:`row_steps`."""
    k = core.forwards_for(len(decoding), (r.num_generated for r in decoding))
    if k <= 1 or not core.multi_step_allowed():
        return None, []
    return row_steps(decoding, k, core.context_length, limits, free)


def row_steps(decoding: list[Request], k: int, context_length: int,
              limits: list[int] | None = None, free: bool = False) -> tuple[list[int] | None, list[int]]:
    """Forwards per row: k, or fewer where the row's token or context limit comes first
    (counting tokens still in flight) or a conditioned row's rows run out; and the rows
    under a grammar's mask, which sample one token (their next mask needs the host to have
    seen their last token), so the free rows beside them keep their k forwards (rows that
    sample before their mask, ``structured.optimistic``, take those they are likely to
    keep: ``GrammarMatcher.guess_forwards``): one forward, or one per token without KV
    when a jump-forward appended forced tokens (fed in, the last forward samples). None
    (one forward for every row) while a row asks for top logprobs, which are read per
    forward, when no row runs more than one, or when a row's forced tokens need more than
    k forwards (a jump step takes them). ``free``:
    every row is :func:`.request.all_free` (the caller checked), so each runs
    ``min(k, its limit)``, with no per-row check."""
    if limits is None:
        limits = decode_limits(decoding, context_length)
    if free:
        return ([k] * len(limits) if min(limits, default=k) >= k else [k if left >= k else left for left in limits]), []
    if any(r.sampling.top_logprobs for r in decoding):
        return None, []
    steps: list[int] = []
    constrained: list[int] = []
    guessing = False
    for i, (r, left) in enumerate(zip(decoding, limits)):
        if r.matcher is not None and masked(r, r.num_generated):
            constrained.append(i)
            uncached = r.seq_len - r.num_cached  # 1, or 1 + the forced tokens of a jump-forward
            if uncached > k:
                return None, []
            steps.append(uncached)
        else:
            n = k if left >= k else left
            if r.matcher is not None:  # sampling first: the forwards it is likely to keep
                n, guessing = r.matcher.guess_forwards(n), True
            steps.append(n if r.conditioning is None else ready_positions(r, n))
    if (constrained or guessing) and max(steps) <= 1:
        return None, []
    return steps, constrained


# A step whose rows waiting for their last token (masked rows with it in flight) are at
# least this share of its rows runs one forward per row under late masks, all of them in it,
# rather than a fused launch of the others (:func:`late_mask_rows`).
LATE_MAJORITY = 0.5


def late_mask_rows(core: "CoreState", decoding: list[Request], limits: list[int], free: bool = False
                   ) -> tuple[list[Request], list[int], list[int] | None, list[int], bool]:
    """The rows of the next decode step (``decoding`` may hold constrained rows with their
    last token in flight, :func:`.request.mask_ready` with ``late``) and their ``limits``,
    forwards and grammar rows (:func:`steps_for`), and whether the step samples under
    late masks: the one place that decides whether such a row runs in this step.

    Its mask needs that token accepted by its matcher, which happens when the step in
    flight is processed. A step of one forward per row takes it: its launch enqueues the
    forward, and the stepper samples only after processing the step before (launch t+1,
    process t, sample t+1: ``Stepper.step_ahead``, the runner's ``sample_pending``), so
    the masks are computed while the forward runs and such rows run in every step
    instead of every other one (when every row is constrained, the loop no longer drains
    to a synchronous step each time). When the other rows alone get a fused multi-step
    launch, which samples every forward inside the launch (the free rows' later forwards
    read those tokens), such a row waits for the next step and the free rows keep their
    k forwards (one :func:`steps_for` per step either way), unless such rows are at least
    :data:`LATE_MAJORITY` of the step's: a fused launch would then run k forwards for its
    minority while most rows sample every other step (as in an all-constrained batch whose
    rows sampling first, ``structured.optimistic``, make the rest a fused launch: most likely
    why an H100 run masked ~101 of 256 rows a step), so the step takes one forward per row
    under late masks and every row samples.
    Not with
    jump_forward: processing a step may append forced tokens to a row, which would move
    the position its launched forward computed; late masks apply only with it off.
    ``free``: no row is under a grammar (:func:`.request.all_free`)."""
    if free:
        return (decoding, limits, *steps_for(core, decoding, limits, True), False)
    keep = [i for i, r in enumerate(decoding) if r.matcher is None or not r.num_inflight or not masked(r, r.num_generated)]
    if len(keep) == len(decoding):
        return (decoding, limits, *steps_for(core, decoding, limits), False)
    rest, rest_limits = [decoding[i] for i in keep], [limits[i] for i in keep]
    steps, grammar = steps_for(core, rest, rest_limits) if rest else (None, [])
    waiting = len(decoding) - len(rest)
    if core.config.jump_forward or (steps is not None and waiting < LATE_MAJORITY * len(decoding)):
        return rest, rest_limits, steps, grammar, False  # a fused launch: they wait for the next step
    return decoding, limits, None, [], True  # one forward per row, theirs too


def process_multi_step(
    batch: "ScheduledBatch", tokens: Sequence[int], logprobs: Sequence[float] | None, context_length: int,
    accepted: list[Any] | None = None, rewound: list[Request] | None = None,
) -> tuple[StepOutcomes, list[tuple[Request, str]]]:
    """``process_result`` of a multi-step decode: each live row's outcome, and the rows
    that end with it and why (the batch core finishes those: their KV is its to free).
    ``tokens`` (and ``logprobs``) are forward-major: row i's j-th token is at
    ``j * batch.size + i``. ``accepted`` and ``rewound``: as in
    ``step_results.process_one_forward``.

    A plain row (live, free of a grammar, no abort pending, no stop id among its tokens,
    short of its length limit) costs a slice, an extend and two appends to the step's
    columns (:class:`.protocol.StepOutcomes`; no outcome object): at 256 rows and 8
    forwards that is most rows of most steps. The length test is ``landing_limits``'
    rule written as two comparisons (the limit is above the row's forwards when its kept
    tokens and forwards stay below ``max_new_tokens`` and everything it has sampled stays
    below the context); every other row takes :func:`_process_row`, the full checks."""
    outcomes: list[StepOutcome] = []
    finishes: list[tuple[Request, str]] = []
    size, ctx = batch.size, context_length
    assert batch.row_steps is not None
    if len(tokens) and type(tokens[0]) is not int:  # a runner's own values: Python ints once per step
        tokens = [int(t) for t in tokens]
    if logprobs is not None and len(logprobs) and type(logprobs[0]) is not float:
        logprobs = [float(lp) for lp in logprobs]
    plain_reqs: list[Request] = []
    plain_tokens: list[list[int]] = []
    plain_lps: list[list[float]] | None = None if logprobs is None else []
    add_req, add_tokens = plain_reqs.append, plain_tokens.append
    under_mask = set(batch.grammar_rows)  # rows sampling one token under their mask
    for i, (req, epoch, steps) in enumerate(zip(batch.reqs, batch.epochs, batch.row_steps)):
        if req.finish_reason is not None or req.epoch != epoch:
            continue  # finished or retracted after this step was scheduled
        out, inflight = req.output_ids, req.num_inflight
        kept = len(out)
        if (req.matcher is None and req.to_finish is None and kept + steps < req.sampling.max_new_tokens
                and kept + inflight < ctx - len(req.prompt_ids)):
            end = i + steps * size
            row = tokens[i:end:size]  # the row's tokens, forward by forward
            stop_ids = req._stop_ids
            if stop_ids is None:
                stop_ids = req.stop_ids()
            if not stop_ids or stop_ids.isdisjoint(row):
                req.num_inflight = inflight - steps
                out.extend(row)
                add_req(req)
                add_tokens(row)
                if plain_lps is not None:
                    lps = logprobs[i:end:size]
                    req.output_logprobs.extend(lps)
                    plain_lps.append(lps)
                continue
        by_count = req.sampling.max_new_tokens - kept  # the row's landing limit (request.landing_limits)
        by_context = ctx - len(req.prompt_ids) - kept - (inflight - steps)
        limit = by_count if by_count < by_context else by_context
        _process_row(req, i, steps, limit, i in under_mask, batch, tokens, logprobs, ctx, outcomes, finishes,
                     accepted, rewound)
    return StepOutcomes(batch.reqs, outcomes, plain_reqs, plain_tokens, plain_lps), finishes


def _process_row(req: Request, i: int, steps: int, limit: int, masked_row: bool, batch: "ScheduledBatch",
                 tokens: Sequence[int], logprobs: Sequence[float] | None, ctx: int, outcomes: list[StepOutcome],
                 finishes: list[tuple[Request, str]], accepted: list[Any] | None, rewound: list[Request] | None) -> None:
    """A live row of a multi-step decode that may end or is under a grammar, with every
    check: its abort, its stop ids (past ``min_new_tokens``), its length ``limit``
    (tokens left before this step, ``request.landing_limits``), its grammar."""
    size = batch.size
    req.num_inflight -= 1 if masked_row else steps  # a masked row samples one (see feed_rows)
    if req.to_finish is not None:
        finishes.append((req, req.to_finish))
        outcomes.append(StepOutcome(req, None, finished=True))
        return
    stop_ids = req.stop_ids()
    end = i + steps * size
    row = tokens[i:end:size]  # the row's tokens, forward by forward
    if req.matcher is None and (not stop_ids or stop_ids.isdisjoint(row)):  # only limits can end it
        kept, reason = (row, None) if limit > steps else (row[: max(1, limit)], "length")
        req.output_ids.extend(kept)
        lps = None
        if logprobs is not None:
            lps = [float(lp) for lp in logprobs[i:end:size][: len(kept)]]
            req.output_logprobs.extend(lps)
    elif req.matcher is not None and not masked_row:  # sampled before its mask (structured.optimistic)
        kept, reason = _take_guessed(req, row, limit, stop_ids)
        lps = None
        if reason == "rewind":
            if rewound is not None:
                rewound.append(req)
            outcomes.append(StepOutcome(req, kept[-1], tokens=kept) if kept else StepOutcome(req, None))
            return
    else:
        first = i
        if masked_row:  # one token sampled, by its last forward (the others fed forced tokens)
            row, first = row[-1:], end - size
        kept, lps, reason = _walk_row(req, row, None if logprobs is None else logprobs[first:end:size], ctx, accepted)
    if reason == "error":  # its grammar failed: no token; the stage ends it with an error
        finishes.append((req, reason))
        outcomes.append(StepOutcome(req, None, finished=True))
        return
    if reason is not None:
        finishes.append((req, reason))
    last_lp = lps[-1] if lps else None
    outcomes.append(StepOutcome(req, kept[-1], last_lp, finished=reason is not None, tokens=kept, logprobs=lps))


def _walk_row(req: Request, row: Sequence[int], row_lps: Sequence[float] | None, ctx: int,
              accepted: list[Any] | None = None):
    """A row holding a stop id or under a grammar's mask, token by token: what it keeps,
    their logprobs, and why it ended (None: it runs on; "error": its grammar failed). The
    checks are those of a one-forward step (``core.step_results``), in the same order."""
    out, sp, stop_ids, matcher = req.output_ids, req.sampling, req.stop_ids(), req.matcher
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
        if (token in stop_ids and n > sp.min_new_tokens) or (matcher is not None and matcher.accept(token, later=accepted, index=n - 1)):
            return kept, lps, "error" if matcher is not None and matcher.failed else "stop"
        if req.tokens_left(ctx, scheduling=False) <= 0:
            return kept, lps, "length"
    return kept, lps, None


def _take_guessed(req: Request, row: list[int], limit: int, stop_ids: frozenset[int]) -> tuple[list[int], str | None]:
    """A row that sampled before its mask (``structured.optimistic``): its grammar takes
    the admissible prefix of its tokens in one call, then what it keeps ends at the first
    of a stop id (past ``min_new_tokens``), the grammar's completion, its length limit
    (``limit``: tokens left before this step) and the refused token ("rewind": neither it
    nor its followers are kept), whichever comes first, as :func:`_walk_row` would find
    token by token ("error": the grammar failed; nothing kept)."""
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


# ---------------------------------------------------------------- jump-forward


def jump_rows(outcomes: Sequence[StepOutcome], finishes: list[tuple[Request, str]], context_length: int, most: int,
              due: list[tuple[Request, int]], hidden_for_all: bool = False) -> None:
    """After a step's processing: each live row under a grammar that may jump
    (:func:`omni_async.structured.jump.can_jump`; none where ``hidden_for_all``: the
    stage hands every row's hidden states on) takes the tokens its grammar now forces,
    at most ``most`` (its outcome carries them; it ends if they end it). The requests
    left with tokens to compute go into ``due`` with their epoch: their next step
    computes them (:func:`feed_rows`, or :func:`omni_async.core.mixed_prefill.jump_step`)."""
    from ..structured.jump import can_jump, jump_forward

    for oc in (outcomes.rest if type(outcomes) is StepOutcomes else outcomes):  # a plain row has no grammar
        req = oc.req
        if req.matcher is None or oc.finished or oc.token is None or not can_jump(req, hidden_for_all):
            continue
        run, reason = jump_forward(req, context_length, most)
        if not run:
            continue
        oc.tokens = (oc.tokens or [oc.token]) + run
        oc.token = run[-1]
        if reason == "error":  # the grammar failed on a forced token: the stage ends it with an error
            oc.token, oc.tokens, oc.finished = None, None, True
            finishes.append((req, reason))
        elif reason is not None:
            oc.finished = True
            finishes.append((req, reason))
        else:
            due.append((req, req.epoch))


def still_due(due: list[tuple[Request, int]]) -> dict[int, Request]:
    """The requests of ``due`` whose forced tokens still wait for their KV (not ended,
    retracted or scheduled since), by id."""
    return {id(r): r for r, epoch in due
            if r.finish_reason is None and r.epoch == epoch and not r.num_inflight and r.seq_len - r.num_cached > 1}


def feed_rows(batch: "ScheduledBatch") -> None:
    """A multi-step decode's grammar rows whose forced tokens wait for their KV (those
    :func:`row_steps` gave more than one forward) run one forward per such token and one
    more: the first reads the token after their KV, the others are fed the tokens in turn
    (:func:`fed_inputs`), and only the last samples, at the generation index that follows
    them. Called once ``fill_decode`` counted the row's forwards in flight: one token is."""
    assert batch.row_steps is not None
    for i in batch.grammar_rows:
        req = batch.reqs[i]
        s = batch.row_steps[i]
        if s <= 1:
            continue
        batch.input_ids[i] = _token_at(req, batch.prefix_lens[i])
        batch.sample_indices[i] -= s - 1
        req.num_inflight -= s - 1


def fed_inputs(batch: "ScheduledBatch") -> list[tuple[int, list[int]]]:
    """``(row, tokens)`` of the rows fed forced tokens (:func:`feed_rows`): the inputs of
    their forwards 1 .. s-1. Their requests are not in flight, so the tokens stand."""
    if not batch.grammar_rows or batch.row_steps is None:
        return []
    fed = []
    for i in batch.grammar_rows:
        s = batch.row_steps[i]
        if s > 1:
            p = batch.prefix_lens[i]
            req = batch.reqs[i]
            fed.append((i, [_token_at(req, p + j) for j in range(1, s)]))
    return fed


def _token_at(req: Request, position: int) -> int:
    prompt = len(req.prompt_ids)
    return req.prompt_ids[position] if position < prompt else req.output_ids[position - prompt]


def take_due(core: "CoreState", decoding: list[Request]) -> dict[int, Request] | None:
    """The requests whose forced tokens wait for their KV and are still due (None for
    none); one not decoding in this step keeps its place for a later one."""
    due = still_due(core.jump_due) if core.jump_due else None
    core.jump_due = []
    if due:
        stepping = {id(r) for r in decoding}
        core.jump_due = [(r, r.epoch) for key, r in due.items() if key not in stepping]
    return due


def jump_most(plan: DecodeSteps, page_size: int) -> int:
    """The most forced tokens one jump-forward takes: with multi-step decodes, as many as
    one fused launch then feeds (k - 1); else a page's worth (a decode step's KV bound
    stays one page a row)."""
    return plan.most - 1 if plan.most > 1 else page_size - 1
