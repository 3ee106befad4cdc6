"""Rank 0's side of a step and of a weight update.

The runner is the native runner with one addition: before its own forward it sends
the workers the step's forward inputs (:mod:`.plan`), so every rank runs the same
forward and meets the same collectives; sampling happens here only, on the gathered
logits. Any failure inside a step breaks the group (the ranks are out of step), so the
step and every later one fail with :class:`~omni_async.errors.RankFailedError`.

Weight updates and the checksum run on every rank (each on its own shard), and succeed
only when every rank did.
"""

from __future__ import annotations

import hashlib
import io
import json
from typing import Any

import torch

from ....errors import InvalidRequestError, RankFailedError
from ....models.loader import LoadedModel
from ....runners.forward_batch import ForwardBatch
from ....runners.native import NativeModelRunner
from ....runners.types import BatchResult
from ..weights import NativeModelWorker
from . import plan
from .comm import OP_CALL, OP_CAPTURE


class TensorParallelRunner(NativeModelRunner):
    def __init__(self, model: Any, kv: Any, device: torch.device, *, group: Any, seed: int = 0, **options: Any) -> None:
        super().__init__(model, kv, device, seed=seed, **options)
        self.group = group

    def forward(self, forward_batch: ForwardBatch) -> BatchResult:
        if forward_batch.input_embeds is not None:  # the other ranks would see token ids only
            raise InvalidRequestError("input_embeds are not supported with tensor parallelism")
        graphed = forward_batch.block_tables if self.graphs is not None else None
        header, payload = plan.pack(forward_batch.input_ids, forward_batch.positions, forward_batch.ctx, graphed)
        with self.group.step():
            self.group.comm.send_header(header)
            self.group.comm.broadcast_data(payload)
            return super().forward(forward_batch)

    def enable_cuda_graphs(self, *, scratch_page: int, max_len: int, max_batch: int) -> None:
        """Every rank captures the same buckets in the same order: the captures run
        the collectives, so they must run in lockstep."""
        with self.group.step():
            self.group.comm.send_header([OP_CAPTURE, scratch_page, max_len, max_batch])
            super().enable_cuda_graphs(scratch_page=scratch_page, max_len=max_len, max_batch=max_batch)


class TensorParallelModelWorker(NativeModelWorker):
    """Weight lifecycle across the ranks: each call runs on every rank's shard."""

    def __init__(self, loaded: LoadedModel, group: Any) -> None:
        super().__init__(loaded.model, model_path=loaded.path, load_format=loaded.load_format, device=group.device, shard=group.shard)
        self.group = group

    def _everywhere(self, method: str, args: tuple, local: Any) -> tuple[bool, list[tuple[bool, str]]]:
        """Send the call, run it here, gather every rank's (ok, message); the group is
        held throughout, so no step (an inline decode launch) slips in between."""
        try:
            with self.group.step():
                self.group.comm.send_object(OP_CALL, (method, args))
                try:
                    result = local()
                    ok, message = result if isinstance(result, tuple) else (True, json.dumps(result))
                except Exception as exc:
                    ok, message = False, f"rank 0: {exc!r}"
                statuses = self.group.comm.gather_status(ok, message)
        except RankFailedError as exc:
            return False, [(False, str(exc))]
        return all(s for s, _m in statuses), statuses

    @staticmethod
    def _outcome(ok: bool, statuses: list[tuple[bool, str]]) -> tuple[bool, str]:
        if ok:
            return True, statuses[0][1]
        return False, "; ".join(m for s, m in statuses if not s) or "a rank failed"

    def update_weights_from_disk(self, payload: dict[str, Any]) -> tuple[bool, str]:
        ok, statuses = self._everywhere("update_weights_from_disk", (payload,), lambda: super(TensorParallelModelWorker, self).update_weights_from_disk(payload))
        return self._outcome(ok, statuses)

    def update_weights_from_tensor(self, payload: dict[str, Any]) -> tuple[bool, str]:
        """The full tensors go to every rank (serialized once); each keeps its slice."""
        sent = dict(payload)
        named = payload.get("named_tensors")
        if named is not None:
            pairs = list(named.items()) if isinstance(named, dict) else [(str(n), t) for n, t in named]
            buf = io.BytesIO()
            torch.save([(n, t.detach().to("cpu")) for n, t in pairs], buf)
            sent = {k: v for k, v in payload.items() if k != "named_tensors"}
            sent["serialized_named_tensors"] = buf.getvalue()
        ok, statuses = self._everywhere("update_weights_from_tensor", (sent,), lambda: super(TensorParallelModelWorker, self).update_weights_from_tensor(payload))
        return self._outcome(ok, statuses)

    def weights_checker(self, action: str = "checksum") -> dict[str, Any]:
        """SHA-256 over the ranks' own checksums, in rank order."""
        if action != "checksum":
            raise ValueError(f"unsupported weights_checker action {action!r}; use 'checksum'")
        ok, statuses = self._everywhere("weights_checker", (action,), lambda: super(TensorParallelModelWorker, self).weights_checker(action))
        if not ok:
            raise RankFailedError(self._outcome(ok, statuses)[1])
        per_rank = [json.loads(m) for _s, m in statuses]
        digest = hashlib.sha256("|".join(r["checksum"] for r in per_rank).encode()).hexdigest()
        return {"checksum": digest, "num_parameters": sum(r["num_parameters"] for r in per_rank), "rank_checksums": [r["checksum"] for r in per_rank]}

    # ------------------------------------------------------------ a trainer's group

    def init_weights_update_group(self, payload: dict[str, Any]) -> tuple[bool, str]:
        """Every rank joins the trainer's group (rank ``rank_offset + tp_rank``; the
        trainer's world counts all of them). Joining waits for the trainer, so the
        workers join in the background and steps go on; rank 0 joins here (a thread of
        its own), then collects the workers' outcomes."""
        ok, statuses = self._everywhere("init_group_start", (payload,), lambda: (True, "joining"))
        if not ok:
            return self._outcome(ok, statuses)
        mine = super().init_weights_update_group(payload)
        wait_s = float(payload.get("timeout_s", 300)) + 30.0
        return self._outcome(*self._everywhere("init_group_wait", (wait_s,), lambda: mine))

    def update_weights_from_distributed(self, payload: dict[str, Any]) -> tuple[bool, str]:
        """Every rank receives the trainer's whole tensors and keeps its slice."""
        local = lambda: super(TensorParallelModelWorker, self).update_weights_from_distributed(payload)  # noqa: E731
        return self._outcome(*self._everywhere("update_weights_from_distributed", (payload,), local))

    def destroy_weights_update_group(self, payload: dict[str, Any]) -> tuple[bool, str]:
        local = lambda: super(TensorParallelModelWorker, self).destroy_weights_update_group(payload)  # noqa: E731
        return self._outcome(*self._everywhere("destroy_weights_update_group", (payload,), local))
