"""The hooks of the reference's model-runner contract, each a no-op (or the reference's
default answer) that a runner overrides: called by :class:`~omni_async.runners.base.ModelRunner`
at the same points of a step as the reference calls them."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..core.runner_io import RequestOutput
from .types import BatchResult


class RunnerHooks:
    def before_prefill(self, forward_batch, schedule_batch, requests) -> None:
        """Mutate state before the standard or custom prefill forward."""

    def before_decode(self, forward_batch, schedule_batch, requests, *, is_lookahead: bool = False) -> None:
        """Mutate state before the standard or custom decode forward."""

    def custom_prefill_forward(self, forward_batch, schedule_batch, requests) -> BatchResult | None:
        """Return a result to own the prefill forward, or None for the standard one."""
        return None

    def custom_decode_forward(self, forward_batch, schedule_batch, requests) -> BatchResult | None:
        """Return a result to own the decode forward, or None for the standard one."""
        return None

    def post_prefill(self, result, forward_batch, schedule_batch, requests) -> None:
        """Called after a prefill forward."""

    def post_decode(self, result, forward_batch, schedule_batch, requests) -> None:
        """Called after a decode forward (synchronous path)."""

    def overlap_eligible(self, batch: Any) -> bool:
        """Whether the overlap loop may launch this batch while the previous step is in
        flight; False runs it synchronously after a drain."""
        return True

    def lookahead_eligible(self, batch: Any) -> bool:
        """Whether a batch may take the one-step lookahead; False routes it synchronously."""
        return True

    def post_process_outputs(self, result, scheduler_output, outputs: dict[str, RequestOutput]) -> None:
        """Called after tokens are materialised into RequestOutputs."""

    def post_decode_launch(self, result, forward_batch, requests) -> Any:
        """Device half of post_decode under lookahead: publish the resolve payload."""
        raise NotImplementedError(
            f"{type(self).__name__} does not support async decode: implement "
            "post_decode_launch / post_decode_resolve"
        )

    def post_decode_resolve(self, launch_buf, result, forward_batch, schedule_batch, requests) -> None:
        """Host half of post_decode under lookahead: read ``launch_buf``."""
        raise NotImplementedError(
            f"{type(self).__name__} does not support async decode: implement "
            "post_decode_launch / post_decode_resolve"
        )

    def sample_before_post_prefill(self, forward_batch, schedule_batch, requests) -> bool:
        return False

    def sample_before_post_decode(self, forward_batch, schedule_batch, requests) -> bool:
        return False

    def requested_capture_hidden_mode_prefill(self, schedule_batch, requests) -> Any | None:
        return None

    def requested_capture_hidden_mode_decode(self, schedule_batch, requests) -> Any | None:
        return None

    def finalize_skip_rids(self, scheduler_output) -> set[str]:
        """Request ids whose generation_steps must not advance this step."""
        return set()

    def on_generation_step_advanced(self, sched_req, generation_steps: int) -> None:
        """After ``generation_steps`` is committed on one request."""

    def on_generation_steps_advanced(self, advanced_steps, forward_batch) -> None:
        for sched_req, steps in advanced_steps:
            self.on_generation_step_advanced(sched_req, steps)


def hidden_states_only(hook: Callable[..., None]) -> Callable[..., None]:
    """Mark a ``post_process_outputs`` that reads only the step's hidden states: steps
    without hidden states then build no per-request outputs for it."""
    hook.hidden_states_only = True  # type: ignore[attr-defined]
    return hook


def attach_hidden_extras(hidden: Any, scheduler_output: Any, outputs: dict) -> None:
    """The reference's hidden-state contract: each sampled row's last hidden state, on the
    host in float32, in its output's ``extra["hidden_state"]`` (rows of a multi-step
    decode: the last forward's). Nothing when the step's rows are not one per request."""
    requests = scheduler_output.requests
    if hidden is None or hidden.shape[-2] != len(requests):
        return
    hidden = (hidden[-1] if hidden.dim() == 3 else hidden).detach().to("cpu", torch.float32)
    for i, sched_req in enumerate(requests):
        out = outputs[sched_req.request_id]
        if out.data is not None:
            out.extra["hidden_state"] = hidden[i].clone()
