"""The collectives of one tensor-parallel group, and the control messages rank 0
sends its workers.

Two process groups over one TCP store, built directly (no ``init_process_group``, so
several engines, and a trainer's own group, can live in one process):

- ``ctrl`` (gloo, CPU): a fixed-size int64 header per message (what to do next and the
  shapes that follow), pickled objects for the rare calls (weight updates), and each
  rank's status after a call. Idle workers wait here, so its timeout is long; rank 0
  passes its own, shorter, per operation.
- ``data`` (NCCL on CUDA, gloo on CPU): the model's all-reduces and all-gathers and
  each step's forward inputs, device to device.
"""

from __future__ import annotations

import os
import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

HEADER_LEN = 80
OP_FORWARD, OP_CALL, OP_CAPTURE, OP_SHUTDOWN = 1, 2, 3, 4
STATUS_BYTES = 4096
IDLE_WAIT = timedelta(days=365)  # a worker waits this long for rank 0's next message


def _options(cls: Any, timeout: timedelta, **fields: Any) -> Any:
    opts = cls()
    for name, value in fields.items():
        setattr(opts, name, value)
    opts.timeout = timeout
    return opts


# Read when an NCCL group is built: on a timeout or error, abort the communicators and
# let the collective raise (2), instead of torch's default of ending the process (3):
# rank 0 is the caller's process, and a dead worker must fail requests, not the caller.
_NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0"}


def _nccl_group(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    unset = [k for k in _NCCL_ENV if k not in os.environ]  # a user's own setting wins
    os.environ.update({k: _NCCL_ENV[k] for k in unset})
    try:
        try:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
        except AttributeError:  # an older binding: NCCL's default timeout applies
            return dist.ProcessGroupNCCL(store, rank, size)
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    finally:
        for k in unset:
            os.environ.pop(k, None)


class GroupComm:
    """One rank's end of the group."""

    def __init__(self, store: Any, rank: int, size: int, device: torch.device, timeout_s: float) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        self.ctrl = dist.ProcessGroupGloo(dist.PrefixStore("omni-tp/ctrl", store), rank, size, IDLE_WAIT)
        data_store = dist.PrefixStore("omni-tp/data", store)
        if device.type == "cuda":
            self.data = _nccl_group(data_store, rank, size, self.timeout)
        else:
            self.data = dist.ProcessGroupGloo(data_store, rank, size, self.timeout)

    # ------------------------------------------------------------ the model's collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        self.data.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` side by side along the last dimension (rank order)."""
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        self.data._allgather_base(out, x).wait()
        return out.view(self.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def broadcast_data(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` into every rank's ``t`` (device to device)."""
        self.data.broadcast([t], _options(dist.BroadcastOptions, self.timeout, rootRank=0)).wait()
        return t

    # ------------------------------------------------------------ control messages

    def send_header(self, values: list[int]) -> None:
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[: len(values)] = torch.tensor(values, dtype=torch.int64)
        self.ctrl.broadcast([header], _options(dist.BroadcastOptions, self.timeout, rootRank=0)).wait()

    def recv_header(self) -> list[int]:
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        self.ctrl.broadcast([header], _options(dist.BroadcastOptions, IDLE_WAIT, rootRank=0)).wait()
        return header.tolist()

    def send_object(self, op: int, obj: Any) -> None:
        """A header naming ``op`` and the pickle's length, then the pickle."""
        blob = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self.send_header([op, blob.numel()])
        self.ctrl.broadcast([blob], _options(dist.BroadcastOptions, self.timeout, rootRank=0)).wait()

    def recv_object(self, nbytes: int) -> Any:
        blob = torch.empty(nbytes, dtype=torch.uint8)
        self.ctrl.broadcast([blob], _options(dist.BroadcastOptions, self.timeout, rootRank=0)).wait()
        return pickle.loads(blob.numpy().tobytes())

    def gather_status(self, ok: bool, message: str = "") -> list[tuple[bool, str]]:
        """Every rank's (ok, message), on every rank (messages cut to 4 KiB)."""
        raw = message.encode()[: STATUS_BYTES - 1]
        mine = torch.zeros(STATUS_BYTES, dtype=torch.uint8)
        mine[0] = 1 if ok else 0
        mine[1 : 1 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else mine[1:1]
        outs = [torch.empty_like(mine) for _ in range(self.size)]
        self.ctrl.allgather(outs, mine, self.timeout).wait()
        return [(bool(o[0]), bytes(o[1:].numpy()).rstrip(b"\0").decode(errors="replace")) for o in outs]

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        self.ctrl.allreduce([t], _options(dist.AllreduceOptions, self.timeout, reduceOp=dist.ReduceOp.MIN)).wait()
        return int(t.item())

    def abort(self) -> None:
        """Tear the data group down so a collective blocked on a dead peer returns
        (NCCL kernels otherwise spin until the watchdog)."""
        for group in (self.data, self.ctrl):
            try:
                group.abort()
            except Exception:
                pass
