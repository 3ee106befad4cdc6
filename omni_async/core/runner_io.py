"""Typed hand-offs between the stage and a model runner (the reference contract): the
step handed to the runner and its product as the stage reads it. Host values only, no
torch, so the stage and the batch cores type against them without importing a runner.
``ScheduledBatchLike`` lives here because the hand-off carries it; ``core.protocol``
re-exports it with the rest of the batch-core seam."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol, runtime_checkable

from .request import Request, RequestData


@runtime_checkable
class ScheduledBatchLike(Protocol):
    """One scheduled step as the stage and the runners read it."""

    reqs: list[Request]
    epochs: list[int]
    samples_kept: list[bool]
    sample_indices: list[int]
    step_id: int

    @property
    def is_decode(self) -> bool: ...
    @property
    def size(self) -> int: ...
    def row_is_live(self, i: int) -> bool:
        """False when the row's request finished or was retracted after scheduling:
        such a row yields no token when the step is processed."""
        ...

    def runnable_after_drain(self) -> Any:
        """The batch to forward when it was scheduled while a step was in flight and
        that step has since been processed (the loop drained before running it
        synchronously). None when nothing is left to run. Processing skips stale rows
        either way; a core may keep them in the forward if their KV is committed."""
        ...


@dataclass(slots=True)
class SchedulerRequest:
    request_id: str
    data: RequestData


@dataclass
class SchedulerOutput:
    """One step handed to the runner: its requests (batch order) and the batch."""

    requests: list[SchedulerRequest]
    batch_data: ScheduledBatchLike | None


@dataclass(slots=True)
class RequestOutput:
    """One request's product of one step. ``data`` is the sampled token id (None for
    a non-final prefill chunk); ``extra`` is merged into ``extra_model_outputs``."""

    request_id: str
    data: int | None = None
    logprob: float | None = None
    finished: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelRunnerOutput:
    """One step's product as the stage reads it: batch-ordered host values
    (``token_ids``, ``logprobs``), what the batch core consumes, and ``outputs``, a
    ``RequestOutput`` per request. Those are built when the step is collected only if
    something reads them per row (a runner's ``post_process_outputs`` or step hooks, top
    logprobs, hidden states), otherwise on first access: a plain decode step builds no
    per-row objects."""

    requests: list[SchedulerRequest]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    # Rows (batch index) that could not be sampled, with the reason: the stage fails
    # those requests alone; their entry in ``token_ids`` is meaningless.
    row_errors: dict[int, str] = field(default_factory=dict)
    taken: list[int] = field(default_factory=list)  # rows that got a token
    can_run_cuda_graph: bool = False
    built_outputs: dict[str, RequestOutput] | None = None  # ``outputs`` once built
    row_steps: list[int] | None = None  # a multi-step decode: forwards per row
    # Final hidden states on the stage's device, when some row asked (or the stage
    # captures for every request): ``[B, H]`` for one forward, ``[k, B, H]`` for a
    # multi-step decode (forward-major, like ``token_ids``). ``hidden_for_all``: every
    # row's go out, not only those of requests that asked.
    hidden_states: Any = None
    hidden_for_all: bool = False
    # A prefill's every-position hidden states when a row asked for its prompt's:
    # ``(rows [T, H], [(first row, count, first position)] per batch row)``.
    prompt_hidden: Any = None
    # Per batch row, None or ``(first prompt token index, rows [m, 2 + 2k])`` of the
    # prompt tokens a row scored (``SamplingParams.prompt_logprobs``,
    # :func:`omni_async.runners.prompt_scores.score_prompts`).
    prompt_logprobs: Any = None

    @property
    def outputs(self) -> dict[str, RequestOutput]:
        if self.built_outputs is None:
            self.built_outputs = request_outputs(self.requests, self.taken, self.token_ids, self.logprobs, self.row_steps)
        return self.built_outputs

    @cached_property
    def req_ids(self) -> list[str]:
        return [r.request_id for r in self.requests]

    @cached_property
    def req_id_to_index(self) -> dict[str, int]:
        return {rid: i for i, rid in enumerate(self.req_ids)}

    def failed_requests(self) -> dict[str, str]:
        """``row_errors`` by request id: the requests the stage should fail alone."""
        return {self.req_ids[i]: msg for i, msg in self.row_errors.items()}


def request_outputs(requests: list[SchedulerRequest], taken: list[int], token_ids: list[int],
                    logprobs: list[float] | None, row_steps: list[int] | None = None) -> dict[str, RequestOutput]:
    """A ``RequestOutput`` per request: the sampled token for the rows in ``taken`` (a
    multi-step row's last one), none for the others (a prefill chunk, a skipped or
    failed row)."""
    outputs = {sr.request_id: RequestOutput(request_id=sr.request_id) for sr in requests}
    size = len(requests)
    for i in taken:
        at = i if row_steps is None else (row_steps[i] - 1) * size + i
        out = outputs[requests[i].request_id]
        out.data = token_ids[at]
        out.logprob = logprobs[at] if logprobs is not None else None
    return outputs
