"""Starting and stopping a tensor-parallel group on one host, and the native stack
over it.

Rank 0 (this process) hosts the TCP store and spawns ranks 1..N-1 (``multiprocessing``
spawn, one device each: ``cuda:k`` .. ``cuda:k+N-1`` for ``device="cuda:k"``, or CPU
with gloo). A watcher thread waits on the workers' process sentinels: a rank that
exits marks the group failed (and on CUDA aborts its communicators, so a collective
waiting on the dead rank returns), and every later step fails with
:class:`~omni_async.errors.RankFailedError`. Closing sends the workers a shutdown
message and joins them, terminating any that do not stop in time, so it always returns.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import multiprocessing.connection
import os
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ....config import SchedulerConfig
from ....errors import ConfigError, RankFailedError
from ....logs import log
from ....core.cpu_choices import LoadPlan
from ....core.facts import CheckpointFacts, DeviceFacts
from ....core.plan import plan_stage
from ..facts import loaded_facts
from ..kv_sizing import kv_cache
from ..stack import assemble_stack, runner_options
from ....models.config import ModelConfig
from ....models.loader import TINY_NAME, tiny_config
from ....stage.watchdog import explicit_step_timeout
from .comm import OP_SHUTDOWN
from .runner import TensorParallelModelWorker, TensorParallelRunner
from .sharding import check_divisible
from .worker import WorkerSpec, join_group, load_rank, worker_main

# Set to HOST:PORT, rank 0 hosts the group's store there and starts no workers: ranks
# 1..N-1 are launched elsewhere (torchrun, other hosts) with ``python -m
# omni_async.backends.native.parallel.worker``. Not tested: only the single-host spawn is.
EXTERNAL_ENV = "OMNI_ASYNC_TP_EXTERNAL"
SETUP_TIMEOUT_S = 300.0  # spawning, joining and loading
JOIN_TIMEOUT_S = 10.0  # a worker's own exit after the shutdown message


def worker_context() -> Any:
    """How worker processes start: from a fork server that imported the worker module
    once (a fresh interpreter would pay torch's import, seconds, for every engine), or
    spawned where there is no fork server. Either way no CUDA state is inherited. The
    fork server keeps the environment it started with (the first engine's)."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["omni_async.backends.native.parallel.worker", "torch._dynamo"])  # meta-device init imports dynamo (~1 s)
        return ctx
    return multiprocessing.get_context("spawn")


class TensorParallelGroup:
    """Rank 0's handle on the worker ranks."""

    def __init__(self, size: int, device: torch.device, timeout_s: float) -> None:
        self.size = size
        self.device = device
        self.timeout_s = timeout_s
        self.comm: Any = None
        self.shard: Any = None
        self.failure: str | None = None
        self._procs: list[Any] = []
        self._lock = threading.Lock()  # one user of the group at a time (steps, calls, close)
        self._closed = False

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # ------------------------------------------------------------ health

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Use the group for one exchange; a failure inside breaks it for good."""
        with self._lock:
            if self.failure is not None:
                raise RankFailedError(self.failure)
            try:
                yield
            except Exception as exc:
                raise self.fail(f"tensor-parallel step failed: {exc!r}") from exc

    def fail(self, why: str) -> RankFailedError:
        if self.failure is None:
            self.failure = why
            log.error("tensor_parallel_failed", error=why)
        return RankFailedError(self.failure)

    def _watch(self) -> None:
        """Wait for any worker process to end; unless closing, that breaks the group."""
        multiprocessing.connection.wait([p.sentinel for p in self._procs])
        if self._closed:
            return
        dead = [f"rank {r} (pid {p.pid}) exited with code {p.exitcode}" for r, p in enumerate(self._procs, 1) if not p.is_alive()]
        self.fail("tensor-parallel " + ", ".join(dead or ["worker exited"]))
        if self.device.type == "cuda" and self.comm is not None:
            self.comm.abort()  # NCCL would otherwise wait on the dead rank until its timeout

    # ------------------------------------------------------------ start and stop

    def start(self, path: str, config: SchedulerConfig, dtype: Any, seed: int) -> WorkerSpec:
        """Host the store, start the workers (unless they are launched elsewhere, see
        ``EXTERNAL_ENV``), join the group."""
        external = os.environ.get(EXTERNAL_ENV)
        host, port = ("127.0.0.1", 0) if not external else (external.rpartition(":")[0] or "0.0.0.0", int(external.rpartition(":")[2]))
        timeout = timedelta(seconds=SETUP_TIMEOUT_S)
        store = dist.TCPStore(host, port, self.size, is_master=True, wait_for_workers=False, timeout=timeout)
        ctx = worker_context()
        base = (self.device.index or 0) if self.device.type == "cuda" else 0
        specs = [
            WorkerSpec(path, dtype, f"cuda:{base + r}" if self.device.type == "cuda" else "cpu", seed, r, self.size, host, store.port, config, self.timeout_s)
            for r in range(self.size)
        ]
        for spec in specs[1:] if not external else []:
            proc = ctx.Process(target=worker_main, args=(spec,), name=f"omni-tp-rank{spec.rank}", daemon=True)
            proc.start()
            self._procs.append(proc)
        if self._procs:
            threading.Thread(target=self._watch, name="omni-tp-watch", daemon=True).start()
        self._store = store
        self.comm = self._join(specs[0], store)
        return specs[0]

    def _join(self, spec: WorkerSpec, store: Any) -> Any:
        """Join the group (it waits for every rank), giving up as soon as a worker
        died on the way (an import error, a bad device) instead of at the timeout."""
        joined: dict[str, Any] = {}

        def join() -> None:
            try:
                joined["comm"] = join_group(spec, store)
            except BaseException as exc:
                joined["error"] = exc

        thread = threading.Thread(target=join, name="omni-tp-join", daemon=True)
        thread.start()
        while thread.is_alive() and self.failure is None:
            thread.join(0.05)
        if "comm" in joined:
            return joined["comm"]
        raise RankFailedError(self.failure or f"tensor-parallel group did not form: {joined.get('error')!r}")

    def model_worker(self, loaded: Any) -> TensorParallelModelWorker:
        return TensorParallelModelWorker(loaded, self)

    def close(self) -> None:
        """Stop every worker; bounded even when a rank hangs or a step was abandoned."""
        if self._closed:
            return
        self._closed = True
        if self.failure is None and self.comm is not None and self._lock.acquire(timeout=1.0):
            try:
                self.comm.send_header([OP_SHUTDOWN])
            except Exception:
                pass
            finally:
                self._lock.release()
        for proc in self._procs:
            proc.join(JOIN_TIMEOUT_S)
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.failure = self.failure or "tensor-parallel group closed"
        if self.device.type == "cuda" and self.comm is not None:
            self.comm.abort()  # release the communicators now rather than at collection


def peek_config(path: str) -> ModelConfig | None:
    """The full model's config without loading weights (None when only the loader
    can tell, e.g. GGUF)."""
    if path == TINY_NAME:
        return tiny_config()
    config_path = Path(path) / "config.json"
    if config_path.is_file():
        return ModelConfig.from_hf(json.loads(config_path.read_text()))
    return None


def check_devices(device: torch.device, size: int) -> None:
    if device.type == "cuda":
        first = device.index or 0
        if first + size > torch.cuda.device_count():
            raise ConfigError(
                f"tensor_parallel_size={size} on {device} needs CUDA devices {first}..{first + size - 1}, "
                f"but {torch.cuda.device_count()} are visible"
            )
    elif device.type != "cpu":
        raise ConfigError(f"tensor parallelism runs on cuda or cpu, not {device}")


def build_parallel_stack(path_or_name: str, load: LoadPlan, machine: DeviceFacts, stored: CheckpointFacts, *,
                         device: torch.device, seed: int, asked_dtype: Any = None) -> Any:
    """The native stack on rank 0 with the workers started; every rank has loaded its
    shard and allocated the same number of KV pages when this returns. ``load``: the
    plan's decisions before loading; ``machine`` and ``stored``: the facts read at the
    plan's entry; ``asked_dtype``: the caller's dtype (what the plan reports)."""
    config, dtype = load.config, load.dtype
    size = config.tensor_parallel_size
    check_devices(device, size)
    cfg = peek_config(str(path_or_name))
    if cfg is not None:
        check_divisible(cfg, size)
    timeout_s = max(explicit_step_timeout(config.step_timeout_s) or 0.0, 300.0)
    group = TensorParallelGroup(size, device, timeout_s)
    try:
        spec = group.start(str(path_or_name), config, dtype, seed)
        loaded, group.shard, num_pages = load_rank(spec, group.comm)
        plan = plan_stage(config, *loaded_facts(machine, stored, device, loaded), dtype=asked_dtype, agreed_kv_pages=num_pages,
                          load=load)
        runner = TensorParallelRunner(
            loaded.model, kv_cache(loaded, plan.page_size, device, num_pages), device, group=group, seed=seed,
            **runner_options(plan, plan.config.fused_kernels),
        )
        return assemble_stack(loaded, plan, device, runner, tensor_parallel=group)
    except BaseException:
        group.close()
        raise
