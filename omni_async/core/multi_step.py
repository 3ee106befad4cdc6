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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from .conditioning import ready_positions
from .protocol import StepOutcome
from .request import Request, decode_limits, landing_limits

if TYPE_CHECKING:
    from .batch import ScheduledBatch
    from .batch_core import NativeBatchCore


@dataclass(frozen=True)
class DecodeSteps:
    """Forwards per decode step by the number of decoding requests: ``tiers`` are
    ``(fewest requests, forwards)`` pairs in ascending order; below the first, one."""

    tiers: tuple[tuple[int, int], ...] = ()

    def for_batch(self, decoding: int) -> int:
        k = 1
        for least, steps in self.tiers:
            if decoding >= least:
                k = steps
        return k

    @property
    def most(self) -> int:
        return max((k for _, k in self.tiers), default=1)


def steps_for(core: "NativeBatchCore", decoding: list[Request]) -> tuple[list[int] | None, list[int]]:
    """Forwards per row of the next decode step (None for one forward: a small batch
    under the automatic choice, or a runner that hands out per-step hidden states), and
    the rows under a grammar (they run one forward, beside the others)."""
    k = core.decode_plan.for_batch(len(decoding))
    if k <= 1 or not core.multi_step_allowed():
        return None, []
    return row_steps(decoding, k, core.context_length)


def row_steps(decoding: list[Request], k: int, context_length: int) -> tuple[list[int] | None, list[int]]:
    """Forwards per row: k, or fewer where the row's token or context limit comes first
    (counting tokens still in flight) or a conditioned row's rows run out; and the rows
    under a grammar, which run one (their next mask needs the host to have seen their
    last token), so the free rows beside them keep their k forwards. None (one forward
    for every row) while a row asks for top logprobs, which are read per forward, or
    when no row runs more than one."""
    if any(r.sampling.top_logprobs for r in decoding):
        return None, []
    steps: list[int] = []
    constrained: list[int] = []
    for i, (r, left) in enumerate(zip(decoding, decode_limits(decoding, context_length))):
        if r.matcher is not None:
            constrained.append(i)
            steps.append(1)
        else:
            n = k if left >= k else left
            steps.append(n if r.conditioning is None else ready_positions(r, n))
    if constrained and max(steps) <= 1:
        return None, []
    return steps, constrained


def process_multi_step(
    batch: "ScheduledBatch", tokens: Sequence[int], logprobs: Sequence[float] | None, context_length: int
) -> tuple[list[StepOutcome], list[tuple[Request, str]]]:
    """``process_result`` of a multi-step decode: each live row's outcome, and the rows
    that end with it and why (the batch core finishes those: their KV is its to free).
    ``tokens`` (and ``logprobs``) are forward-major: row i's j-th token is at
    ``j * batch.size + i``."""
    outcomes: list[StepOutcome] = []
    finishes: list[tuple[Request, str]] = []
    size, ctx = batch.size, context_length
    assert batch.row_steps is not None
    if tokens and type(tokens[0]) is not int:  # a runner's own values: Python ints once per step
        tokens = [int(t) for t in tokens]
    limits = landing_limits(batch.reqs, batch.row_steps, ctx)  # the length rule, one pass
    for i, (req, epoch, steps, limit) in enumerate(zip(batch.reqs, batch.epochs, batch.row_steps, limits)):
        if req.finish_reason is not None or req.epoch != epoch:
            continue  # finished or retracted after this step was scheduled
        req.num_inflight -= steps
        if req.to_finish is not None:
            finishes.append((req, req.to_finish))
            outcomes.append(StepOutcome(req, None, finished=True))
            continue
        out, stop_ids = req.output_ids, req._stop_ids
        if stop_ids is None:
            stop_ids = req.stop_ids()
        end = i + steps * size
        row = tokens[i:end:size]  # the row's tokens, forward by forward
        if req.matcher is None and (not stop_ids or stop_ids.isdisjoint(row)):  # only limits can end it
            kept, reason = (row, None) if limit > steps else (row[: max(1, limit)], "length")
            out.extend(kept)
            lps = None
            if logprobs is not None:
                lps = [float(lp) for lp in logprobs[i:end:size][: len(kept)]]
                req.output_logprobs.extend(lps)
        else:
            kept, lps, reason = _walk_row(req, row, None if logprobs is None else logprobs[i:end:size], ctx)
        if reason == "error":  # its grammar failed: no token; the stage ends it with an error
            finishes.append((req, reason))
            outcomes.append(StepOutcome(req, None, finished=True))
            continue
        if reason is not None:
            finishes.append((req, reason))
        last_lp = lps[-1] if lps else None
        outcomes.append(StepOutcome(req, kept[-1], last_lp, finished=reason is not None, tokens=kept, logprobs=lps))
    return outcomes, finishes


def _walk_row(req: Request, row: Sequence[int], row_lps: Sequence[float] | None, ctx: int):
    """A row holding a stop id or under a grammar, token by token: what it keeps, their
    logprobs, and why it ended (None: it runs on; "error": its grammar failed). The
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
        if (token in stop_ids and n > sp.min_new_tokens) or (matcher is not None and matcher.accept(token)):
            return kept, lps, "error" if matcher is not None and matcher.failed else "stop"
        if req.tokens_left(ctx, scheduling=False) <= 0:
            return kept, lps, "length"
    return kept, lps, None
