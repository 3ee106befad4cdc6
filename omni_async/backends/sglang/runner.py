"""The SGLang model runner: omni-async's ModelRunner contract over SGLang's ForwardBatch
and tensor-parallel model worker.

``build_forward_batch`` resolves the step's inputs through SGLang's FutureMap (a decode
row reads the token its previous step sampled, on the device, so a step can be
scheduled before the previous one's result reaches the host) and builds SGLang's
``ForwardBatch``; ``forward`` runs SGLang's model runner and hands back the logits.
Hidden states (``capture_hidden`` or the capture hooks) use SGLang's own capture
(``CaptureHiddenMode``), one row per sampled request. Sampling is omni-async's shared
device sampler (the base runner's default ``sampling_batch``), so greedy and seeded
outputs match the native backend; the step's tokens are published back into the
FutureMap for the next decode step. Every hook of the base contract is called at the
same point as for the native runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...runners.base import ModelRunner
from ...runners.hooks import hidden_states_only
from ...core.runner_io import SchedulerOutput
from ...runners.types import BatchResult

from sglang.srt.managers.overlap_utils import RelayPayload, resolve_forward_inputs
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch


@dataclass
class SGLangForward:
    """What ``build_forward_batch`` hands to ``forward`` and the hooks."""

    forward_batch: ForwardBatch  # SGLang's
    schedule_batch: Any  # the SGLang ScheduleBatch snapshot of this step


class SGLangModelRunner(ModelRunner):
    def __init__(self, tp_worker: Any, future_map: Any, *, capture_hidden: bool = False, seed: int = 0) -> None:
        super().__init__(seed=seed)
        # When set, each sampled row's final hidden state goes out with its step output
        # (``RequestOutput.extra["hidden_state"]``), e.g. for a downstream talker stage,
        # as on the native runner.
        self.capture_hidden = capture_hidden
        self.tp_worker = tp_worker
        self.future_map = future_map
        self.device = torch.device(tp_worker.device) if not isinstance(tp_worker.device, torch.device) else tp_worker.device
        self.model = tp_worker.model_runner.model

    # ------------------------------------------------------------ backend parts

    def build_forward_batch(self, scheduler_output: SchedulerOutput, capture_hidden_mode: Any = None) -> SGLangForward:
        batch = scheduler_output.batch_data
        sb = batch.schedule_batch
        resolve_forward_inputs(sb, self.future_map)
        fb = ForwardBatch.init_new(
            sb,
            self.tp_worker.model_runner,
            capture_hidden_mode=self._capture_mode(capture_hidden_mode, scheduler_output.requests),
            return_hidden_states_before_norm=False,
        )
        return SGLangForward(forward_batch=fb, schedule_batch=sb)

    def _capture_mode(self, requested: Any, requests: list) -> CaptureHiddenMode | None:
        """SGLang's capture mode for this step: a CaptureHiddenMode from the hooks as
        given, any other request from them (or ``capture_hidden``, or a request's
        ``return_hidden_states``) as LAST, the hidden state each sampled row's token
        comes from (after the final norm, as native)."""
        if isinstance(requested, CaptureHiddenMode):
            return requested
        if requested is not None or self.capture_hidden or any(sr.data.req.sampling.return_hidden_states for sr in requests):
            return CaptureHiddenMode.LAST
        return None

    def forward(self, forward_batch: SGLangForward) -> BatchResult:
        out = self.tp_worker.model_runner.forward(forward_batch.forward_batch)
        logits_output = out.logits_output
        logits = logits_output.next_token_logits
        if logits.dtype != torch.float32:
            logits = logits.float()
        return BatchResult(
            logits=logits,
            hidden_states=getattr(logits_output, "hidden_states", None),
            can_run_cuda_graph=bool(out.can_run_graph),
        )

    def _publish(self, forward_batch: SGLangForward, tokens: torch.Tensor) -> None:
        """Publish this step's tokens where SGLang's next decode step gathers its
        inputs (the FutureMap, indexed by req_to_token row)."""
        sb = forward_batch.schedule_batch
        self.future_map.stash(sb.req_pool_indices, RelayPayload(bonus_tokens=tokens))

    def publish_tokens(self, result: BatchResult, forward_batch: SGLangForward, schedule_batch) -> None:
        """Sampled or chosen by a custom forward, the step's tokens go where SGLang's
        next decode step gathers its inputs."""
        self._publish(forward_batch, result.next_token_ids)

    def row_output_ids(self, forward_batch: SGLangForward, schedule_batch, row: int) -> list[int]:
        """The output tokens snapshotted at scheduling (rows with a repetition penalty),
        plus a decode input still in flight: the previous step's token, read from the
        resolved inputs."""
        snap = schedule_batch.output_snapshots[row]
        ids = list(snap) if snap is not None else []
        if snap is None or not schedule_batch.is_decode:
            return ids
        if len(ids) < schedule_batch.sample_indices[row]:
            ids.append(int(forward_batch.forward_batch.input_ids[row]))
        return ids

    @hidden_states_only
    def post_process_outputs(self, result, scheduler_output, outputs) -> None:
        """Each sampled row's hidden state into its output's ``extra`` (LAST capture:
        one row per request; a FULL capture asked for by a hook is left to the hook)."""
        hidden = result.hidden_states
        if hidden is None or hidden.shape[0] != len(scheduler_output.requests):
            return
        hidden = hidden.detach().to("cpu", torch.float32)
        for i, sched_req in enumerate(scheduler_output.requests):
            out = outputs[sched_req.request_id]
            if out.data is not None:
                out.extra["hidden_state"] = hidden[i].clone()

    # ------------------------------------------------------------ completion

    def record_completion(self) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            return event
        return None

    # The decode collect has nothing model-specific: the launch publishes the sampled
    # ids (already on the device), the resolve has nothing left to read.
    def post_decode_launch(self, result, forward_batch, requests):
        return result.next_token_ids

    def post_decode_resolve(self, launch_buf, result, forward_batch, schedule_batch, requests) -> None:
        result.next_token_ids = launch_buf

