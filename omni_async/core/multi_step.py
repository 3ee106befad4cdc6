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
from .step_results import take_between, take_guessed, walk_row

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
    the rows under a grammar (they run one forward, beside the others, or several under
    masks between forwards). ``limits``, ``free``: as in :func:`row_steps`."""
    k = core.forwards_for(len(decoding), (r.num_generated for r in decoding))
    if k <= 1 or not core.multi_step_allowed():
        return None, []
    return row_steps(decoding, k, core.context_length, limits, free, between=0 if core.config.jump_forward else most_forwards(core, k))


def row_steps(decoding: list[Request], k: int, context_length: int, limits: list[int] | None = None,
              free: bool = False, between: int = 0) -> tuple[list[int] | None, list[int]]:
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
    ``min(k, its limit)``, with no per-row check. ``between`` (> 1): masked rows at least
    :data:`LATE_MAJORITY` of the step's take up to that many forwards each under masks
    computed between the forwards (:func:`between_steps`); 0: one each."""
    if limits is None:
        limits = decode_limits(decoding, context_length)
    if free:
        return ([k] * len(limits) if min(limits, default=k) >= k else [k if left >= k else left for left in limits]), []
    if any(r.sampling.top_logprobs for r in decoding):
        return None, []
    steps: list[int] = []
    constrained: list[int] = []
    guessing: list[int] = []
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
                n = r.matcher.guess_forwards(n)
                guessing.append(i)
            steps.append(n if r.conditioning is None else ready_positions(r, n))
    if between > 1 and constrained:
        between_steps(decoding, steps, constrained, guessing, limits, between)
    if (constrained or guessing) and max(steps) <= 1:
        return None, []
    return steps, constrained


def between_steps(decoding: list[Request], steps: list[int], constrained: list[int], guessing: list[int],
                  limits: list[int], k: int) -> None:
    """Masked rows (``constrained``, one forward each so far) take several forwards a
    step, their masks computed between the forwards (``runners/multi_forward.py``,
    ``structured/between.py``): the runner enqueues forward j + 1, reads forward j's
    tokens, advances the rows' matchers by them and fills forward j + 1's masks while the
    device runs it, then samples. A masked row otherwise takes one token a step, so a
    batch of mostly constrained rows ran k times the steps of a free one, each with its
    host cost (issue 61). Only when such rows are at least :data:`LATE_MAJORITY` of the
    step's: the step runs forward by forward (a fused launch samples inside, where no
    host can mask), so a minority keeps its one forward inside the free rows' fused
    launch. Not for a row fed forced tokens (jump-forward: the caller passes ``between``
    only without it).

    A masked row may run ``min(k, its limit, the positions it samples under its mask)``;
    the step runs the most that half of them may (every row computes each forward of the
    step, so a longer step would run forwards for nothing for the rest), and every row
    at most that: the free rows too, and rows sampling first (``guessing``) as many, up
    to their limits (a guess admitted is a token kept)."""
    if len(constrained) < LATE_MAJORITY * len(decoding):
        return
    caps = [min(k, limits[i], decoding[i].matcher.masked_until - decoding[i].num_generated) for i in constrained]
    n = sorted(caps, reverse=True)[(len(caps) - 1) // 2]
    if n <= 1:
        return
    for i, cap in zip(constrained, caps):
        steps[i] = min(cap, n) if cap > 1 else 1
    for i in guessing:
        steps[i] = min(n, limits[i])
    for i, s in enumerate(steps):
        if s > n:
            steps[i] = n


# Forwards a step of masked rows may run under masks between them, above the plan's k (at
# most page_size). Such a step waits for the one before (:func:`waits_for_between`), once a
# step: longer steps spread that wait thinner (issue 61). 0: the plan's k.
BETWEEN_FORWARDS = 0


def most_forwards(core: "CoreState", k: int | None = None) -> int:
    """The most forwards a row's step of ``k`` (default: the plan's most) may run: more under masks between forwards."""
    k = core.decode_plan.most if k is None else k
    return k if core.config.jump_forward or k <= 1 else min(max(k, BETWEEN_FORWARDS), core.config.page_size)


def masks_between(core: "CoreState", steps: list[int] | None, grammar: list[int]) -> bool:
    """Whether a decode step's masked rows sample each forward under masks computed
    between the forwards (:func:`between_steps`): some run more than one forward, which,
    without jump-forward's fed tokens, only that gives them."""
    return steps is not None and not core.config.jump_forward and any(steps[i] > 1 for i in grammar)


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
    minority while most rows sample every other step, so the step takes one forward per row
    under late masks and every row samples. That holds only where a step runs one forward
    (k = 1): with more, such rows wait for their tokens and then run several forwards a
    step under masks computed between the forwards (:func:`between_steps`), which a
    one-forward late step would cut back to one token; or, under :data:`LATE_BETWEEN`,
    such a step samples late too, its first forward launched now (:func:`late_between`). Not with
    jump_forward: processing a step may append forced tokens to a row, which would move
    the position its launched forward computed; late masks apply only with it off.
    ``free``: no row is under a grammar (:func:`.request.all_free`)."""
    if free:
        return (decoding, limits, *steps_for(core, decoding, limits, True), False)
    if waits_for_between(core):
        return late_between(core, decoding, limits)
    keep = [i for i, r in enumerate(decoding) if r.matcher is None or not r.num_inflight or not masked(r, r.num_generated)]
    if len(keep) == len(decoding):
        return (decoding, limits, *steps_for(core, decoding, limits), False)
    rest, rest_limits = [decoding[i] for i in keep], [limits[i] for i in keep]
    steps, grammar = steps_for(core, rest, rest_limits) if rest else (None, [])
    waiting = len(decoding) - len(rest)
    if core.config.jump_forward or (steps is not None and waiting < LATE_MAJORITY * len(decoding)):
        return rest, rest_limits, steps, grammar, False  # a fused launch: they wait for the next step
    return decoding, limits, None, [], True  # one forward per row, theirs too


# Steps of masked rows under masks between forwards launched while the step before is in
# flight, sampling once it is processed (:func:`late_between`); off: the loop drains to them.
# Off by default until a GPU measures it (issue 61).
LATE_BETWEEN = False


def late_between(core: "CoreState", decoding: list[Request], limits: list[int]
                 ) -> tuple[list[Request], list[int], list[int] | None, list[int], bool]:
    """:func:`late_mask_rows`' step when it :func:`waits_for_between`: none (the loop drains
    and the step comes after), or, under :data:`LATE_BETWEEN`, the step of every row ready
    under late masks, launched now: its launch enqueues its first forward, whose inputs are
    the tokens in flight, already on the device; the stepper processes the step before and
    then has the runner fill that forward's masks, sample it and run the forwards after it
    under masks between them (``Stepper.step_ahead``, ``ModelRunner.sample_pending``). On a
    GPU the device then runs the first forward while the host processes the step before,
    instead of idling through that processing, the scheduling and the launch each step.
    Each row's forwards are decided now, from the limits that count its tokens in flight;
    a row the processing ends drops the step's tokens, as rows ending mid-step do. Only a
    step whose masked rows do run several forwards (:func:`masks_between`), and not while
    prompts wait for a running slot: a drain gives prefills their turns back to back, so
    rows admitted apart then step together; late steps between them split the rows into
    groups finishing apart (16 rows admitted two a prefill: 27 decode steps, not 11)."""
    if LATE_BETWEEN and core.chunked is None and (not core.waiting or len(core.running) >= core.config.max_running_requests):
        steps, grammar = steps_for(core, decoding, limits)
        if masks_between(core, steps, grammar):
            return decoding, limits, steps, grammar, True
    return [], [], None, [], False


def count_ahead(batch: "ScheduledBatch") -> None:
    """A step under masks between forwards, under :data:`LATE_BETWEEN`: each masked row's
    matcher takes all its tokens but the last while the step runs, so its next mask waits
    only for that last one (``Request.num_ahead``, :func:`.request.mask_ready`); processing
    returns them (:func:`_process_row`). Counted when scheduled, not as the runner takes
    them: on the CPU the launch runs on the worker while the next step is scheduled."""
    if LATE_BETWEEN and batch.masks_between:
        steps = batch.row_steps
        for i in batch.grammar_rows:
            if steps[i] > 1:
                batch.reqs[i].num_ahead += steps[i] - 1


def waits_for_between(core: "CoreState") -> bool:
    """Whether the next decode step waits for the one in flight (the loop drains it, or
    :func:`late_between` launches it to sample once that one is processed)
    because most running rows sample under masks and some have tokens in flight: with
    k > 1 forwards a step they take several at once under masks between the forwards
    (:func:`between_steps`) once the host has seen their tokens, all of them in one step.
    Running the others meanwhile would split the rows into groups stepping in turn, each
    step reading the weights k times for part of the batch (on the CPU, small-smol at 64
    rows: twice the decode time); a one-forward late-mask step would cut them back to one
    token."""
    if core.config.jump_forward or not core.multi_step_allowed():
        return False
    running = core.running
    if core.forwards_for(len(running), (r.num_generated for r in running)) <= 1:
        return False
    under = [r for r in running if r.matcher is not None and masked(r, r.num_generated)]
    return len(under) >= LATE_MAJORITY * len(running) and any(r.num_inflight for r in under)


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
    between = masked_row and batch.masks_between  # it sampled every forward (between_steps)
    req.num_inflight -= 1 if masked_row and not between else steps  # else a masked row samples one (see feed_rows)
    if between and req.num_ahead:
        req.num_ahead -= steps - 1  # (count_ahead)
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
        kept, reason = take_guessed(req, row, limit, stop_ids)
        lps = None
        if reason == "rewind":
            if rewound is not None:
                rewound.append(req)
            outcomes.append(StepOutcome(req, kept[-1], tokens=kept) if kept else StepOutcome(req, None))
            return
    else:
        first, ahead = i, None
        if between:  # the runner's matcher took its first tokens, to mask the forwards after them
            ahead = (batch.taken_ahead[i], i in batch.ended_ahead) if batch.taken_ahead is not None else (0, False)
        elif masked_row:  # one token sampled, by its last forward (the others fed forced tokens)
            row, first = row[-1:], end - size
        if ahead is not None and logprobs is None:
            kept, reason = take_between(req, row, limit, stop_ids, ahead, ctx, accepted)
            lps = None
        else:
            kept, lps, reason = walk_row(req, row, None if logprobs is None else logprobs[first:end:size], ctx, accepted, ahead)
    if reason == "error":  # its grammar failed: no token; the stage ends it with an error
        finishes.append((req, reason))
        outcomes.append(StepOutcome(req, None, finished=True))
        return
    if reason is not None:
        finishes.append((req, reason))
    last_lp = lps[-1] if lps else None
    outcomes.append(StepOutcome(req, kept[-1], last_lp, finished=reason is not None, tokens=kept, logprobs=lps))

