"""Jump-forward in a multi-step decode (``SchedulerConfig.jump_forward``): the tokens a
grammar forces, appended to a row when its step is processed (:func:`jump_rows`), and
their KV computed in the row's next step, fed as the inputs of its forwards after the
first (:func:`feed_rows`, :func:`fed_inputs`) or, in a step of one forward per row, as
an extend row (:func:`omni_async.core.mixed_prefill.jump_step`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from .core_state import DecodeSteps
from .protocol import StepOutcome, StepOutcomes
from .request import Request

if TYPE_CHECKING:
    from .batch import ScheduledBatch
    from .core_state import CoreState


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
    if not batch.grammar_rows or batch.row_steps is None or batch.masks_between:
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
