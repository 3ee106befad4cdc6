"""Per-request state: what the batch core schedules and what the runner reads."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..config import SamplingParams


@dataclass(eq=False)
class Request:
    """Scheduling state of one request.

    The sequence is ``prompt_ids + output_ids``; KV holds its first ``num_cached``
    tokens in ``pages``. ``epoch`` grows on every retraction so that a row of a step
    scheduled before the retraction is recognised as stale and skipped.
    """

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival: int = 0
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0
    # Tokens sampled by launched steps whose results the host has not processed yet
    # (overlap and async-decode loops). They count towards the sequence length.
    num_inflight: int = 0
    # Of those, the tokens its grammar's matcher takes while their step runs (masks between
    # a step's forwards take all but a row's last, ``structured.between``), counted when the
    # step is scheduled under ``multi_step.LATE_BETWEEN`` and returned when it is processed:
    # a mask waits only for the others (:func:`mask_ready`). 0 whenever nothing is in flight.
    num_ahead: int = 0
    epoch: int = 0
    finish_reason: str | None = None
    to_finish: str | None = None
    num_retractions: int = 0
    # Times a token it sampled before its grammar's mask was refused and it went back to
    # the token before (``structured.optimistic``); its draws then take a fresh seed.
    num_rewinds: int = 0
    # Failed steps this request was in. After one it is retried once, in a prefill of
    # its own, so that a request that breaks steps fails alone.
    step_failures: int = 0
    data: Any = None  # the RequestData this request belongs to
    # Prefix cache: leading pages shared through it (matched or indexed), the cache
    # epoch they belong to (None: this request's KV is never shared, e.g. it came
    # from input embeddings rather than token ids), and the prompt tokens its first
    # admission found cached.
    prefix_pages: int = 0
    prefix_epoch: int | None = None
    cached_tokens: int = 0
    # Structured output: the request's grammar matcher (``structured.grammar``), advanced
    # by every token the request keeps; None for a free request.
    matcher: Any = None
    # Rows added to the inputs of its positions from outside (a talker fed by a
    # thinker's hidden states, ``core.conditioning``); None for a plain request.
    conditioning: Any = None
    _stop_ids: frozenset[int] | None = field(default=None, repr=False)
    # The runner's view of this request (``runner_io.SchedulerRequest``), made once and
    # handed to every step it is in; dropped with ``data`` when the request ends.
    sched_entry: Any = field(default=None, repr=False)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_inflight

    @property
    def num_generated(self) -> int:
        return len(self.output_ids) + self.num_inflight

    def tokens_left(self, context_length: int, *, scheduling: bool) -> int:
        """The length limit, the one place it is written: tokens this request may still
        produce, whichever of ``max_new_tokens`` and the context comes first; at 0 (or
        less) it ends with ``"length"``. Tokens still in flight hold context positions
        either way; ``scheduling`` counts them against ``max_new_tokens`` too (they will
        arrive), while processing counts only the kept ones (a request that ends now
        drops what is still in flight)."""
        kept, pending = len(self.output_ids), self.num_inflight
        by_count = self.sampling.max_new_tokens - kept - (pending if scheduling else 0)
        by_context = context_length - len(self.prompt_ids) - kept - pending
        return by_count if by_count < by_context else by_context  # min() without its call: per row per step

    def finished(self) -> bool:
        return self.finish_reason is not None

    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def stop_ids(self) -> frozenset[int]:
        """Token ids that end the request; computed once (checked for every token)."""
        ids = self._stop_ids
        if ids is None:
            found = set(self.sampling.stop_token_ids)
            if not self.sampling.ignore_eos:
                found.update(self.eos_token_ids)
            ids = self._stop_ids = frozenset(found)
        return ids


def stop_index(row: Sequence[int], stop_ids: frozenset[int], kept: int, min_new_tokens: int) -> int | None:
    """Where a request's stop rule ends ``row``, the tokens that follow its ``kept`` ones:
    the index of the first of its ``stop_ids`` that comes after ``min_new_tokens`` tokens
    (counting itself), or None. Used where a row's tokens are judged together (a sample-first
    row, ``step_results.take_guessed``; the early launch's ending rows, ``early_launch``); the
    token-by-token checks (``step_results``, ``walk_row``) apply it to one token,
    and tests/test_early_launch.py holds the early launch's verdicts equal to processing's."""
    if stop_ids.isdisjoint(row):
        return None
    for j, token in enumerate(row):
        if token in stop_ids and kept + j + 1 > min_new_tokens:
            return j
    return None


def decode_limits(reqs: list[Request], context_length: int) -> list[int]:
    """``tokens_left(context_length, scheduling=True)`` of every row of a step, in one
    pass: the same rule written for a column, so that choosing a step's rows and their
    forwards costs no method call per row (the scheduler runs it for every running
    request on every step; tests/test_host_columns.py holds the two equal)."""
    # min(max_new_tokens - gen, context - prompt - gen) as min(max_new_tokens, context -
    # prompt) - gen, in one comprehension (gen: the tokens sampled, kept or in flight).
    return [(most if (most := r.sampling.max_new_tokens) < (room := context_length - len(r.prompt_ids)) else room)
            - len(r.output_ids) - r.num_inflight for r in reqs]


def all_free(reqs: list[Request]) -> bool:
    """Whether no row of a decode step needs a per-row decision beyond its length limit:
    none under a grammar, none conditioned, none asking for top logprobs. Then every
    row decodes whenever a token is left to it and runs ``min(k, tokens left)`` forwards,
    and scheduling skips its per-row checks (``multi_step.decoding_rows``,
    ``multi_step.late_mask_rows``, ``multi_step.row_steps``): one pass of three
    attribute reads a row instead of three passes with calls."""
    return not any(r.matcher is not None or r.conditioning is not None or r.sampling.top_logprobs for r in reqs)


def landing_limits(reqs: list[Request], landing: list[int], context_length: int) -> list[int]:
    """``tokens_left(context_length, scheduling=False)`` of every row of a step being
    processed, once its ``landing`` tokens (per row) are no longer in flight and before
    they are appended: the processing side of the same rule, one pass per step."""
    out: list[int] = []
    add = out.append
    for r, n in zip(reqs, landing):
        kept = len(r.output_ids)
        by_count = r.sampling.max_new_tokens - kept
        by_context = context_length - len(r.prompt_ids) - kept - (r.num_inflight - n)
        add(by_count if by_count < by_context else by_context)
    return out


@dataclass(eq=False)
class RequestData:
    """What a request builder produces and what runners, handlers and result adapters
    see (the reference's per-request data object). ``req`` is the scheduling state."""

    req: Request
    payload: Any = None
    generation_steps: int = 0
    extra_model_outputs: dict[str, Any] = field(default_factory=dict)
    stream_chunks: list[Any] = field(default_factory=list)
    stream_done: bool = False
    output_ids: list[int] = field(default_factory=list)
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)  # (logprob, token id)
    finish_reason: str | None = None
    weight_version: str | None = None
    enforce_request_limits: bool = True
    # What the stage's door found (stage/request_checks.py's Verdict), so admission does
    # not check again; None for a request a custom builder made.
    checked: Any = None
    # Per-request input embeddings a stage builder may attach (prefill and decode);
    # dropped as soon as the result is built, so they do not outlive the request.
    # ``input_embeds``: ``[n, hidden]`` rows that the native prefill uses in place of the
    # token embeddings of the first n prompt positions (``Engine.generate(input_embeds=)``
    # puts the whole prompt here, its ids placeholders); the prefix cache then leaves
    # the request alone (core.prefix_reuse.shares_kv).
    input_embeds: Any = None
    decode_input_embeds: Any = None
    # Hidden states asked for (``SamplingParams.return_hidden_states`` /
    # ``return_prompt_hidden_states``): the rows of each step, device tensors, joined
    # into the result; ``prompt_hidden_upto``: prompt positions collected so far (a
    # prefill after a retraction computes them again and adds none).
    hidden_rows: list[Any] = field(default_factory=list)
    prompt_hidden_rows: list[Any] = field(default_factory=list)
    prompt_hidden_upto: int = 0
    # Prompt logprobs asked for (``SamplingParams.prompt_logprobs``): one host row per
    # scored prompt token, from index 1 (``[logprob, rank, top ids, top logprobs]``),
    # and the next token index to score (a prefill after a retraction adds none);
    # ``prompt_logprobs``: the public shape, built once when complete.
    prompt_score_rows: list[list[float]] = field(default_factory=list)
    prompt_scored_upto: int = 1
    prompt_logprobs: Any = None

    @property
    def request_id(self) -> str:
        return self.req.rid

    @property
    def return_logprob(self) -> bool:
        return self.req.sampling.return_logprob

    @property
    def suppress_tokens(self) -> list[int]:
        return self.req.sampling.suppress_tokens


def masked(req: Request, index: int) -> bool:
    """Whether ``req`` samples generation ``index`` under its grammar's mask: a constrained
    request, below its matcher's ``masked_until`` (past it the row samples first and the
    grammar checks the token after, ``structured.optimistic``). The one place the two kinds
    of constrained row are told apart."""
    m = req.matcher
    return m is not None and index < m.masked_until


def mask_ready(req: Request, late: bool = False) -> bool:
    """Whether a row may be scheduled now as far as its grammar goes: a free row, or one
    whose next token samples before its mask, always; a masked row once the host has
    seen every token it sampled (nothing in flight), because its next mask is computed
    from its matcher, which those tokens advance; or, for a step that may sample under
    late masks (``late``), with one token in flight: the step in flight's, which the host
    processes before that step samples. Whether such a row then runs in the step is
    decided in one place, :func:`omni_async.core.multi_step.late_mask_rows`. Tokens in
    flight that the matcher takes during their step (``num_ahead``) are not waited for:
    a row that ran several forwards under masks between them has one the host has not
    accepted, as a one-forward row has."""
    return req.num_inflight - req.num_ahead <= (1 if late else 0) or not masked(req, req.num_generated)


def waits_for_host(reqs: list[Request], late: bool = False) -> bool:
    """Whether a scheduled step holds a masked row whose mask needs a token still in
    flight besides the one this step samples (and, in a step sampling under late masks,
    ``late``, besides the one of the step before it, which the stepper processes before
    sampling): such a step runs in sync, after a drain. Never true of the native core's
    steps (:func:`mask_ready`); the check stays for any core that does not keep that rule.
    (Called right after scheduling: a row's last token in flight is this step's. Tokens
    its matcher takes during their step, ``num_ahead``, need no host.)"""
    most = 2 if late else 1
    return any(r.matcher is not None and r.num_inflight - r.num_ahead > most and masked(r, r.num_generated - 1)
               for r in reqs)


def step_waits_for_host(batch: Any) -> bool:
    """:func:`waits_for_host` of a scheduled step: a step whose masked rows run several
    forwards under masks computed between them (``masks_between``) samples all its
    rows' tokens in flight itself, so only its other rows are checked."""
    late = getattr(batch, "late_masks", False)
    if not getattr(batch, "masks_between", False):
        return waits_for_host(batch.reqs, late)
    steps = batch.row_steps
    return waits_for_host([r for r, s in zip(batch.reqs, steps) if r.num_inflight > s or s <= 1], late)


# Admission keeps room for running requests' future tokens, estimated as this ratio of
# what they may still generate. A retraction resets it to 1 (fully conservative); it
# then decays towards the minimum as decode steps succeed.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600


def decayed_ratio(ratio: float) -> float:
    """The new-token ratio after a step that carried decode rows ran (see above)."""
    return max(MIN_NEW_TOKEN_RATIO, ratio - NEW_TOKEN_RATIO_DECAY)


def reserved_tokens(running: list[Request], new_token_ratio: float) -> int:
    """KV tokens the running requests are expected to still need: each one's tokens left,
    scaled by the core's estimate of the share it will use (what a prefill leaves free)."""
    ratio = new_token_ratio
    return int(math.ceil(sum(max(0, r.sampling.max_new_tokens - r.num_generated) * ratio for r in running)))
