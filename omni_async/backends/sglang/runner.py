"""The SGLang model runner: omni-async's ModelRunner contract over SGLang's ForwardBatch
and tensor-parallel model worker.

``build_forward_batch`` resolves the step's inputs through SGLang's FutureMap (a decode
row reads the token its previous step sampled, on the device, so a step can be
scheduled before the previous one's result reaches the host) and builds SGLang's
``ForwardBatch``; ``forward`` runs SGLang's model runner and hands back the logits.
Sampling is omni-async's shared device sampler (the base runner's default
``sampling_batch``), so greedy and seeded outputs match the native backend; the step's
tokens are published back into the FutureMap for the next decode step. Every hook of the base contract is called
at the same point as for the native runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...runners.base import ModelRunner
from ...runners.types import BatchResult, SchedulerOutput

from sglang.srt.managers.overlap_utils import RelayPayload, resolve_forward_inputs
from sglang.srt.model_executor.forward_batch_info import ForwardBatch


@dataclass
class SGLangForward:
    """What ``build_forward_batch`` hands to ``forward`` and the hooks."""

    forward_batch: ForwardBatch  # SGLang's
    schedule_batch: Any  # the SGLang ScheduleBatch snapshot of this step


class SGLangModelRunner(ModelRunner):
    def __init__(self, tp_worker: Any, future_map: Any, *, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.tp_worker = tp_worker
        self.future_map = future_map
        self.device = torch.device(tp_worker.device) if not isinstance(tp_worker.device, torch.device) else tp_worker.device
        self.model = tp_worker.model_runner.model

    # ------------------------------------------------------------ backend parts

    def build_forward_batch(self, scheduler_output: SchedulerOutput, capture_hidden_mode: Any = None) -> SGLangForward:
        batch = scheduler_output.batch_data
        sb = batch.schedule_batch
        if capture_hidden_mode is not None:  # a CaptureHiddenMode from the hooks
            sb.capture_hidden_mode = capture_hidden_mode
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


class SGLangModelWorker:
    """The stage's model worker for admin actions (the reference's ``model_worker``):
    weight updates go through SGLang's own weight updater. Methods return
    ``(success, message)``; the admin lifecycle (omni_async.admin) pauses, drains and
    flushes the radix cache around them."""

    def __init__(self, tp_worker: Any, *, model_path: str, load_format: str = "safetensors") -> None:
        self.tp_worker = tp_worker
        self.model_path = model_path
        self.load_format = load_format

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "load_format": self.load_format}

    def update_weights_from_disk(self, payload: dict[str, Any] | str) -> tuple[bool, str]:
        """``payload``: the admin payload (``model_path``, optional ``load_format``) or a
        path. A failed update leaves the old weights serving (SGLang rolls back)."""
        if isinstance(payload, dict):
            path, load_format = payload.get("model_path"), payload.get("load_format")
        else:
            path, load_format = payload, None
        if not path:
            return False, "update_weights_from_disk needs model_path"
        load_format = load_format or self.load_format
        success, message = True, "Succeeded to update model weights."
        try:
            for _role, runner in self.tp_worker.weight_update_runners():
                success, message = runner.weight_updater.update_weights_from_disk(str(path), load_format)
                if not success:
                    break
        except Exception as exc:  # a bad path or checkpoint must not take the stage down
            return False, f"update_weights_from_disk failed: {exc!r}"
        if success:
            self.model_path = str(path)
        return bool(success), str(message)

    def weights_checker(self, action: str = "checksum") -> dict[str, Any]:
        from ...weights import weights_checksum

        if action != "checksum":
            raise ValueError(f"unsupported weights_checker action {action!r}; use 'checksum'")
        return weights_checksum(self.tp_worker.model_runner.model)
