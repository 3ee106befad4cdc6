"""Typed hand-offs between the scheduler and a model runner (the reference contract)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.batch import ScheduledBatch
from ..core.request import RequestData


@dataclass(slots=True)
class SchedulerRequest:
    request_id: str
    data: RequestData


@dataclass
class SchedulerOutput:
    """One step handed to the runner: its requests (batch order) and the batch."""

    requests: list[SchedulerRequest]
    batch_data: ScheduledBatch | None


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
    outputs: dict[str, RequestOutput]
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    can_run_cuda_graph: bool = False
    # Batch-ordered host values, what the batch core consumes.
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    # Rows (batch index) that could not be sampled, with the reason: the stage fails
    # those requests alone; their entry in ``token_ids`` is meaningless.
    row_errors: dict[int, str] = field(default_factory=dict)

    def failed_requests(self) -> dict[str, str]:
        """``row_errors`` by request id: the requests the stage should fail alone."""
        return {self.req_ids[i]: msg for i, msg in self.row_errors.items()}


@dataclass
class BatchResult:
    """A forward's product on the device: logits of the sampled rows, and after sampling
    the next token ids (and, when asked, their log-probabilities)."""

    logits: torch.Tensor | None
    next_token_ids: torch.Tensor | None = None
    next_token_logprobs: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    can_run_cuda_graph: bool = False
    # [B] bool from the sampler: False where a row had no admissible token.
    sample_ok: torch.Tensor | None = None
    # [B, K] the K most likely tokens of each row and their logprobs, when a row asked.
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    # Greedy tokens and ok flags computed inside a replayed CUDA graph, when it has them.
    graph_greedy: tuple[torch.Tensor, torch.Tensor] | None = None
