"""The facts a native stage's plan is made from (:mod:`omni_async.core.plan`), read from
the machine, the device and the checkpoint. Reading is all this module does; the
decisions are the plan's.

Each fact is read once: :func:`entry_facts` at the plan's entry (the machine, the CPU,
whether the C++ kernels build when a decision could turn on it, the checkpoint's
storage), then :func:`loaded_facts` adds what loading the weights decides (the memory
they leave, the loaded model's shape) to those, without reading the rest again."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from ...config import SchedulerConfig
from ...core.cpu_choices import kernels_may_matter
from ...core.facts import CheckpointFacts, DeviceFacts
from ...errors import ConfigError
from ...kernels import triton_available
from ...logs import log
from ...memory_budget import device_total_bytes, model_bytes
from ...models.loader import LoadedModel
from ...runners.cuda_graphs import DEFAULT_BUCKETS

CPU_FLAGS_FILE = "/proc/cpuinfo"
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_REDUCED = ("bfloat16", "float16", "bf16", "fp16", "half")


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """Whether the CPU has bfloat16 dot-product instructions (read from /proc/cpuinfo;
    False where that cannot be read)."""
    try:
        text = Path(CPU_FLAGS_FILE).read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return any(flag in line.split() for flag in BF16_FLAGS)
    return False


def stored_in_reduced_precision(path_or_name: Any) -> bool:
    """A GGUF file (16-bit or quantised tensors), ``smollm2``, or a folder whose config
    names a 16-bit dtype; False for float32 folders and the built-in ``tiny``."""
    from ...models.gguf import SMOLLM2_NAME, is_gguf_path

    name = str(path_or_name)
    if name == SMOLLM2_NAME or is_gguf_path(name):
        return True
    try:
        raw = json.loads((Path(name) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return str(raw.get("torch_dtype") or raw.get("dtype") or "float32") in _REDUCED


@functools.lru_cache(maxsize=1)
def kernels_build() -> bool:
    """Whether the C++ kernel sets are built for this torch (scripts/setup.sh builds them)
    and load. When they are not, a background build starts (said on stderr, with an
    estimate) and this start answers no: it serves with the torch ops rather than wait.
    ``OMNI_ASYNC_CPU_KERNELS=0`` answers no without trying."""
    if os.environ.get("OMNI_ASYNC_CPU_KERNELS", "").strip().lower() in ("0", "false", "no", "off"):
        return False
    from ...kernels.cpu_kernels import all_kernels, ensure_built_in_background

    if not ensure_built_in_background():
        return False
    try:
        for kernels in all_kernels():
            kernels.load()
    except ConfigError as exc:
        log.warning("cpu_kernels_unavailable", error=str(exc))
        print(f"omni-async: the C++ CPU kernels could not be built, running the torch ops instead ({exc})", file=sys.stderr)
        return False
    return True


def is_gguf_source(path_or_name: Any) -> bool:
    from ...models.gguf import SMOLLM2_NAME, is_gguf_path

    return str(path_or_name) == SMOLLM2_NAME or is_gguf_path(path_or_name)


def available_memory_bytes() -> int | None:
    """Memory available to new allocations now (psutil when installed, else sysconf)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.lru_cache(maxsize=1)
def load_average() -> float | None:
    """The machine's 1-minute load average, read once per process: the thread count it
    decides is process-wide, so a second engine keeps the first one's (None where the
    OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def threads_variable() -> str | None:
    """``NAME=value`` of the variable that fixed torch's thread count, if one is set."""
    for name in THREAD_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value:
            return f"{name}={value}"
    return None


def device_facts(device: torch.device) -> DeviceFacts:
    """The device as it is now; whether the C++ CPU kernels build is left False
    (:func:`entry_facts` learns it when a decision could turn on it: seconds the first
    time), and the free memory is read again once the weights are loaded
    (:func:`loaded_facts`: the KV gets what they leave)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return DeviceFacts(
            type="cuda", total_bytes=int(total), free_bytes=int(free),
            paged_kernel=triton_available(device), graph_buckets=DEFAULT_BUCKETS,
        )
    return DeviceFacts(
        type=device.type,
        total_bytes=device_total_bytes(device),
        free_bytes=available_memory_bytes(),
        native_bf16=cpu_has_native_bf16(),
        graph_buckets=DEFAULT_BUCKETS,
        cpus=usable_cpus(),
        load_average=load_average(),
        intra_op_threads=torch.get_num_threads(),
        threads_env=threads_variable(),
    )


def checkpoint_facts(path_or_name: Any, loaded: LoadedModel | None = None) -> CheckpointFacts:
    """The checkpoint's facts: before loading its storage only; with the loaded model its
    shape (the local shard's under tensor parallelism) and weights too."""
    stored = CheckpointFacts(reduced_precision=stored_in_reduced_precision(path_or_name), gguf=is_gguf_source(path_or_name))
    return stored if loaded is None else with_shape(stored, loaded)


def with_shape(checkpoint: CheckpointFacts, loaded: LoadedModel) -> CheckpointFacts:
    """``checkpoint`` with the loaded model's shape, dtype and weight bytes."""
    cfg = loaded.model.config
    return dataclasses.replace(
        checkpoint,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        hidden_size=cfg.hidden_size,
        # a sparse block's routed rows are wider than its dense layers' MLP
        intermediate_size=max(cfg.intermediate_size, cfg.moe.activation_width(cfg.hidden_size) if cfg.moe else 0),
        vocab_size=cfg.vocab_size,
        max_position_embeddings=loaded.config.max_position_embeddings,
        dtype=str(next(loaded.model.parameters()).dtype).replace("torch.", ""),
        weights_bytes=model_bytes(loaded.model),
    )


def entry_facts(path_or_name: Any, device: torch.device, config: SchedulerConfig, dtype: Any = None
                ) -> tuple[DeviceFacts, CheckpointFacts]:
    """The facts the plan starts from, each read once: the device and the CPU, the C++
    kernels' build only when a decision could turn on it (:func:`kernels_may_matter`),
    and the checkpoint's storage."""
    checkpoint = checkpoint_facts(path_or_name)
    machine = device_facts(device)
    if kernels_may_matter(config, machine, checkpoint, dtype):
        machine = dataclasses.replace(machine, cpu_kernels_build=kernels_build())
    return machine, checkpoint


def loaded_facts(machine: DeviceFacts, checkpoint: CheckpointFacts, device: torch.device, loaded: LoadedModel
                 ) -> tuple[DeviceFacts, CheckpointFacts]:
    """The entry facts with what loading decided: the memory the weights left free (the
    KV gets it) and the loaded model's shape (the local shard's under tensor
    parallelism)."""
    if device.type == "cuda":
        free: int | None = int(torch.cuda.mem_get_info(device)[0])
    else:
        free = available_memory_bytes()
    return dataclasses.replace(machine, free_bytes=free), with_shape(checkpoint, loaded)
