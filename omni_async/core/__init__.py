"""Batch core: the scheduling state (waiting queue, running set, chunked prefill,
retraction, finish checks, KV release) behind one protocol."""

from .batch import ForwardMode, ScheduledBatch
from .batch_core import BatchCore, NativeBatchCore, StepOutcome
from .request import Request, RequestData

__all__ = [
    "BatchCore",
    "ForwardMode",
    "NativeBatchCore",
    "Request",
    "RequestData",
    "ScheduledBatch",
    "StepOutcome",
]
