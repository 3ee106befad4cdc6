"""The SGLang model runner: omni-async's ModelRunner contract over SGLang's ForwardBatch
and tensor-parallel model worker.

``build_forward_batch`` resolves the step's inputs through SGLang's FutureMap (a decode
row reads the token its previous step sampled, on the device, so a step can be
scheduled before the previous one's result reaches the host) and builds SGLang's
``ForwardBatch``; ``forward`` runs SGLang's model runner and hands back the logits.
Sampling is omni-async's shared sampler (``ModelRunner._sample_next_token_ids``), so
greedy and seeded outputs match the native backend; the sampled ids are published back
into the FutureMap for the next decode step. Every hook of the base contract is called
at the same point as for the native runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...runners.base import ModelRunner, PendingStep
from ...runners.types import BatchResult, ModelRunnerOutput, SchedulerOutput

from sglang.srt.managers.overlap_utils import RelayPayload, resolve_forward_inputs
from sglang.srt.model_executor.forward_batch_info import ForwardBatch


@dataclass
class SGLangForward:
    """What ``build_forward_batch`` hands to ``forward`` and the hooks."""

    forward_batch: ForwardBatch  # SGLang's
    schedule_batch: Any  # the SGLang ScheduleBatch snapshot of this step


class SGLangModelRunner(ModelRunner):
    def __init__(self, tp_worker: Any, future_map: Any) -> None:
        super().__init__()
        self.tp_worker = tp_worker
        self.model_worker = tp_worker
        self.future_map = future_map
        self.device = torch.device(tp_worker.device) if not isinstance(tp_worker.device, torch.device) else tp_worker.device
        self.model = tp_worker.model_runner.model
        self.core: Any = None  # set by the builder (weight updates flush its cache)

    # ------------------------------------------------------------ backend parts

    def build_forward_batch(self, scheduler_output: SchedulerOutput) -> SGLangForward:
        batch = scheduler_output.batch_data
        sb = batch.schedule_batch
        resolve_forward_inputs(sb, self.future_map)
        fb = ForwardBatch.init_new(sb, self.tp_worker.model_runner, return_hidden_states_before_norm=False)
        return SGLangForward(forward_batch=fb, schedule_batch=sb)

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

    def _sample_next_token_ids(self, logits, forward_batch, schedule_batch, requests):
        tokens, logprobs = super()._sample_next_token_ids(logits, forward_batch, schedule_batch, requests)
        # Publish this step's tokens where SGLang's next decode step gathers its inputs.
        sb = forward_batch.schedule_batch
        self.future_map.stash(sb.req_pool_indices, RelayPayload(bonus_tokens=tokens))
        return tokens, logprobs

    def row_output_ids(self, forward_batch: SGLangForward, schedule_batch, row: int) -> list[int]:
        ids = super().row_output_ids(forward_batch, schedule_batch, row)
        if schedule_batch.output_snapshots[row] is None or not schedule_batch.is_decode:
            return ids
        # A decode input still in flight (the previous step's token, not yet processed
        # on the host) is the newest output token: read it from the resolved inputs.
        if len(ids) < schedule_batch.sample_indices[row]:
            ids.append(int(forward_batch.forward_batch.input_ids[row]))
        return ids

    # ------------------------------------------------------------ completion

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        try:
            return super().execute(scheduler_output)
        finally:
            _mark_executed(scheduler_output)

    def execute_launch(self, scheduler_output: SchedulerOutput) -> PendingStep | None:
        try:
            return super().execute_launch(scheduler_output)
        finally:
            _mark_executed(scheduler_output)

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

    # ------------------------------------------------------------ weights

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None) -> tuple[bool, str]:
        """Load new weights through SGLang's model runner. Returns (success, message).
        The caller pauses generation first; the radix cache is flushed on success
        (its KV was computed with the old weights)."""
        try:
            success, message = True, "Succeeded to update model weights."
            for _role, runner in self.tp_worker.weight_update_runners():
                success, message = runner.weight_updater.update_weights_from_disk(
                    str(model_path), load_format or "safetensors"
                )
                if not success:
                    break
        except Exception as exc:  # a bad path or checkpoint must not take the stage down
            return False, f"update_weights_from_disk failed: {exc!r}"
        if success and self.core is not None:
            if not self.core.flush_cache():
                return False, f"{message}; cache flush failed (requests still hold KV)"
        return bool(success), str(message)


def _mark_executed(scheduler_output: SchedulerOutput) -> None:
    batch = scheduler_output.batch_data
    if batch is not None:
        batch.executed = True
