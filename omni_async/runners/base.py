"""The model-runner contract of the reference, backend-neutral.

``execute`` runs a whole step: build the forward batch, the prefill/decode hooks, the
forward, sampling and output extraction. The async-decode loop splits it in two:
``execute_launch`` (forward, on-device sample, ``post_decode_launch``, a completion
marker) and ``execute_resolve`` (``post_decode_resolve`` and the shared tail). Every hook
of the reference is here and called at the same point; subclasses override hooks and
provide ``build_forward_batch`` and ``forward``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..sampling import RowSampling, sample_rows
from .types import BatchResult, ModelRunnerOutput, RequestOutput, SchedulerOutput


@dataclass
class PendingStep:
    """A decode step launched but not yet consumed on the host.

    ``event`` is the completion marker recorded right after ``post_decode_launch``
    published ``launch_buf`` (a CUDA event, or None on CPU where launch runs to
    completion on the worker thread). At most two are alive: the step just launched
    and the one being resolved.
    """

    event: Any
    launch_buf: Any
    scheduler_output: SchedulerOutput
    forward_batch: Any
    schedule_batch: Any
    batch_result: BatchResult
    n_real: int
    lookahead: bool = False


class ModelRunner:
    """Base AR model runner with phase hooks and shared sampling."""

    def __init__(self) -> None:
        self._async_enabled = False
        self._staging_slot = 0
        self._host_staging_buffers: list[torch.Tensor] = []
        self._async_query_hit = 0
        self._async_query_miss = 0

    # ------------------------------------------------------------ backend parts

    def build_forward_batch(self, scheduler_output: SchedulerOutput) -> Any:
        """Turn the scheduled step into device inputs."""
        raise NotImplementedError

    def forward(self, forward_batch: Any) -> BatchResult:
        """The standard forward: logits of the rows to sample."""
        raise NotImplementedError

    def record_completion(self) -> Any:
        """A marker that is done once the device finished the work enqueued so far:
        a CUDA event on CUDA, None on CPU (where the launch ran to completion)."""
        device = getattr(self, "device", None)
        if device is not None and getattr(device, "type", None) == "cuda":
            event = torch.cuda.Event(blocking=True)
            event.record()
            return event
        return None

    @staticmethod
    def completion_done(event: Any) -> bool:
        return event is None or bool(event.query())

    @staticmethod
    def wait_completion(event: Any) -> None:
        if event is not None:
            event.synchronize()

    # ------------------------------------------------------------ pipeline

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Whole step, synchronously: build, hooks, forward, sample, output."""
        pending = self.launch_step(scheduler_output)
        if pending is None:
            return ModelRunnerOutput(outputs={}, req_ids=[], req_id_to_index={})
        self.wait_completion(pending.event)
        return self.finish_step(pending)

    @torch.inference_mode()
    def launch_step(self, scheduler_output: SchedulerOutput) -> PendingStep | None:
        """The device half of ``execute``: build, hooks, forward, post hook, sample on the
        device, completion marker. The scheduler awaits the marker cooperatively and then
        calls ``finish_step``, so the loop never blocks on the device."""
        built = self._build_forward_batch(scheduler_output)
        if built is None:
            return None
        forward_batch, schedule_batch, is_prefill = built
        result = self._prepare_and_forward(forward_batch, schedule_batch, scheduler_output.requests, is_prefill)
        if is_prefill:
            self.post_prefill(result, forward_batch, schedule_batch, scheduler_output.requests)
        else:
            self.post_decode(result, forward_batch, schedule_batch, scheduler_output.requests)
        if result.next_token_ids is None:
            self._sample_into(result, forward_batch, schedule_batch, scheduler_output.requests)
        return PendingStep(
            event=self.record_completion(),
            launch_buf=None,
            scheduler_output=scheduler_output,
            forward_batch=forward_batch,
            schedule_batch=schedule_batch,
            batch_result=result,
            n_real=len(scheduler_output.requests),
        )

    @torch.inference_mode()
    def finish_step(self, pending: PendingStep) -> ModelRunnerOutput:
        """The host half of ``execute``, once the device is done: output extraction and
        per-request bookkeeping."""
        return self._finalize(pending.batch_result, pending.forward_batch, pending.schedule_batch, pending.scheduler_output)

    @torch.inference_mode()
    def execute_launch(self, scheduler_output: SchedulerOutput) -> PendingStep | None:
        """Launch a decode step: forward and on-device sample, ``post_decode_launch``
        publishes the resolve payload, then a completion marker is recorded. No wait."""
        built = self._build_forward_batch(scheduler_output)
        if built is None:
            return None
        forward_batch, schedule_batch, is_prefill = built
        if is_prefill:
            raise ValueError("execute_launch is for decode steps only")
        result = self._prepare_and_forward(
            forward_batch, schedule_batch, scheduler_output.requests, is_prefill, is_lookahead=True
        )
        launch_buf = self.post_decode_launch(result, forward_batch, scheduler_output.requests)
        event = self.record_completion()
        return PendingStep(
            event=event,
            launch_buf=launch_buf,
            scheduler_output=scheduler_output,
            forward_batch=forward_batch,
            schedule_batch=schedule_batch,
            batch_result=result,
            n_real=len(scheduler_output.requests),
        )

    @torch.inference_mode()
    def execute_resolve(self, pending: PendingStep | None) -> ModelRunnerOutput | None:
        """Consume a launched step: wait for its marker (a hit when already done),
        ``post_decode_resolve``, then the shared tail. Rows whose request finished or
        was retracted after the launch do not advance."""
        if pending is None:
            return None
        if self.completion_done(pending.event):
            self._async_query_hit += 1
        else:
            self._async_query_miss += 1
            self.wait_completion(pending.event)
        batch = pending.schedule_batch
        skip = {batch.reqs[i].rid for i in range(batch.size) if not batch.row_is_live(i)}
        self.post_decode_resolve(
            pending.launch_buf,
            pending.batch_result,
            pending.forward_batch,
            pending.schedule_batch,
            pending.scheduler_output.requests,
        )
        return self._finalize(
            pending.batch_result,
            pending.forward_batch,
            pending.schedule_batch,
            pending.scheduler_output,
            skip_rids=skip,
        )

    # -- interim contract (replaced by the runner rewrite)
    def launch(self, scheduler_output: SchedulerOutput, *, lookahead: bool = False) -> PendingStep | None:
        pending = self.execute_launch(scheduler_output) if lookahead else self.launch_step(scheduler_output)
        if pending is not None:
            pending.lookahead = lookahead
        return pending

    def collect(self, pending: PendingStep) -> ModelRunnerOutput:
        if pending.lookahead:
            return self.execute_resolve(pending)
        batch = pending.schedule_batch
        skip = {batch.reqs[i].rid for i in range(batch.size) if not batch.row_is_live(i)}
        return self._finalize(pending.batch_result, pending.forward_batch, pending.schedule_batch, pending.scheduler_output, skip_rids=skip)

    def overlap_eligible(self, batch: Any) -> bool:
        """Whether the overlap loop may run this batch while another is in flight."""
        return True

    @property
    def async_resolve_counts(self) -> dict[str, int]:
        return {"hit": self._async_query_hit, "miss": self._async_query_miss}

    def _build_forward_batch(self, scheduler_output: SchedulerOutput):
        batch = scheduler_output.batch_data
        if batch is None or not batch.reqs:
            return None
        forward_batch = self.build_forward_batch(scheduler_output)
        return forward_batch, batch, batch.mode.is_extend()

    def _prepare_and_forward(self, forward_batch, schedule_batch, requests, is_prefill, *, is_lookahead=False):
        if is_prefill:
            self.before_prefill(forward_batch, schedule_batch, requests)
            result = self.custom_prefill_forward(forward_batch, schedule_batch, requests)
        else:
            self.before_decode(forward_batch, schedule_batch, requests, is_lookahead=is_lookahead)
            result = self.custom_decode_forward(forward_batch, schedule_batch, requests)
        if result is None:
            result = self.forward(forward_batch)
        sample_now = (
            self.sample_before_post_prefill(forward_batch, schedule_batch, requests)
            if is_prefill
            else self.sample_before_post_decode(forward_batch, schedule_batch, requests)
        )
        if result.next_token_ids is None and (sample_now or is_lookahead):
            self._sample_into(result, forward_batch, schedule_batch, requests)
        return result

    def _finalize(
        self,
        result: BatchResult,
        forward_batch: Any,
        schedule_batch: Any,
        scheduler_output: SchedulerOutput,
        skip_rids: set[str] | None = None,
    ) -> ModelRunnerOutput:
        """Sampling if still needed, host extraction, per-request bookkeeping."""
        if result.next_token_ids is None:
            self._sample_into(result, forward_batch, schedule_batch, scheduler_output.requests)
        token_ids = [int(t) for t in result.next_token_ids.tolist()]
        logprobs = (
            [float(x) for x in result.next_token_logprobs.tolist()]
            if result.next_token_logprobs is not None
            else None
        )
        outputs: dict[str, RequestOutput] = {}
        for i, sched_req in enumerate(scheduler_output.requests):
            kept = schedule_batch.samples_kept[i]
            outputs[sched_req.request_id] = RequestOutput(
                request_id=sched_req.request_id,
                data=token_ids[i] if kept else None,
                logprob=logprobs[i] if (kept and logprobs is not None) else None,
            )
        self.post_process_outputs(result, scheduler_output, outputs)
        skip = set(skip_rids or ()) | self.finalize_skip_rids(scheduler_output)
        advanced = []
        for i, sched_req in enumerate(scheduler_output.requests):
            if sched_req.request_id in skip or not schedule_batch.samples_kept[i]:
                continue
            data = sched_req.data
            data.generation_steps += 1
            advanced.append((sched_req, data.generation_steps))
            extra = outputs[sched_req.request_id].extra
            if extra:
                data.extra_model_outputs.update(extra)
        if advanced:
            self.on_generation_steps_advanced(advanced, forward_batch)
        req_ids = [r.request_id for r in scheduler_output.requests]
        return ModelRunnerOutput(
            outputs=outputs,
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            can_run_cuda_graph=result.can_run_cuda_graph,
            token_ids=token_ids,
            logprobs=logprobs,
        )

    # ------------------------------------------------------------ sampling

    def _sample_into(self, result: BatchResult, forward_batch, schedule_batch, requests) -> None:
        result.next_token_ids, result.next_token_logprobs = self._sample_next_token_ids(
            result.logits, forward_batch, schedule_batch, requests
        )
        # Publish where each kept row's token lives, so the next decode step can take
        # its input from the device before the host has seen this step's result.
        for i, req in enumerate(schedule_batch.reqs):
            if schedule_batch.samples_kept[i]:
                req.last_token_ref = (result.next_token_ids, i)

    def _sample_next_token_ids(self, logits, forward_batch, schedule_batch, requests):
        rows = [
            RowSampling(
                params=sr.data.req.sampling,
                request_id=sr.request_id,
                sample_index=schedule_batch.sample_indices[i],
                output_ids=self.row_output_ids(forward_batch, schedule_batch, i),
                stop_ids=sorted(sr.data.req.stop_ids()),
            )
            for i, sr in enumerate(requests)
        ]
        want_logprobs = any(sr.data.return_logprob for sr in requests)
        return sample_rows(logits, rows, want_logprobs)

    def row_output_ids(self, forward_batch: Any, schedule_batch: Any, row: int) -> list[int]:
        """Tokens generated so far by a row's request, as of this step. The host snapshot
        taken at scheduling; a runner adds a decode input still in flight."""
        snap = schedule_batch.output_snapshots[row] if schedule_batch.output_snapshots else None
        return list(snap) if snap is not None else []

    # ------------------------------------------------------------ hooks

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

    # ------------------------------------------------------------ host staging

    def _next_host_staging(self, device_staging: torch.Tensor) -> torch.Tensor:
        """Two host buffers used alternately: resolve(N) reads one while launch(N+1)
        fills the other."""
        if not self._host_staging_buffers:
            pin = device_staging.is_cuda
            self._host_staging_buffers = [
                torch.empty(device_staging.shape, dtype=device_staging.dtype, device="cpu", pin_memory=pin)
                for _ in range(2)
            ]
        buf = self._host_staging_buffers[self._staging_slot]
        self._staging_slot ^= 1
        return buf
