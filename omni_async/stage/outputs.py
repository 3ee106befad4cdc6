"""What a request's messages and result hold: the default result adapter and stream
message builder, and a step's hidden states sorted out by row."""

from __future__ import annotations

from itertools import repeat
from typing import Any

from ..core.protocol import StepOutcomes
from ..core.request import Request, RequestData
from ..core.runner_io import ModelRunnerOutput, RequestOutput
from ..messages import GenerationResult, OutgoingMessage, StepTokens, StreamDelta, join_rows


class HiddenRows:
    """One step's hidden states sorted out by row: which rows' go out (requests that
    asked, or all when the stage captures for every request), which are kept for the
    result, and the prompt positions of a prefill whose request asked for them."""

    def __init__(self, batch: Any, out: ModelRunnerOutput) -> None:
        self.states, self.prompt_states = out.hidden_states, out.prompt_hidden
        self.prompt_scores = out.prompt_logprobs
        self.for_all = out.hidden_for_all
        self.multi = self.states is not None and self.states.dim() == 3  # [k, B, H]
        self.row_of = {id(r): i for i, r in enumerate(batch.reqs)}
        self._by_row: Any = None  # each row's [k or 1, H] view, split in one call when first needed
        self.rows: Any = None
        self.prompt: Any = None
        self.prompt_logprobs: Any = None  # (logprobs, ranks) on the request's first delta

    def take(self, oc: Any) -> bool:
        """Sort out ``oc``'s row: True when its delta carries hidden states (``rows``,
        ``prompt``); its request's result rows are collected on the way."""
        req = oc.req
        sp = req.sampling
        self.rows = self.prompt = self.prompt_logprobs = None
        scoring = sp.prompt_logprobs is not None
        if not (self.for_all or sp.return_hidden_states or sp.return_prompt_hidden_states or scoring):
            return False
        i = self.row_of[id(req)]
        data = req.data
        if self.prompt_states is not None and sp.return_prompt_hidden_states:
            self._collect_prompt(req, data, i)
        if self.prompt_scores is not None and scoring:
            self._collect_scores(data, i)
        if oc.token is None:
            return True
        first = len(req.output_ids) == (1 if oc.tokens is None else len(oc.tokens))
        if scoring and first:
            self.prompt_logprobs = prompt_logprobs_of(data)
        if self.states is not None and (self.for_all or sp.return_hidden_states):
            if self._by_row is None:
                self._by_row = self.states.unbind(1) if self.multi else self.states.unsqueeze(1).unbind(0)
            rows = self._by_row[i]
            n = 1 if oc.tokens is None else len(oc.tokens)
            self.rows = rows if rows.shape[0] == n else rows[:n]
            if sp.return_hidden_states:
                data.hidden_rows.append(self.rows)
        if sp.return_prompt_hidden_states and data.prompt_hidden_rows and len(req.output_ids) == (
                1 if oc.tokens is None else len(oc.tokens)):
            self.prompt = join_rows(data.prompt_hidden_rows)  # with the request's first token
        return True

    def _collect_scores(self, data: RequestData, i: int) -> None:
        """The row's scored prompt tokens not collected yet, as host rows."""
        entry = self.prompt_scores[i]
        if entry is None:
            return
        first, rows = entry
        lo, hi = max(first, data.prompt_scored_upto), first + rows.shape[0]
        if hi > lo:
            data.prompt_score_rows.extend(rows[lo - first : hi - first].tolist())
            data.prompt_scored_upto = hi

    def _collect_prompt(self, req: Request, data: RequestData, i: int) -> None:
        every, spans = self.prompt_states
        first_flat, count, first_pos = spans[i]
        lo, hi = max(first_pos, data.prompt_hidden_upto), min(first_pos + count, len(req.prompt_ids))
        if hi > lo:
            data.prompt_hidden_rows.append(every[first_flat + lo - first_pos : first_flat + hi - first_pos])
            data.prompt_hidden_upto = hi


def prompt_logprobs_of(data: RequestData) -> tuple[list[dict[int, float] | None], list[int | None]]:
    """A request's scored prompt in the public shape (``GenerationResult.prompt_logprobs``
    and ``prompt_logprob_ranks``): None for the first token, then {its token: logprob,
    then the top k}; built once, for the first delta and the result."""
    if data.prompt_logprobs is not None:
        return data.prompt_logprobs
    logprobs: list[dict[int, float] | None] = [None]
    ranks: list[int | None] = [None]
    for token, row in zip(data.req.prompt_ids[1:], data.prompt_score_rows):
        k = (len(row) - 2) // 2
        entry = {token: row[0]}
        for t, lp in zip(row[2 : 2 + k], row[2 + k :]):
            entry.setdefault(int(t), lp)
        logprobs.append(entry)
        ranks.append(int(row[1]))
    if len(data.prompt_score_rows) + 1 >= len(data.req.prompt_ids):  # complete: keep it
        data.prompt_logprobs = (logprobs, ranks)
    return logprobs, ranks


def default_result_adapter(data: RequestData) -> GenerationResult:
    req = data.req
    scored = prompt_logprobs_of(data) if req.sampling.prompt_logprobs is not None else (None, None)
    return GenerationResult(
        request_id=req.rid,
        output_ids=list(data.output_ids),
        finish_reason=data.finish_reason,
        prompt_ids=list(req.prompt_ids),
        output_logprobs=[lp for lp, _ in data.output_token_logprobs] if req.sampling.return_logprob else None,
        weight_version=data.weight_version,
        extra={k: v for k, v in data.extra_model_outputs.items() if k != "hidden_state"},
        cached_tokens=req.cached_tokens,
        hidden_states=join_rows(data.hidden_rows) if req.sampling.return_hidden_states else None,
        prompt_hidden_states=join_rows(data.prompt_hidden_rows) if req.sampling.return_prompt_hidden_states else None,
        prompt_logprobs=scored[0],
        prompt_logprob_ranks=scored[1],
    )


def default_stream_output_builder(rid: str, data: RequestData, out: RequestOutput) -> list[OutgoingMessage]:
    if out.data is None:
        return []
    return [stream_message(data.req, out)]


def stream_message(req: Request, out: RequestOutput) -> OutgoingMessage:
    """The default stream message of one row's token (``out.data`` is not None)."""
    rid = req.rid
    finished = out.finished
    logprob = out.logprob
    delta = StreamDelta(
        request_id=rid,
        token_ids=[int(out.data)],
        logprobs=[logprob] if (logprob is not None and req.sampling.return_logprob) else None,
        finished=finished,
        finish_reason=req.finish_reason if finished else None,
        extra=dict(out.extra) if out.extra else {},
    )
    return OutgoingMessage(rid, "stream", delta)


# ---------------------------------------------------------------- The stage's shared state
# (read by the stepper, intake and control too)

LIFECYCLE = ("new", "running", "closing", "closed")


def plain_columns(outcomes: StepOutcomes, columns: StepTokens) -> int:
    """A step's plain rows (:class:`~omni_async.core.protocol.StepOutcomes`: each runs on
    and kept all its tokens) appended to the router's columns with a few list operations,
    not a read of each row's outcome: at batch 256 the rows of most steps are plain, and
    the columns are what the engine's router takes. Logprobs go per row only where the
    step computed them. Returns the tokens emitted."""
    reqs, toks, lps = outcomes.plain_reqs, outcomes.plain_tokens, outcomes.plain_logprobs
    n = len(reqs)
    columns.request_ids.extend([r.rid for r in reqs])
    columns.token_ids.extend(toks)
    columns.finish_reasons.extend(repeat(None, n))
    if lps is None:
        columns.logprobs.extend(repeat(None, n))
    else:
        add = columns.logprobs.append
        for req, row, row_lps in zip(reqs, toks, lps):
            if req.sampling.return_logprob:
                req.data.output_token_logprobs.extend(zip(row_lps, row))
                add(row_lps)
            else:
                add(None)
    return sum(map(len, toks))
