"""One scheduled step of the SGLang backend, as the loops and runners read it: the
attributes of omni-async's ScheduledBatch over a snapshot of SGLang's ScheduleBatch."""

from __future__ import annotations

from typing import Any

from ...core.batch import ForwardMode, StepShape
from ...core.request import Request

from sglang.srt.managers.schedule_batch import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_MATCHED_STR,
    FINISH_MATCHED_TOKEN,
    Req,
    ScheduleBatch,
)


class SGLangScheduledBatch(StepShape):
    """One scheduled step, with the attributes the loops and runners read from a
    :class:`~omni_async.core.batch.ScheduledBatch`, over a snapshot of SGLang's
    ``ScheduleBatch`` (the scheduler's own object keeps changing while the step runs
    on the worker thread)."""

    def __init__(
        self,
        mode: ForwardMode,
        reqs: list[Request],
        sreqs: list[Req],
        samples_kept: list[bool],
        sample_indices: list[int],
        output_snapshots: list[list[int] | None],
        schedule_batch: ScheduleBatch,
        step_id: int,
    ) -> None:
        self.mode = mode
        self.reqs = reqs
        self.sreqs = sreqs
        self.epochs = [r.epoch for r in reqs]
        self.samples_kept = samples_kept
        self.sample_indices = sample_indices
        # Output tokens known to the host at scheduling, for rows whose sampling reads
        # them (repetition penalty); None for the others.
        self.output_snapshots = output_snapshots
        self.schedule_batch = schedule_batch
        self.step_id = step_id
        self.executed = False  # set by the step executor once the step ran (or failed) on the worker
        self.processed = False

    @property
    def num_tokens(self) -> int:
        sb = self.schedule_batch
        return int(sb.extend_num_tokens) if self.mode.is_extend() else len(self.reqs)

    def row_is_live(self, i: int) -> bool:
        """False when the row's request finished or was retracted after scheduling."""
        req = self.reqs[i]
        return not req.finished() and req.epoch == self.epochs[i]

    def runnable_after_drain(self) -> "SGLangScheduledBatch":
        """The batch to run after a drain finished or retracted some of its requests.

        Unlike the native core, the stale rows stay in the forward (SGLang's overlap
        'overshoot'): their KV slots were allocated with the step, the radix cache may
        already count the slot a finished request's last token is written to, and
        their release waits for this step to execute. Processing skips them."""
        return self


def finish_reason_name(reason: Any) -> str | None:
    if reason is None:
        return None
    if isinstance(reason, FINISH_LENGTH):
        return "length"
    if isinstance(reason, (FINISH_MATCHED_TOKEN, FINISH_MATCHED_STR)):
        return "stop"
    if isinstance(reason, FINISH_ABORT):
        return "abort"
    return "stop"
