"""The batch-core seam: what the stage and the stepper need from a batch core, and what
a scheduled step looks like to them. Two implementations: ``NativeBatchCore`` (ours) and
the SGLang backend's core. Pure scheduling state: no asyncio, no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Protocol, Sequence, runtime_checkable

from .request import Request
from .runner_io import ModelRunnerOutput, ScheduledBatchLike

__all__ = ["BatchCore", "LaunchedStep", "ScheduledBatchLike", "StepOutcome", "StepOutcomes", "StepRunner"]


@dataclass(slots=True)
class StepOutcome:
    """What processing one row of a step produced."""

    req: Request
    token: int | None  # None when the row was a non-final prefill chunk; else the newest
    logprob: float | None = None
    finished: bool = False
    # A multi-step decode row (decode_steps > 1): every token it kept, oldest first,
    # and their logprobs when asked. None for a one-token row.
    tokens: list[int] | None = None
    logprobs: list[float] | None = None


class StepOutcomes(Sequence[StepOutcome]):
    """A step's outcomes with its plain rows as columns: a core may return this instead
    of a list (the native core does for a multi-step decode). A plain row kept all its
    tokens, runs on and carries nothing else (no grammar, no finish), which at batch
    256 is most rows of most steps; its request is ``plain_reqs[j]``, its tokens
    ``plain_tokens[j]`` (oldest first) and their logprobs ``plain_logprobs[j]`` (None
    for all when the step computed none). ``rest`` holds every other live row's
    ``StepOutcome``. The emission reads the columns directly, so no outcome object is
    made or read per plain row; anything else iterating gets every row's
    ``StepOutcome`` in row order, made on first use (``reqs``: the batch's rows)."""

    __slots__ = ("rest", "plain_reqs", "plain_tokens", "plain_logprobs", "_reqs", "_all")

    def __init__(self, reqs: Sequence[Request], rest: list[StepOutcome], plain_reqs: list[Request],
                 plain_tokens: list[list[int]], plain_logprobs: list[list[float]] | None) -> None:
        self._reqs = reqs
        self.rest = rest
        self.plain_reqs = plain_reqs
        self.plain_tokens = plain_tokens
        self.plain_logprobs = plain_logprobs
        self._all: list[StepOutcome] | None = None

    def _outcomes(self) -> list[StepOutcome]:
        if self._all is None:
            lps = self.plain_logprobs
            made = [StepOutcome(r, t[-1], None if lps is None else lps[j][-1], False, t, None if lps is None else lps[j])
                    for j, (r, t) in enumerate(zip(self.plain_reqs, self.plain_tokens))]
            row_of = {id(r): i for i, r in enumerate(self._reqs)}
            self._all = sorted(made + self.rest, key=lambda oc: row_of[id(oc.req)])
        return self._all

    def __len__(self) -> int:
        return len(self.plain_reqs) + len(self.rest)

    def __getitem__(self, i: Any) -> Any:
        return self._outcomes()[i]

    def __iter__(self) -> Iterator[StepOutcome]:
        return iter(self._outcomes())


@runtime_checkable
class BatchCore(Protocol):
    """Scheduling state of one stage.

    Scheduling advances request state when a step is scheduled; ``process_result``
    completes it and skips rows that are no longer live. ``abort`` finishes a waiting
    request at once (returned) and marks a running one, which ``reap_aborted`` finishes
    at the next step boundary. Every finish releases KV exactly once.
    """

    num_retractions: int

    def add_request(self, req: Request) -> None: ...
    def get_next_batch(self) -> Any: ...
    def process_result(
        self, batch: Any, tokens: Sequence[int], logprobs: Sequence[float] | None
    ) -> Sequence[StepOutcome]: ...  # a list, or a StepOutcomes
    def abort(self, rid: str) -> Request | None: ...
    def reap_aborted(self) -> list[Request]: ...
    def schedule_early(self, batch: Any, tokens: Sequence[int]) -> Any:
        """The decode step after ``batch``, scheduled from its collected ``tokens`` before
        ``batch`` is processed (the normal loop launches it first); None when that is not
        decided now, and always from a core that does not do it (the caller then processes
        ``batch`` and schedules as usual)."""
        return None
    def abort_all(self) -> list[Request]: ...
    def fail_requests(self, reqs: Sequence[Request]) -> list[Request]: ...
    def retract_all(self) -> list[Request]: ...
    def retract_requests(self, reqs: Sequence[Request]) -> list[Request]:
        """Send these requests back to waiting, KV freed, to be run again (a failed
        step's retry). Returns those retracted; a core that cannot retry returns []."""
        ...
    def active_requests(self) -> list[Request]: ...
    def find(self, rid: str) -> Request | None: ...
    def has_work(self) -> bool: ...
    def on_idle(self) -> None:
        """Nothing to run: admission may be optimistic again (the new-token ratio
        returns to its initial value)."""
        ...
    def num_waiting(self) -> int: ...
    def kv_is_fully_free(self) -> bool: ...
    def flush_cache(self) -> bool:
        """Empty the prefix cache; False (nothing done) while a request holds KV."""
        ...
    def invalidate_cache(self) -> None:
        """Stop sharing every cached prefix now (new weights, a failed step); pages that
        requests hold stay theirs. A core without a prefix cache does nothing."""
        ...
    def stats(self) -> dict[str, int]: ...


class LaunchedStep(Protocol):
    """A step a runner launched and has not collected: the stage awaits ``event`` (a
    device completion marker, or None when the launch ran to completion) and hands the
    step back to the runner's ``collect``."""

    event: Any


class StepRunner(Protocol):
    """The model runner as the stage sees it: one launch path, one collect path, and the
    two per-batch policies the loops ask about. ``runners.base.ModelRunner`` implements
    it (with the reference's hooks); the stage never imports a runner."""

    def launch(self, scheduler_output: Any, *, lookahead: bool = False) -> LaunchedStep | None: ...
    def sample_pending(self, pending: Any) -> LaunchedStep:
        """The sampling half of a launch whose batch has ``late_masks`` (its launch
        enqueued the forward only), called once the step before it is processed."""
        ...
    def collect(self, pending: Any) -> ModelRunnerOutput: ...
    def lookahead_eligible(self, batch: Any) -> bool: ...
    def overlap_eligible(self, batch: Any) -> bool: ...
    def stats(self) -> dict[str, Any]: ...
