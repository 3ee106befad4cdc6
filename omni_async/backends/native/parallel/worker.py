"""The worker ranks: join the group, load this rank's shard, then follow rank 0.

Every message starts with a header broadcast on the control group: a step's forward
inputs (run the same forward, or replay the same CUDA graph, taking part in its
collectives), a call (a weight update or checksum on this rank's shard, answered with
a status every rank sees), a CUDA graph capture (in lockstep with rank 0, whose
captures contain the same collectives), or shutdown. A worker whose group breaks (rank
0 died, a collective failed) exits.

The same entry point serves a multi-node launch: ``python -m omni_async.backends.native.parallel.worker``
under ``torchrun`` reads its rank and the store's address from the environment (see the
README's tensor-parallel section; only the single-host spawn is tested).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..kv_sizing import kv_cache, rank_kv_pages
from ....config import SchedulerConfig
from ....errors import ModelLoadError
from ....kernels import triton_available
from ....models.loader import LoadedModel, load_model
from ....runners.cuda_graphs import DecodeGraphs
from ..weights import NativeModelWorker
from . import plan
from .comm import OP_CALL, OP_CAPTURE, OP_FORWARD, OP_SHUTDOWN, GroupComm
from .sharding import TensorParallelShard


@dataclass
class WorkerSpec:
    """What one rank needs to join the group and load its shard (picklable)."""

    path: str
    dtype: Any
    device: str
    seed: int
    rank: int
    size: int
    host: str
    port: int
    config: SchedulerConfig
    timeout_s: float


def join_group(spec: WorkerSpec, store: Any = None) -> GroupComm:
    """Rank 0 passes the store it hosts; workers connect to it."""
    if store is None:
        store = dist.TCPStore(spec.host, spec.port, spec.size, is_master=False, timeout=timedelta(seconds=spec.timeout_s))
    return GroupComm(store, spec.rank, spec.size, torch.device(spec.device), spec.timeout_s)


def load_rank(spec: WorkerSpec, comm: GroupComm) -> tuple[LoadedModel, TensorParallelShard, int]:
    """Collective on every rank: load this rank's shard, compare every rank's outcome,
    agree on the KV page count (the smallest any rank can hold)."""
    shard = TensorParallelShard(spec.rank, spec.size, comm.all_reduce, comm.all_gather_last)
    loaded, error = None, None
    try:
        loaded = load_model(spec.path, dtype=spec.dtype, device=spec.device, seed=spec.seed, shard=shard)
    except Exception as exc:
        error = exc
    statuses = comm.gather_status(error is None, f"rank {spec.rank}: {error}" if error is not None else "")
    if error is not None:
        raise error
    failed = [message for ok, message in statuses if not ok]
    if failed or loaded is None:
        raise ModelLoadError("tensor-parallel load failed: " + "; ".join(failed))
    num_pages = comm.min_int(rank_kv_pages(spec.config, loaded, torch.device(spec.device)))
    return loaded, shard, num_pages


class WorkerLoop:
    def __init__(self, comm: GroupComm, loaded: LoadedModel, shard: TensorParallelShard, num_pages: int, spec: WorkerSpec) -> None:
        self.comm = comm
        self.rank = spec.rank
        self.device = torch.device(spec.device)
        self.model = loaded.model
        self.kv = kv_cache(loaded, spec.config.page_size, self.device, num_pages)
        if spec.config.fused_kernels and triton_available(self.device):
            from ....kernels.fused import FusedOps  # the same elementwise kernels as rank 0

            self.model.ops = FusedOps()
        self.graphs: DecodeGraphs | None = None
        self.weights = NativeModelWorker(loaded.model, model_path=loaded.path, load_format=loaded.load_format, device=self.device, shard=shard)

    def run(self) -> None:
        while True:
            header = self.comm.recv_header()
            op = header[0]
            if op == OP_FORWARD:
                self.forward(header)
            elif op == OP_CALL:
                self.call(*self.comm.recv_object(header[1]))
            elif op == OP_CAPTURE:
                self.capture(*header[1:4])
            elif op == OP_SHUTDOWN:
                return
            else:
                raise RuntimeError(f"rank {self.rank}: unknown message {op}")

    @torch.inference_mode()
    def forward(self, header: list[int]) -> None:
        payload = torch.empty(plan.payload_numel(header), dtype=torch.int64, device=self.device)
        inputs = plan.unpack(header, self.comm.broadcast_data(payload))
        ctx = inputs.ctx
        if inputs.graph_tables is not None and self.graphs is not None:
            self.graphs.replay(inputs.input_ids, inputs.positions, ctx.slot_mapping, inputs.graph_tables, ctx.kv_lens)
        else:
            self.model(inputs.input_ids, inputs.positions, self.kv, ctx)

    def call(self, method: str, args: tuple) -> None:
        """A weight update or checksum on this rank's shard (or one of the ``rpc_``
        methods below); every rank sees each rank's (ok, message)."""
        try:
            fn = getattr(self, "rpc_" + method, None) or getattr(self.weights, method)
            result = fn(*args)
            ok, message = result if isinstance(result, tuple) else (True, json.dumps(result))
        except Exception as exc:
            ok, message = False, f"rank {self.rank}: {exc!r}"
        self.comm.gather_status(ok, message)

    def rpc_init_group_start(self, payload: dict[str, Any]) -> tuple[bool, str]:
        """Start joining a trainer's group as ``rank_offset + rank`` in the background
        (joining waits for every member, and this rank keeps serving steps meanwhile)."""
        payload = dict(payload, rank_offset=int(payload.get("rank_offset", 1)) + self.rank)
        self._joining = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="omni-tp-join").submit(
            self.weights.init_weights_update_group, payload
        )
        return True, "joining"

    def rpc_init_group_wait(self, timeout_s: float) -> tuple[bool, str]:
        try:
            return self._joining.result(timeout=timeout_s)
        except Exception as exc:
            return False, f"rank {self.rank}: joining the weights update group failed: {exc!r}"

    def capture(self, scratch_page: int, max_len: int, max_batch: int) -> None:
        self.graphs = DecodeGraphs(
            self.model,
            self.kv,
            scratch_page=scratch_page,
            max_pages_per_seq=-(-max_len // self.kv.page_size),
            max_batch=max_batch,
            device=self.device,
            use_kernel=triton_available(self.device),
        )
        self.graphs.capture_all()


def worker_main(spec: WorkerSpec, store: Any = None) -> None:
    """A worker rank's whole life (the target of the spawned process)."""
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # CPU ranks share the cores: without this their thread pools fight (10x slower)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.size))
    try:
        comm = join_group(spec, store)
        loaded, shard, num_pages = load_rank(spec, comm)
        WorkerLoop(comm, loaded, shard, num_pages, spec).run()
    except Exception as exc:  # the group broke or the load failed: rank 0 reports it
        print(f"omni-async tensor-parallel rank {spec.rank} stopped: {exc!r}", file=sys.stderr, flush=True)
        sys.exit(1)


def main() -> None:
    """Entry for workers launched by ``torchrun`` (or any launcher) on other hosts,
    joining an engine started with ``OMNI_ASYNC_TP_EXTERNAL=HOST:PORT``. From the
    launcher's environment: ``RANK`` (this process's rank is ``rank_offset + RANK``)
    and ``LOCAL_RANK`` (the GPU); from ``OMNI_ASYNC_TP_SPEC``, a JSON object: ``path``,
    ``host`` and ``port`` (the engine's store), ``size`` (the engine's
    tensor_parallel_size), and optionally ``rank_offset`` (default 1), ``dtype``,
    ``seed`` and ``config`` (SchedulerConfig fields: page_size and the KV sizing must
    match the engine's)."""
    extra = json.loads(os.environ["OMNI_ASYNC_TP_SPEC"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    spec = WorkerSpec(
        path=extra["path"],
        dtype=extra.get("dtype"),
        device=f"cuda:{local}" if torch.cuda.is_available() else "cpu",
        seed=int(extra.get("seed", 0)),
        rank=int(extra.get("rank_offset", 1)) + int(os.environ.get("RANK", "0")),
        size=int(extra["size"]),
        host=str(extra["host"]),
        port=int(extra["port"]),
        config=SchedulerConfig(**extra.get("config", {})),
        timeout_s=float(extra.get("timeout_s", 300)),
    )
    worker_main(spec)


if __name__ == "__main__":
    main()
