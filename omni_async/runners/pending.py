"""A step launched on the device and not yet collected (``base.ModelRunner.launch``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..core.runner_io import SchedulerOutput
from .types import BatchResult


@dataclass
class PendingStep:
    """A step launched on the device and not yet collected on the host.

    ``event`` is the completion marker recorded after the step's last device work (a
    CUDA event, or None on CPU where the launch ran to completion). ``host`` is the
    step's result copied to host memory: rows of token ids, ``ok`` flags and, when
    asked, the bits of the float32 logprobs (all ``int64``); it is readable once the
    event completed. ``copied`` is the token tensor that copy was taken from.
    ``masks_due``: only the forward is enqueued (a batch sampling under late masks);
    ``ModelRunner.sample_pending`` does the rest, from ``started`` (what the launch
    enqueued: the forward's result, or a multi-step decode's forwards, the first enqueued;
    ``batch_result`` is None until then).
    """

    event: Any
    scheduler_output: SchedulerOutput
    forward_batch: Any
    batch_result: BatchResult | None
    lookahead: bool
    launch_buf: Any = None
    host: torch.Tensor | None = None
    copied: torch.Tensor | None = None
    masks_due: bool = False
    started: Any = None

    @property
    def schedule_batch(self) -> Any:
        return self.scheduler_output.batch_data
